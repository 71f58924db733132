"""The decode workers' entry point: one rank's share of a cache-parallel (or TP / DP) greedy decode.

:func:`cp_worker` is every rank's entry point: it builds the rank's :class:`DecodeWorker` (the
model's own graph, :mod:`graph_decode_worker`), prefills, then runs ``new_tokens - 1`` decode steps
and reports. See docs/executor.md ("CP decode workers").
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tessera.executor.graph_decode_worker import DecodeWorker
from tessera.executor.launcher import (
    WATCHDOG_FACTOR,
    Watchdog,
    inject_test_fault,
    memory_status,
    worker_setup,
)


@dataclass(frozen=True)
class DecodeOptions:
    """One decode run: ``new_tokens`` generated per request; ``prompt_lens`` per request (None:
    every request has the plan's context; fewer than the batch are repeated cyclically); the
    ``seed`` of the prompts' token ids (and of the weights of an ``--llm`` plan); the shard
    attention implementation (``torch`` reference or ``triton``); how each step runs (``step``:
    docs/executor.md, "Compiled decode steps")."""

    new_tokens: int = 8
    prompt_lens: tuple[int, ...] | None = None
    prompts: tuple[tuple[int, ...], ...] | None = None  # the requests' token ids (--prompts), in order
    seed: int = 0
    attention: str = "torch"
    step: str = "fx"  # the decode step: a traced fx program, "inductor" (torch.compile of it), "interpret"


@dataclass(frozen=True)
class CpWorkerSpec:
    """What every rank gets (picklable)."""

    strategy: str
    world_size: int
    devices: list[str]
    llm: dict[str, Any]
    model_path: str | None
    prompts: list[list[int]]
    options: DecodeOptions
    kv_shards: list[tuple[int, int]]
    kv_block: int
    timeout_s: float
    backend: str


def cp_worker(spec: CpWorkerSpec) -> dict[str, Any]:
    """The entry point of every rank (started by :func:`tessera.executor.launcher.launch_workers`):
    join the process group, prefill, run ``new_tokens - 1`` decode steps; rank 0 returns every
    rank's report (gathered)."""
    rank, device = worker_setup(spec.world_size, spec.backend)
    watchdog = Watchdog(WATCHDOG_FACTOR * spec.timeout_s, rank)
    try:
        watchdog.arm("start-up")
        dist.init_process_group(spec.backend, timeout=timedelta(seconds=spec.timeout_s))
        worker = DecodeWorker(spec, rank, device)
        worker.connect()
        watchdog.arm("compiling the decode steps")
        t0 = time.perf_counter()
        worker.compile(spec.options.step)
        compile_s = time.perf_counter() - t0
        watchdog.arm("prefill")
        dist.barrier()
        t0 = time.perf_counter()
        worker.prefill()
        _sync(device)
        prefill_s = time.perf_counter() - t0
        watchdog.arm("capturing the decode steps")
        t0 = time.perf_counter()
        worker.prepare_steps()
        _sync(device)
        compile_s += time.perf_counter() - t0
        dist.barrier()  # decode steps start together
        steps = []
        for k in range(spec.options.new_tokens - 1):
            inject_test_fault(rank, k)
            watchdog.arm(f"decode step {k}")
            comm0 = worker.comm_s
            t0 = time.perf_counter()
            worker.step(k)
            _sync(device)
            steps.append({"step": k, "step_s": time.perf_counter() - t0, "comm_s": worker.comm_s - comm0})
        watchdog.disarm()
        result: dict[str, Any] = {
            "rank": rank,
            "device": spec.devices[rank],
            "requests": worker.request_range(),
            "prefill_s": prefill_s,
            "compile_s": compile_s,
            "programs": worker.compiled,
            "steps": steps,
            "tokens": worker.reported_tokens(),
            "kv_positions": worker.kv_positions,
            "kv_positions_by_request": {str(b): n for b, n in worker.kv_positions_by_request().items()},
            "kv_cache_bytes": worker.kv_cache_bytes,
            "weight_bytes": worker.weight_bytes,
            "peak_rss_bytes": memory_status("VmHWM"),
        }
        gathered: list[Any] | None = [None] * spec.world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if gathered is not None:
            result["all"] = gathered
    except BaseException:
        # Leave the process group up: the error is recorded and the process exits before the peers
        # see their links drop, so the launcher names this rank, not a peer that lost it.
        watchdog.disarm()
        raise
    watchdog.disarm()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
