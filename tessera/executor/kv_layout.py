"""Who holds what in a CP decode: the KV positions of each rank, the requests of each rank.

Under cache parallelism every rank holds a sequence shard of every request's KV cache: the plan's
``kv_shards`` ranges, then positions past the plan's context in whole ``kv_block`` blocks, each to
the least-loaded shard (:class:`KvLayout`). The data-parallel parts (projections, FFN; every part
under ``dp``) split the requests into contiguous slices (:func:`request_slices`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tessera.core.errors import InputError

DEFAULT_KV_BLOCK = 16


class KvLayout:
    """The rank holding each KV position of a request under cache parallelism (see the module
    docstring): the plan's ``kv_shards`` ranges, then whole blocks to the least-loaded shard."""

    def __init__(self, shards: Sequence[tuple[int, int]], block: int = DEFAULT_KV_BLOCK) -> None:
        starts = [a for a, _ in shards]
        if not shards or starts[0] != 0 or any(b < a for a, b in shards):
            raise InputError(f"kv_shards {list(shards)} must be ranges [start, stop) starting at 0")
        if any(shards[i][1] != shards[i + 1][0] for i in range(len(shards) - 1)):
            raise InputError(f"kv_shards {list(shards)} must be consecutive ranges along the sequence")
        if block < 1:
            raise InputError(f"kv_block {block} must be at least 1")
        self.shards = [(int(a), int(b)) for a, b in shards]
        self.block = block
        self.context = self.shards[-1][1]
        self._owner = np.concatenate(
            [np.full(b - a, r, dtype=np.int64) for r, (a, b) in enumerate(self.shards)]
            or [np.zeros(0, np.int64)]
        )
        self._held = np.array([b - a for a, b in self.shards], dtype=np.int64)

    @property
    def world_size(self) -> int:
        return len(self.shards)

    def owners(self, length: int) -> np.ndarray:
        """The owning rank of positions ``0..length-1``."""
        p = len(self._owner)
        if p >= length:
            return self._owner[:length]
        chunks, rank = [self._owner], int(self._owner[-1]) if p else 0
        while p < length:  # one concatenation at the end: linear in length, not quadratic
            if p % self.block:  # finish the partial block its last position is in
                n = self.block - p % self.block
            else:
                rank = int(np.argmin(self._held))  # first minimum: the lower rank on ties
                n = self.block
            chunks.append(np.full(n, rank, dtype=np.int64))
            self._held[rank] += n
            p += n
        self._owner = np.concatenate(chunks)
        return self._owner[:length]

    def most_held(self, rank: int, length: int) -> int:
        """An upper bound on the positions ``rank`` holds of a request of ``length`` positions,
        without dealing the blocks out: past the plan's context a rank takes a block only while it
        holds the fewest, so it ends at most one block above the even share (or its own shard)."""
        start, stop = self.shards[rank]
        if length <= self.context:
            return max(0, min(stop, length) - start)
        return max(stop - start, -(-length // self.world_size)) + self.block


def request_slices(batch: int, world: int) -> list[tuple[int, int]]:
    """Requests ``[lo, hi)`` of each rank for the data-parallel parts (``numpy.array_split`` sizes)."""
    q, r = divmod(batch, world)
    out, lo = [], 0
    for i in range(world):
        hi = lo + q + (1 if i < r else 0)
        out.append((lo, hi))
        lo = hi
    return out
