"""Splitting a paged KV cache's sequence over devices in whole blocks (no torch: planners use it too)."""

from __future__ import annotations


def block_aligned_split(seq_len: int, num_shards: int, *, block: int = 16) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges splitting ``seq_len`` positions over ``num_shards`` in whole blocks.

    Blocks (the paged cache's unit) are dealt out so shard sizes differ by at most one block; earlier
    shards get the extra blocks, and the last block may be partial. Shards may be empty when there
    are fewer blocks than shards.
    """
    if num_shards < 1 or block < 1 or seq_len < 0:
        raise ValueError(
            f"need num_shards >= 1, block >= 1, seq_len >= 0; got {num_shards}, {block}, {seq_len}"
        )
    num_blocks = -(-seq_len // block)
    per, extra = divmod(num_blocks, num_shards)
    ranges, start = [], 0
    for i in range(num_shards):
        stop = min(seq_len, start + (per + (1 if i < extra else 0)) * block)
        ranges.append((start, stop))
        start = stop
    return ranges
