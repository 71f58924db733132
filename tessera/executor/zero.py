"""ZeRO-1 for a stage's data-parallel replicas (a stage's ``zero``): its weights and gradients as
two flat buffers, each replica the owner of one contiguous shard. A step reduce-scatters the
gradients (each replica gets its shard summed over the group), steps the optimizer on its shard
only (1/d of the optimizer state), and all-gathers the updated weights: the traffic of one
all-reduce. Optimizers update element by element, so this trains as one process does.
See docs/executor.md ("ZeRO-1").
"""

from __future__ import annotations

import math
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.executor.gradients import by_dtype
from tessera.executor.shm_gather import SHM_DIR, ShmGather, usable

__all__ = ["ZeroShard", "gather_shards", "host_exchange", "scatter_sum", "zero_shards"]


def scatter_sum(out: Tensor, full: Tensor, group: Any = None, shm: ShmGather | None = None) -> None:
    """Reduce-scatter: ``out`` gets this rank's shard (``full`` in equal parts, by rank in
    ``group``) of ``full`` summed over the group; through ``shm`` (the group's ranks on one host:
    each rank's part of every rank's ``full``, summed in rank order) where given."""
    if shm is None:
        dist.reduce_scatter_single(out, full, group=group)
        return
    lo = shm.rank * out.numel()
    torch.sum(shm.stacked(full, part=(lo, lo + out.numel())), dim=0, out=out)


def gather_shards(full: Tensor, shard: Tensor, group: Any = None, shm: ShmGather | None = None) -> None:
    """All-gather: every rank's ``shard`` into its place in ``full`` (through ``shm`` where given)."""
    if shm is None:
        dist.all_gather_single(full, shard.detach().clone(), group=group)
        return
    full.copy_(shm.stacked(shard.detach()).reshape(-1))


def host_exchange(nbytes: int, group: Any, timeout_s: float) -> ShmGather | None:
    """A shared-memory exchange for a ZeRO-1 pair of ``nbytes`` over ``group`` where every rank of
    the job is on this host, on the CPU (collective: every rank of ``group`` calls it at the same
    point), with room for twice its buffers in /dev/shm; None elsewhere (torch.distributed's
    collectives). gloo's reduce-scatter and all-gather cost 3-4 ms from 16 KiB to 1 MiB on a 2-core
    VM and vary by half from run to run (docs/executor.md, "ZeRO-1")."""
    if not usable(dist.get_world_size()) or dist.get_backend(group) != "gloo":
        return None
    world = dist.get_world_size(group)
    room = [shutil.disk_usage(SHM_DIR).free > 2 * world * 2 * nbytes]  # the group's first rank decides
    dist.broadcast_object_list(room, group=group, group_src=0)
    return ShmGather(dist.get_rank(group), world, nbytes, timeout_s, group=group) if room[0] else None


class ZeroShard:
    """``params`` (one replica's weights of a stage) sharded over ``group``, where this replica is
    ``index`` of ``size``. The weights become views of one flat buffer (the stage's program keeps
    reading them); ``shard`` is the leaf the optimizer steps, a view of this replica's part. One
    dtype: :func:`zero_shards` makes a shard per dtype."""

    def __init__(
        self, params: list[Tensor], group: Any, index: int, size: int, timeout_s: float = 300.0
    ) -> None:
        self.group = group
        numel = sum(p.numel() for p in params)
        chunk = math.ceil(numel / size)
        like = params[0]
        self.weights = torch.zeros(chunk * size, dtype=like.dtype, device=like.device)
        self.grads = torch.zeros_like(self.weights)
        offset = 0
        for p in params:
            n = p.numel()
            self.weights[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.weights[offset : offset + n].view_as(p)
            p.grad = self.grads[offset : offset + n].view_as(p)  # the backward accumulates here
            offset += n
        lo = index * chunk
        self.shard = torch.nn.Parameter(self.weights[lo : lo + chunk])  # shares the buffer
        self.shard.grad = torch.zeros(chunk, dtype=like.dtype, device=like.device)
        self.shm = host_exchange(self.grads.numel() * self.grads.element_size(), group, timeout_s)

    def reduce_scatter(self) -> None:
        """This replica's shard of the gradients, summed over the group, into ``shard.grad``."""
        assert self.shard.grad is not None
        scatter_sum(self.shard.grad, self.grads, self.group, self.shm)

    def all_gather(self) -> None:
        """Every replica's updated shard into every replica's weights."""
        with torch.no_grad():
            gather_shards(self.weights, self.shard, self.group, self.shm)

    def zero_grad(self) -> None:
        self.grads.zero_()
        assert self.shard.grad is not None
        self.shard.grad.zero_()


def zero_shards(
    params: list[Tensor],
    split: set[int] | None,
    group: Any,
    tp_index: int,
    name: str,
    timeout_s: float = 300.0,
) -> tuple[list[tuple[str, ZeroShard]], list[Tensor]]:
    """The stage's ZeRO shards over the data-parallel ``group``, named for checkpoints from
    ``name``, and the shards the global gradient norm counts on this rank. Under tensor
    parallelism (``split``: ids of the weights this rank holds a block of; None without) the blocks and the whole
    weights shard apart: the group's ranks all count their blocks, only the first its whole ones."""
    index, size = dist.get_rank(group), dist.get_world_size(group)
    if split is None:
        parts = [("", params, True)]
    else:
        parts = [
            (f"/tp{tp_index}/{kind}", [p for p in params if (id(p) in split) == mine], mine or tp_index == 0)
            for kind, mine in (("split", True), ("whole", False))
        ]
    shards, counted = [], []
    for suffix, part, counts in parts:
        dtypes = by_dtype(part)  # one flat buffer a dtype: bf16 weights beside fp32 norms take two
        for dtype, same in dtypes.items():
            shard = ZeroShard(same, group, index, size, timeout_s)
            kind = f"/{str(dtype).removeprefix('torch.')}" if len(dtypes) > 1 else ""
            shards.append((f"{name}{suffix}{kind}", shard))
            if counts:
                counted.append(shard.shard)
    return shards, counted
