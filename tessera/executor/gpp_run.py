"""Run a GPP (or SPP) training plan: check it, start a stage worker per device, report.

:func:`run_gpp_plan` refuses what the workers could not run before any starts (unsupported
operators, bad data, an unroutable plan), launches :func:`~tessera.executor.gpp_worker.gpp_worker`
on every rank of the plan and returns a :class:`GppRun`: loss, iteration time, per-stage busy time
and peak memory, measured against the plan's prediction.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.backends.precision import native_bf16
from tessera.backends.torch_module import check_supported
from tessera.core.errors import InputError, Terminated
from tessera.core.graph import Graph
from tessera.core.plans import GppPlan, Stage
from tessera.executor.checkpoint import CheckpointSpec, latest, run_identity
from tessera.executor.gpp_worker import gpp_worker
from tessera.executor.launcher import LaunchOptions, choose_backend, launch_workers, plan_threads
from tessera.executor.report import RunReport, counted_steps, gathered, over, ratios, slowest, steady_mean
from tessera.executor.routing import Routing, build_routing, tensor_layouts
from tessera.executor.stage_worker import WorkerSpec
from tessera.executor.timeline import run_trace
from tessera.executor.training import TrainingData, TrainOptions

LOSSES = {
    "mse": "sum over float outputs of mean((output - target)^2); target 0 unless the data gives one",
    "ce": "cross-entropy of the logits against the labels, mean over the mini-batch's labels (-100: ignored)",
    "graph": "the model's own scalar loss output, the mean over the samples it is given",
}

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class GppRun(RunReport):
    """What ``tessera launch`` reports for a GPP/SPP plan (``to_json`` is the ``--json`` output)."""

    backend: str
    world_size: int
    mini_batch_size: int
    options: TrainOptions
    stages: list[dict[str, Any]]
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    # Every rank's own per-step numbers, as the workers returned them (not in the JSON report):
    # what `tessera calibrate` takes medians of.
    rank_steps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    # Per stage, the stages whose ranks join an all-reduce with its ranks (tied weights).
    allreduce_peers: dict[int, list[int]] = field(default_factory=dict)
    saved_model: list[str] = field(default_factory=list)  # --save-model: the files written
    trace: dict[str, Any] | None = None  # --trace: the run's trace-event document (timeline.run_trace)

    @property
    def losses(self) -> list[float]:
        return [s["loss"] for s in self.steps]

    def details(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "world_size": self.world_size,
            "mini_batch_size": self.mini_batch_size,
            "training": {
                "steps": self.options.steps,
                "optimizer": self.options.describe(),
                "loss": LOSSES[self.options.loss],
                "precision": precision_note(self.options.precision, self.backend),
                "data": self.options.data or f"synthetic (seed {self.options.seed})",
                **({"saved_model": self.saved_model} if self.saved_model else {}),
            },
            "stages": self.stages,
            "fidelity": fidelity(
                self.measured, self.predicted, self.stages, self.ranks, self.allreduce_peers
            ),
        }


def _check_precision(precision: str, backend: str) -> None:
    """Refuse bf16 on GPUs without it (as torch's autocast would be refused there)."""
    if precision == "bf16" and backend == "nccl" and not native_bf16(torch.device("cuda")):
        raise InputError(
            f"--precision bf16: {torch.cuda.get_device_name()} has no bf16 (torch.cuda.is_bf16_supported)"
        )


def precision_note(precision: str, backend: str) -> str:
    """How the run's products computed: ``fp32``, ``bf16``, or ``bf16 (emulated: ...)`` on a CPU
    without native bf16, where they run many times slower than fp32."""
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    if precision == "bf16" and not native_bf16(device):
        return "bf16 (emulated: this CPU has neither AVX512-BF16 nor AMX; slower than fp32)"
    return precision


def run_gpp_plan(
    plan: GppPlan,
    graph: Graph,
    model_path: str,
    options: TrainOptions,
    launch: LaunchOptions | None = None,
    *,
    plan_path: str = "<plan>",
    return_weights: bool = False,
    trace: bool = False,
) -> GppRun:
    """Launch ``plan`` (checked against ``graph`` by the caller) on torch.distributed workers and
    report measured against predicted. Raises LaunchError (exit 4) when a worker fails."""
    launch = launch or LaunchOptions()
    if options.steps < 1:
        raise InputError(f"--steps {options.steps}: must be at least 1")
    check_supported(graph.model, model_path)  # refuse what the workers could not build, before they start
    # refuse bad data, or a loss with nothing to score, before starting workers
    TrainingData(graph, plan.mini_batch_size, options.seed, options.data, options.loss)
    routing = build_routing(plan, graph, tensor_layouts(graph, model_path))
    devices = [d for st in plan.stages for d in st.devices]
    backend = choose_backend(plan.cluster, devices)
    _check_precision(options.precision, backend)
    if launch.threads_per_rank is None:  # as the plan's measurements assumed
        launch = dataclasses.replace(launch, threads_per_rank=plan_threads(plan.cluster, devices))
    spec = WorkerSpec(
        checkpoint=checkpoint_spec(plan, graph, options),
        plan=plan.model_dump(mode="json"),
        model_path=str(Path(model_path).resolve()),
        input_shapes={k: list(v) for k, v in graph.input_shapes.items()},
        routing=routing,
        options=options,
        timeout_s=launch.timeout_s,
        backend=backend,
        return_weights=return_weights,
        trace=trace,
    )

    def describe(rank: int) -> str:
        stage, replica, index = routing.place(rank)
        tp = f", tensor-parallel rank {index}" if routing.tensor_parallel > 1 else ""
        return f"rank {rank} (stage {stage}, replica {replica}{tp}, device {routing.devices[rank]})"

    # With checkpoints, SIGTERM ends the run after the step in progress and its checkpoint: the
    # workers get the fault timeout to write it before the agent kills them.
    grace = launch.timeout_s if spec.checkpoint is not None else 0.0
    try:
        results = launch_workers(
            gpp_worker, (spec,), routing.world_size, launch, describe_rank=describe, grace_s=grace
        )
    except Terminated:
        if spec.checkpoint is not None and (
            found := latest(spec.checkpoint.folder, spec.checkpoint.identity)
        ):
            log.warning("stopped after step %d: checkpoint %s written; --resume continues from it", *found)
        raise
    report = gpp_report(plan, plan_path, backend, routing, options, ranks := gathered(results))
    if trace:
        floating = {t.name: t.floating for _, _, data in graph.dag.edges(data=True) for t in data["tensors"]}
        report.trace = run_trace(plan, ranks, floating)
    return report


def gpp_report(
    plan: GppPlan,
    plan_path: str,
    backend: str,
    routing: Routing,
    options: TrainOptions,
    per_rank: list[dict[str, Any]],
) -> GppRun:
    """The report of a run from its ranks' results (a stage's value: its slowest replica)."""
    # On a node other than 0 of a multi-node launch only this node's ranks are known.
    present = [st for st in plan.stages if any(r["stage"] == st.id for r in per_rank)]
    ran = len(per_rank[0]["steps"])  # options.steps, less those a resumed checkpoint had done
    steps = [_step_row(per_rank, present, k) for k in range(ran)]
    times = [s["iteration_s"] for s in steps]
    iteration = steady_mean(times)
    measured = {
        "iteration_time_s": iteration,
        # The typical step: one slowed by the host or a stalled all-reduce moves the mean only.
        "iteration_median_s": float(np.median(counted_steps(times))),
        "throughput_samples_per_s": plan.mini_batch_size / iteration if iteration > 0 else 0.0,
        "final_loss": steps[-1]["loss"],
    }
    predicted = {
        k: float(plan.predicted[k])
        for k in ("iteration_time_s", "throughput_samples_per_s")
        if k in plan.predicted
    }
    weights: dict[str, np.ndarray] = {}
    for r in per_rank:
        weights.update(r.get("weights", {}))
    return GppRun(
        plan_path=plan_path,
        kind=plan.kind,
        backend=backend,
        world_size=routing.world_size,
        mini_batch_size=plan.mini_batch_size,
        options=options,
        steps=steps,
        stages=[_stage_row(st, per_rank, ran) for st in present],
        ranks=[_rank_row(r) for r in sorted(per_rank, key=lambda r: r["rank"])],
        rank_steps={r["rank"]: r["steps"] for r in per_rank},
        allreduce_peers={
            st.id: sorted({i for w in plan.shared_weights if st.id in w.stages for i in w.stages} - {st.id})
            for st in plan.stages
        },
        measured=measured,
        predicted=predicted,
        ratio=ratios(measured, predicted, {"iteration_time": "iteration_time_s"}),
        weights=weights,
    )


def checkpoint_spec(plan: GppPlan, graph: Graph, options: TrainOptions) -> CheckpointSpec | None:
    """The run's checkpoints (``options.checkpoint``), and the one it resumes from (``--resume``: the
    newest complete one of the same plan, model and options; none yet: from step 0). InputError,
    before any worker starts, for a checkpoint of another run or one past ``--steps``."""
    if options.checkpoint is None:
        return None
    plan_json = json.dumps(plan.model_dump(mode="json"), sort_keys=True).encode()
    identity = run_identity(hashlib.sha256(plan_json).hexdigest(), graph.sha256, dataclasses.asdict(options))
    found = latest(options.checkpoint, identity) if options.resume else None
    if found is not None and found[0] >= options.steps:
        raise InputError(
            f"the newest checkpoint is after step {found[0]}; --steps {options.steps} leaves nothing to train "
            "(--steps counts from the start of the run)",
            source=str(found[1]),
        )
    resume, start = (str(found[1]), found[0]) if found else (None, 0)
    return CheckpointSpec(options.checkpoint, options.checkpoint_every, identity, resume, start)


def fidelity(
    measured: dict[str, Any],
    predicted: dict[str, Any],
    stages: list[dict[str, Any]],
    ranks: list[dict[str, Any]],
    peers: dict[int, list[int]] | None = None,
) -> dict[str, Any]:
    """Measured against predicted, part by part: the iteration, and per stage its busy (forward +
    backward compute), all-reduce (of the rank that reached it last, among the stage's replicas and
    the ranks of ``peers[stage]``, the stages it shares tied weights with: the others wait for
    that rank, and the plan counts waiting as idle) and idle time (the rest of the iteration:
    transfers, pipeline bubbles, waiting on peers, the optimizer step, drawing the data);
    ``error`` = measured / predicted − 1 (None where the plan predicts nothing); the iteration's
    ``measured_s`` is the mean step, ``median_s`` the typical one (``median_error``). Docs:
    docs/executor.md ("Fidelity")."""
    iteration = measured["iteration_time_s"]
    p_iteration = predicted.get("iteration_time_s")
    median = _part(measured["iteration_median_s"], p_iteration)
    rows = []
    for st in stages:
        joined = {st["id"], *(peers or {}).get(st["id"], [])}
        allreduce = min(
            r["allreduce_s"] for r in ranks if r["stage"] in joined
        )  # the last to arrive waits least
        p_allreduce = st.get("predicted_allreduce_s")
        parts = {"busy": (st["busy_s"], st["predicted_busy_s"]), "allreduce": (allreduce, p_allreduce)}
        p_idle = None
        if p_iteration and st["predicted_busy_s"] is not None:
            p_idle = max(p_iteration - st["predicted_busy_s"] - (p_allreduce or 0.0), 0.0)
        parts["idle"] = (max(iteration - st["busy_s"] - allreduce, 0.0), p_idle)
        rows.append({"id": st["id"], **{k: _part(m, p) for k, (m, p) in parts.items()}})
    typical = {"median_s": median["measured_s"], "median_error": median["error"]}
    return {"iteration": _part(iteration, p_iteration) | typical, "stages": rows}


def _part(measured: float, predicted: float | None) -> dict[str, float | None]:
    ratio = over(measured, predicted)
    return {"measured_s": measured, "predicted_s": predicted, "error": None if ratio is None else ratio - 1}


def _replicas(per_rank: list[dict[str, Any]], stage: int) -> list[dict[str, Any]]:
    return [r for r in per_rank if r["stage"] == stage]


def _step_row(per_rank: list[dict[str, Any]], stages: list[Stage], step: int) -> dict[str, Any]:
    """The run's ``step``-th step (its number: after a resume, counted from the checkpoint's)."""
    return {
        "step": per_rank[0]["steps"][step]["step"],
        "loss": per_rank[0]["steps"][step]["loss"],
        "iteration_s": slowest(per_rank, step, "iteration_s"),
        "busy_s": {str(st.id): slowest(_replicas(per_rank, st.id), step, "busy_s") for st in stages},
    }


def _stage_row(st: Stage, per_rank: list[dict[str, Any]], n_steps: int) -> dict[str, Any]:
    mine = _replicas(per_rank, st.id)
    busy = steady_mean([slowest(mine, k, "busy_s") for k in range(n_steps)])
    if mine and "peak_device_memory_bytes" in mine[0]:
        tensors = max(r["peak_device_memory_bytes"] for r in mine)
    else:
        tensors = max(
            r["weight_bytes"]
            + r["gradient_bytes"]
            + r.get("optimizer_state_bytes", 0)
            + r["peak_activation_bytes"]
            for r in mine
        )
    p_busy = st.predicted.get("busy_s")
    p_mem = float(st.predicted.get("peak_memory_bytes", st.memory.peak))
    return {
        "id": st.id,
        "devices": st.devices,
        "ranks": sorted(r["rank"] for r in mine),
        "micro_batch_size": st.micro_batch_size,
        "recompute": st.recompute,
        "zero": st.zero,
        "tensor_parallel": st.tensor_parallel,
        "busy_s": busy,
        "predicted_busy_s": p_busy,
        "busy_ratio": over(busy, p_busy),
        "predicted_allreduce_s": st.predicted.get("allreduce_time_s"),
        "peak_memory_bytes": tensors,
        "predicted_peak_memory_bytes": p_mem,
        "memory_ratio": over(tensors, p_mem),
        "peak_activation_bytes": max(r["peak_activation_bytes"] for r in mine),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in mine),
        "rss_growth_bytes": max(r["peak_rss_bytes"] - r["base_rss_bytes"] for r in mine),
    }


def _rank_row(r: dict[str, Any]) -> dict[str, Any]:
    """One rank: where it runs, its steady compute / wait / all-reduce time and its memory."""
    return {
        "rank": r["rank"],
        "stage": r["stage"],
        "replica": r["replica"],
        "device": r["device"],
        "threads": r["threads"],
        "cores": r["cores"],  # the cores the rank was pinned to (all it may use when not pinned)
        **{
            key: steady_mean([s[key] for s in r["steps"]])
            for key in ("busy_s", "wait_s", "allreduce_s", "overhead_s")
        },
        "messages": r["steps"][0]["messages"],  # sent and received per step
        "actions": r["steps"][0]["actions"],  # forwards and backwards per step
        "peak_rss_bytes": r["peak_rss_bytes"],
        "peak_activation_bytes": r["peak_activation_bytes"],
    }
