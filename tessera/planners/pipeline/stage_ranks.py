"""A tensor-parallel stage measured on its ``t`` ranks (``plan --profile --tensor-parallel t``):
``t`` spawned processes pinned to cores of their own (a GPU each on CUDA), each running its copy
of the stage (:func:`tessera.core.tp_program.local_model`) step after step with its collectives
over gloo (NCCL), several stages' bursts in turns; a step's part is the slowest rank's. A rank
that fails or dies is named. Why: docs/executor.md ("Fidelity")."""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.core.data import TrainingData
from tessera.core.errors import TesseraError
from tessera.planners.pipeline.stage_step import StageProfileOptions, StageRun, one_step, stage_run

if TYPE_CHECKING:
    import torch

__all__ = ["SplitJob", "SplitStage", "run_ranks", "split_measurable"]


def split_measurable(device: str, t: int) -> bool:
    """Whether ``t`` ranks of a tensor-parallel stage can run here on ``device``: CPU processes
    always; on GPUs, one GPU a rank."""
    if device != "cuda":
        return True
    import torch

    return torch.cuda.device_count() >= t


@dataclass(frozen=True)
class SplitStage:
    """A tensor-parallel stage to measure: each rank's copy, its inputs and its schedule."""

    models: list[bytes]  # rank i's copy of the stage (core.tp_program.local_model), serialized
    feeds: dict[str, torch.Tensor]  # the stage's inputs by name, whole (as a rank receives them)
    grads: frozenset[str]  # the inputs that take a gradient (received activations)
    actions: tuple[str, ...]
    data: TrainingData


@dataclass(frozen=True)
class SplitJob:
    """What each rank of a tensor-parallel measurement needs (sent to its process)."""

    stages: list[SplitStage]
    scored: frozenset[str]  # outputs scored by cross-entropy (the model's, with launch --loss ce)
    optimizer: str
    max_grad_norm: float | None
    threads: int
    device: str
    options: StageProfileOptions


def run_ranks(job: SplitJob, t: int) -> list[list[tuple[list[float], ...]]]:
    """Each rank's bursts of ``job``'s stage, its ``t`` ranks run as processes (spawned: a rank
    starts clean of the planner's threads) meeting through a file store (no port to race for)."""
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="tessera-stage-") as folder:
        store = str(Path(folder) / "store")
        procs = [ctx.Process(target=_split_rank, args=(r, t, store, job, out), daemon=True) for r in range(t)]
        for proc in procs:
            proc.start()
        try:
            results = _collected(out, procs)
        finally:
            for proc in procs:  # a rank exits once it reported; one still here is blocked
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    if failed:
        rank, why = min(failed.items())
        raise TesseraError(f"measuring a stage on {t} ranks: rank {rank} failed: {why}")
    return [results[r] for r in range(t)]


def _collected(out: object, procs: list, limit_s: float = 600.0) -> dict[int, object]:
    """Each rank's report from ``out``; the first failure ends the wait (its peers may be blocked
    in a collective it will not join), and a rank that ended without a report (killed, crashed)
    is reported by its exit code, its peers not waited for."""
    import queue

    results: dict[int, object] = {}
    deadline = time.monotonic() + limit_s
    ended = False  # a rank's process ended: what it sent is drained once more before naming it
    while len(results) < len(procs):
        try:
            rank, value = out.get(timeout=2.0 if ended else 0.5)  # type: ignore[attr-defined]
            results[rank] = value
            if isinstance(value, str):
                return results
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
            if dead and ended:
                return {r: f"its process ended with exit code {procs[r].exitcode}" for r in dead}
            ended = bool(dead)
            if time.monotonic() > deadline:
                return {r: f"no report within {limit_s:.0f} s" for r in range(len(procs)) if r not in results}
    return results


def _split_rank(rank: int, t: int, store: str, job: SplitJob, out: object) -> None:
    """One rank of a tensor-parallel measurement: its block of each stage run step after step
    as :func:`one_step` runs a whole stage, the stages' bursts in turns; rank 0 decides when a
    burst ends (every rank runs the same steps: their collectives pair up)."""
    import torch
    import torch.distributed as dist

    from tessera.backends.torch_ops.collectives import use_group

    cuda = job.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:  # each rank on cores of its own where they fit, as launch pins its ranks
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if t * job.threads <= len(cores):
            os.sched_setaffinity(0, cores[rank * job.threads : (rank + 1) * job.threads])
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=t
    )
    try:
        torch.set_num_threads(job.threads)
        use_group("tp", dist.group.WORLD)
        device = f"cuda:{rank}" if cuda else "cpu"
        runs = [_split_run(stage, job, rank, device) for stage in job.stages]
        o = job.options
        bursts: list[list[tuple[list[float], ...]]] = [[] for _ in runs]
        for b in range(o.bursts):  # the stages' bursts in turns
            for run, taken in zip(runs, bursts, strict=True):
                taken.append(_burst_together(run, o, o.warmup if b == 0 else 0, rank, device))
        out.put((rank, bursts))  # type: ignore[attr-defined]
    except Exception as exc:  # reported to the planner, which names the rank
        out.put((rank, f"{type(exc).__name__}: {exc}"))  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()
    # The report flushed, the process ends without running C++ destructors: gloo's threads,
    # destroyed joinable at exit, would abort it with "terminate called" on the planner's stderr.
    out.close()  # type: ignore[attr-defined]
    out.join_thread()  # type: ignore[attr-defined]
    os._exit(0)


def _split_run(stage: SplitStage, job: SplitJob, rank: int, device: str) -> StageRun:
    import onnx

    from tessera.backends.torch_module import to_torch

    module = to_torch(onnx.load_from_string(stage.models[rank]), label="stage").to(device)
    feeds = [stage.feeds[n].to(device).requires_grad_(n in stage.grads) for n in module.input_names]
    return stage_run(
        module,
        feeds,
        stage.actions,
        stage.data,
        optimizer=job.optimizer,
        scored_outputs=job.scored,
        max_grad_norm=job.max_grad_norm,
        device=device,
    )


def _burst_together(
    run: StageRun, o: StageProfileOptions, warmup: int, rank: int, device: str
) -> tuple[list[float], ...]:
    """:meth:`StageProfiler._burst` on every rank at once: rank 0's budget ends it for all."""
    import torch
    import torch.distributed as dist

    times: tuple[list[float], list[float], list[float]] = ([], [], [])
    spent = 0.0
    go = torch.ones(1, device=device)
    while True:
        start = time.perf_counter()
        parts = one_step(run, functools.partial(run.data.batch, run.step))
        spent, run.step = spent + time.perf_counter() - start, run.step + 1
        for values, value in zip(times, parts, strict=True):
            values.append(value)
        if rank == 0:
            go.fill_(o.more(len(times[0]), spent, warmup))
        dist.broadcast(go, 0)
        if not go.item():
            return tuple(values[warmup:] for values in times)
