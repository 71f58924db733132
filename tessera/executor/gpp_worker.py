"""Every GPP rank's entry point: join the process group, build the rank's
:class:`~tessera.executor.stage_worker.StageWorker`, train (checkpointing and resuming as asked),
and report. See docs/executor.md ("GPP stage workers")."""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tessera.executor.checkpoint import leave_stopped, resume, save_state, stop_agreed, stop_on_sigterm
from tessera.executor.launcher import WATCHDOG_FACTOR, Watchdog, memory_status, worker_setup
from tessera.executor.stage_worker import StageWorker, WorkerSpec
from tessera.executor.tensor_parallel import whole_weights
from tessera.executor.training import optimizer_state_bytes

__all__ = ["gpp_worker"]


def _total_losses(steps: list[dict[str, Any]], world_size: int, device: torch.device) -> None:
    """Every step's loss summed over the ranks (each computed its micro-batches' part), in place."""
    if world_size == 1:
        return
    total = torch.tensor([s["loss"] for s in steps], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    for s, value in zip(steps, total.tolist(), strict=True):
        s["loss"] = value


def gpp_worker(spec: WorkerSpec) -> dict[str, Any]:
    """The entry point of every rank (started by :func:`tessera.executor.launcher.launch_workers`):
    join the process group, build the stage replica, train ``spec.options.steps`` steps, and return
    the per-step reports (rank 0 returns every rank's, gathered)."""
    rank, device = worker_setup(spec.routing.world_size, spec.backend)
    stage, replica, index = spec.routing.place(rank)
    # Collectives and receives give up after timeout_s with a descriptive error; the watchdog is the
    # backstop for a rank stuck elsewhere (a hung kernel), a little later so it does not pre-empt them.
    watchdog = Watchdog(WATCHDOG_FACTOR * spec.timeout_s, rank)
    try:
        watchdog.arm("start-up")
        dist.init_process_group(spec.backend, timeout=timedelta(seconds=spec.timeout_s))
        worker = StageWorker(spec, rank, device)
        ckpt, total = spec.checkpoint, spec.options.steps
        # A split weight's block is kept under its own name: the tensor-parallel ranks hold different ones.
        blocks = worker.tp_split.weights
        named = [(f"{n}/tp{index}" if n in blocks else n, p) for n, p in worker.module.onnx_parameters()]
        start = resume(ckpt, named, worker.opt, worker.schedule, worker.sharded) if ckpt is not None else 0
        stop = stop_on_sigterm() if ckpt is not None else None
        steps = []
        for k in range(start, total):
            watchdog.arm(f"step {k}")
            steps.append(worker.step(k, more=k + 1 < total))
            stopping = stop is not None and stop_agreed(stop, spec.routing.world_size)
            if ckpt is not None and (ckpt.due(k + 1, total) or stopping):
                watchdog.arm(f"checkpoint after step {k}")
                save_state(ckpt.folder, k + 1, named, worker.opt, ckpt.identity, worker.sharded)
            if stopping:  # every rank's part of the checkpoint is written
                dist.barrier()
                leave_stopped()
        watchdog.arm("summing the losses")
        if index > 0:  # a tensor-parallel group's ranks compute one loss: its first reports it
            for s in steps:
                s["loss"] = 0.0
        _total_losses(steps, spec.routing.world_size, device)
        watchdog.disarm()
        result: dict[str, Any] = {
            "rank": rank,
            "stage": stage,
            "replica": replica,
            "tensor_parallel_index": index,
            "device": spec.routing.devices[rank],
            "threads": torch.get_num_threads(),
            "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "steps": steps,
            "peak_rss_bytes": memory_status("VmHWM"),
            "weight_bytes": worker.weight_bytes,
            "gradient_bytes": worker.weight_bytes,
            "optimizer_state_bytes": optimizer_state_bytes(worker.opt),  # of its shard on a ZeRO stage
            "peak_activation_bytes": worker.peak_activation_bytes,
            "base_rss_bytes": worker.rss_base,
        }
        if worker.timeline is not None:
            result["timeline"] = worker.timeline.spans
        if device.type == "cuda":
            result["peak_device_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        if spec.return_weights and replica == 0:
            weights = whole_weights(list(worker.module.onnx_parameters()), worker.tp_split, worker.tp_group)
            if index == 0:
                result["weights"] = weights
        gathered: list[Any] | None = [None] * spec.routing.world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if gathered is not None:
            result["all"] = gathered
        return result
    finally:
        watchdog.disarm()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
