"""All-gather between the ranks of one host through shared memory: a decode step's per-layer
exchange in microseconds, where gloo's TCP round trip costs 0.6-0.9 ms on a small VM, and a ZeRO-1
step's reduce-scatter and all-gather (executor/zero.py).

One file in /dev/shm, mapped by every rank and unlinked as soon as all have it (nothing is left
behind, even by a killed run). It holds one counter per rank and two buffers per rank, used in
turn: a rank writes gather ``n`` into its buffer ``n % 2`` once every peer has posted gather
``n - 1`` (so none still reads gather ``n - 2`` there), posts ``n``, waits for every peer to post
``n``, and reads their buffers. Stores reach the other cores in program order on x86-64 (TSO), the
only architecture this path is used on; elsewhere, and for tensors over the buffer size, the
caller uses torch.distributed. Details: docs/executor.md ("Collectives of a decode step").
"""

from __future__ import annotations

import mmap
import os
import platform
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["SHM_DIR", "ShmGather", "usable"]

SHM_DIR = Path("/dev/shm")
_HEADER = 64  # bytes per rank counter (a cache line each)
_WORDS = _HEADER // 8  # int64 words from one counter to the next


def usable(world: int) -> bool:
    """Whether the ranks can gather through shared memory: all on this host, on x86-64, with /dev/shm."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == world
    return world > 1 and local and platform.machine() in ("x86_64", "AMD64") and SHM_DIR.is_dir()


class ShmGather:
    """``stacked(t)``: an all-gather among ``world`` ranks of this host, ``rank`` this one's index
    in ``group`` (collective set-up: every rank of the group constructs it at the same point,
    after ``init_process_group``). ``capacity``: the largest tensor in bytes."""

    def __init__(self, rank: int, world: int, capacity: int, timeout_s: float, group: Any = None) -> None:
        self.rank, self.world, self.capacity, self.timeout_s = rank, world, capacity, timeout_s
        size = world * _HEADER + world * 2 * capacity
        names = [f"tessera-gather-{uuid.uuid4().hex}" if rank == 0 else ""]
        dist.broadcast_object_list(names, group=group, group_src=0)
        path = SHM_DIR / names[0]
        if rank == 0:
            with path.open("wb") as f:
                f.truncate(size)
        dist.barrier(group=group)
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), size)
        dist.barrier(group=group)  # every rank has it mapped: the name is no longer needed
        if rank == 0:
            path.unlink(missing_ok=True)
        # The counters as Python ints through a memoryview (a read is ~50 ns, where a numpy or torch
        # scalar costs microseconds), the buffers as one torch view: a gather is a handful of calls.
        self._counters = memoryview(self._map).cast("q")
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=world * _HEADER).view(
            world, 2, capacity
        )
        self._peers = [r * _WORDS for r in range(world) if r != rank]
        self._views: dict[tuple[int, int, int, int], tuple[Tensor, Tensor]] = {}  # (parity, size, lo, hi)
        self.count = 0

    def fits(self, t: Tensor) -> bool:
        return t.device.type == "cpu" and t.numel() * t.element_size() <= self.capacity

    def stacked(self, t: Tensor, part: tuple[int, int] | None = None) -> Tensor:
        """Every rank's ``t`` (same shape and dtype on every rank) stacked in rank order: ``[world,
        *t.shape]``, one copy out of the shared buffers; ``part``: elements ``[lo, hi)`` of each
        rank's ``t`` flattened alone, ``[world, hi - lo]`` (a reduce-scatter's shard)."""
        n = self.count + 1
        self._wait(n - 1)  # no peer still reads gather n - 2 from the buffer this one reuses
        size = t.numel() * t.element_size()
        lo, hi = (0, size) if part is None else (part[0] * t.element_size(), part[1] * t.element_size())
        key = (n & 1, size, lo, hi)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = (self._slots[self.rank, n & 1, :size], self._slots[:, n & 1, lo:hi])
        views[0].copy_(t.detach().reshape(-1).view(torch.uint8))
        self._counters[self.rank * _WORDS] = n  # stores reach the peers in program order (TSO)
        self.count = n
        self._wait(n)
        parts = views[1].clone().view(t.dtype)
        return parts.view(self.world, *t.shape) if part is None else parts

    def _wait(self, n: int) -> None:
        counters = self._counters
        for peer in self._peers:
            if counters[peer] < n:
                self._spin(peer, n)

    def _spin(self, peer: int, n: int) -> None:
        counters, deadline, spins = self._counters, None, 0
        while counters[peer] < n:
            spins += 1
            if spins % 4096 == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    late = [r for r in range(self.world) if counters[r * _WORDS] < n]
                    raise TimeoutError(f"rank(s) {late} did not reach gather {n} within {self.timeout_s:g} s")
            os.sched_yield()
