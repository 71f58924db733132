"""Block-aligned splits of a KV cache's sequence."""

from tessera.core.kv_blocks import block_aligned_split


def test_block_aligned_split() -> None:
    assert block_aligned_split(100, 4) == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert block_aligned_split(16, 4) == [(0, 16), (16, 16), (16, 16), (16, 16)]
