"""The shared-memory all-gather of co-located decode ranks: the same tensors as gloo's all_gather,
gather after gather (its two buffers reused in turn), nothing left in /dev/shm."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tessera.executor.shm_gather import SHM_DIR, ShmGather

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        before = set(os.listdir(SHM_DIR))
        shm = ShmGather(rank, world, capacity=4096, timeout_s=30)
        dist.barrier()
        left = {n for n in set(os.listdir(SHM_DIR)) - before if n.startswith("tessera-gather")}
        same = True
        for step in range(50):  # different shapes and dtypes, each rank its own values
            t = (
                torch.arange(step % 7 + 1, dtype=torch.float32 if step % 2 else torch.int64) * (rank + 1)
                + step
            )
            if step % 5 == 0:
                t = t.reshape(1, -1, 1)
            want = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(want, t)
            got = shm.stacked(t)
            same &= got.shape == (world, *t.shape)
            same &= all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want, strict=True))
        results[rank] = (same, sorted(left), shm.fits(torch.zeros(1025)), shm.fits(torch.zeros(1024)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_gathers_equal_gloos_and_leave_no_file(world: int) -> None:
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(world, _free_port(), results), nprocs=world)
    for rank in range(world):
        same, left, too_big, fits = results[rank]
        assert same, rank
        assert left == [], left  # unlinked once every rank had it mapped
        assert not too_big and fits  # 4096 bytes: 1024 floats fit, 1025 go through gloo


def _zero_rank(rank: int, world: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from tessera.executor.zero import gather_shards, host_exchange, scatter_sum

        pair = dist.new_group([0, 2]) if world == 3 else None  # a data-parallel group of a larger job
        if world == 3 and rank == 1:
            results[rank] = None
            return
        shm = host_exchange(4 * 12, pair, 30.0)
        size = dist.get_world_size(pair)
        g = torch.Generator().manual_seed(rank)
        same = True
        for _ in range(3):
            full = torch.randn(12, generator=g)
            want, got = torch.empty(12 // size), torch.empty(12 // size)
            scatter_sum(want, full.clone(), pair)
            scatter_sum(got, full.clone(), pair, shm)
            same &= torch.allclose(got, want, rtol=1e-6, atol=1e-7)
            shard = torch.randn(12 // size, generator=g)
            want_full, got_full = torch.empty(12), torch.zeros(12)
            gather_shards(want_full, shard, pair)
            gather_shards(got_full, shard, pair, shm)
            same &= torch.equal(got_full, want_full)
        results[rank] = (shm is not None, same)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_a_zero_pair_through_shared_memory_is_torch_distributeds(world: int) -> None:
    """ZeRO-1's reduce-scatter and all-gather through shared memory (ranks of one host) give what
    torch.distributed's give, over the whole job or a data-parallel group of it (ranks 0 and 2)."""
    results = mp.Manager().dict()
    mp.spawn(_zero_rank, args=(world, _free_port(), results), nprocs=world)
    for rank in (0, 1) if world == 2 else (0, 2):
        used, same = results[rank]
        assert used and same, rank
