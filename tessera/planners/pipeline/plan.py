"""``plan_gpp``: a graph-pipeline-parallel (or sequential) training plan of a model on a cluster —
partition, schedule, simulate, and the plan document with the sequential baseline beside it.

References: GraphPipe thesis §3.5–3.7; PipeDream and Piper for the sequential baselines.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tessera.core.cost import CostModel
from tessera.core.errors import InfeasibleError, InputError
from tessera.core.graph import Graph, rewritten
from tessera.core.plans import (
    EdgeTensor,
    GppPlan,
    ModelRef,
    SharedWeight,
    Stage,
    StageEdge,
    StageMemory,
    StageSchedule,
    TrainingSetup,
)
from tessera.core.rewrite import applicable
from tessera.core.schedule import SCHEDULE_CHOICES
from tessera.core.specs import ClusterSpec
from tessera.core.traced import traced_values_message
from tessera.core.units import UnitError, format_bytes, parse_bytes
from tessera.planners.pipeline.checks import counted_memory  # registers the C1–C5 + memory plan checks
from tessera.planners.pipeline.memory import ZERO_CHOICES
from tessera.planners.pipeline.profile import MeasuredCosts
from tessera.planners.pipeline.search import build_tree, partition, planned_device_type
from tessera.planners.pipeline.spp import method_name, plan_sequential, sequential_record
from tessera.planners.pipeline.stage_profile import RefineFn
from tessera.planners.pipeline.tensor_parallel import (
    TensorParallelCost,
    group_cluster,
    group_devices,
    tensor_parallel_cost,
)
from tessera.planners.pipeline.types import PartitionOptions, Pipeline
from tessera.planners.sim import SimResult, simulate_pipeline

PlanResult = tuple[GppPlan, Pipeline, SimResult]


def _r(x: float) -> float:
    """Round predictions to 9 significant digits: stable JSON across platforms' float noise."""
    return float(f"{x:.9g}")


def plan_gpp(
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    *,
    kind: str = "gpp",
    baseline: bool = True,
    measured: MeasuredCosts | None = None,
    refine: RefineFn | None = None,
) -> PlanResult:
    """Plan (GPP, or SPP with ``kind="spp"``), simulate it, and (for GPP) the SPP baseline.

    ``measured``: operator times from :func:`~tessera.planners.pipeline.profile.profile_graph` instead of
    the roofline's (the plan's ``predicted.cost_model`` then says where they were measured);
    ``refine``: the chosen pipeline (and the baseline) with its stages' times measured as the
    executor runs them (:class:`~tessera.planners.pipeline.stage_profile.StageProfiler`), which
    the prediction is then simulated with.
    """
    if kind not in ("gpp", "spp"):
        raise InputError(f"--kind {kind!r}: expected gpp or spp")
    if (why := graph.fixed_batch_message() or traced_values_message(graph)) is not None:
        raise InputError(why, source=graph.source)  # launch could not run any such plan
    if options.tensor_parallel == 0:  # auto: the fastest degree
        return _fastest_degree(graph, cluster, options, kind, baseline, measured, refine)
    device = planned_device_type(cluster, options.num_devices)
    try:
        cost = CostModel.for_device(device, options.precision, options.bytes_per_param, measured)
    except ValueError as exc:  # bytes per parameter below what weights and gradients take
        raise InputError(f"--bytes-per-param: {exc}") from None
    t = options.tensor_parallel
    if t == 1:
        plan, pipe, sim = _build(graph, cluster, options, kind, baseline, cost, refine)
    else:  # planned on the tensor-parallel groups, then named by their devices
        # Each stage measured on its t ranks (StageProfiler.refine_all), its collectives included.
        refine = functools.partial(refine, tensor_parallel=t) if refine is not None else None
        cost = tensor_parallel_cost(cost, graph, t, cluster.links.intra_node)
        groups = dataclasses.replace(options, num_devices=options.num_devices and options.num_devices // t)
        plan, pipe, sim = _build(graph, group_cluster(cluster, t), groups, kind, baseline, cost, refine)
        plan = _ungrouped(plan, graph, cluster, cost)
    if measured is not None:
        plan.predicted["cost_model"] = measured.to_json()
    return plan, pipe, sim


def _build(
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    kind: str,
    baseline: bool,
    cost: CostModel,
    refine: RefineFn | None = None,
) -> tuple[GppPlan, Pipeline, SimResult]:
    tree = build_tree(graph, cost, options.max_units)
    spp: Pipeline | None = None
    spp_error: str | None = None
    if kind == "spp" or baseline:
        try:
            # The baseline's message skips the search for the least memory SPP needs.
            spp = plan_sequential(graph, cluster, options, tree=tree, cost=cost, explain=kind == "spp")
        except InfeasibleError as exc:
            if kind == "spp":
                raise
            spp_error = exc.message
    pipe: Pipeline | None = None
    if kind != "spp":
        try:
            pipe = partition(graph, cluster, options, tree=tree, cost=cost)
        except InfeasibleError:
            if spp is None:
                raise
    if refine is not None:  # the graph pipeline and its sequential rival measured together
        spp, pipe = _refined(refine, spp, pipe)
    spp_sim = simulate_pipeline(spp) if spp is not None else None
    if kind == "spp":
        assert spp is not None and spp_sim is not None
        plan = _to_plan(graph, cluster, spp, spp_sim, None, "sequential", _training(options, cost))
        plan.predicted.update(sequential_record(spp))  # which sequential planner, and the other's result
        return plan, spp, spp_sim
    sim = simulate_pipeline(pipe) if pipe is not None else None
    # A sequential pipeline is a graph pipeline too (a chain of convex stages): when the
    # series-parallel DP's plan simulates slower than the sequential one, the GPP plan is the
    # sequential one, relabelled (structure "sequential" in the prediction).
    structure = "graph"
    if (
        spp is not None
        and spp_sim is not None
        and (sim is None or spp_sim.iteration_time < sim.iteration_time)
    ):
        pipe, sim, structure = _relabel(spp), spp_sim, "sequential"
    base: dict[str, Any] | None = None
    if baseline:
        if spp is not None and spp_sim is not None:
            base = {
                "kind": "spp",
                "method": method_name(spp),
                "iteration_time_s": _r(spp_sim.iteration_time),
                "throughput_samples_per_s": _r(spp_sim.throughput),
                "pipeline_depth": spp.pipeline_depth,
                "num_stages": len(spp.stages),
                "micro_batch_size": spp.micro_batch_size,
                "speedup": _r(spp_sim.iteration_time / sim.iteration_time),
            }
        else:
            base = {"kind": "spp", "infeasible": spp_error or "no plan"}
    return _to_plan(graph, cluster, pipe, sim, base, structure, _training(options, cost)), pipe, sim


def _fastest_degree(
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    kind: str,
    baseline: bool,
    measured: MeasuredCosts | None,
    refine: RefineFn | None,
) -> PlanResult:
    """``--tensor-parallel auto``: the plan of every degree that divides each node's devices (and
    ``--devices``) simulated, the fastest kept (a tie: the smaller degree)."""
    counts = [slot.count for group in cluster.nodes for slot in group.devices]
    if options.num_devices:
        counts.append(options.num_devices)
    degrees = [d for d in range(1, min(counts) + 1) if all(c % d == 0 for c in counts)]
    found, best = _fastest(
        (
            t,
            lambda t=t: plan_gpp(
                graph,
                cluster,
                dataclasses.replace(options, tensor_parallel=t),
                kind=kind,
                baseline=baseline,
                measured=measured,
                refine=refine,
            ),  # fmt: skip
        )
        for t in degrees
    )
    return found[best][1]


def _fastest(
    attempts: Iterable[tuple[Any, Callable[[], PlanResult]]],
) -> tuple[list[tuple[Any, PlanResult]], int]:
    """Each attempt's plan, for those that fit (with what the attempt names), and the index of the
    fastest as simulated (a tie: the earlier). The first InfeasibleError when none fits."""
    found: list[tuple[Any, PlanResult]] = []
    infeasible: InfeasibleError | None = None
    for name, attempt in attempts:
        try:
            found.append((name, attempt()))
        except InfeasibleError as err:
            infeasible = infeasible or err
    if not found:
        assert infeasible is not None
        raise infeasible
    return found, max(range(len(found)), key=lambda i: (found[i][1][2].throughput, -i))


def _ungrouped(plan: GppPlan, graph: Graph, cluster: ClusterSpec, cost: TensorParallelCost) -> GppPlan:
    """``plan`` (made on :func:`group_cluster`'s groups) on ``cluster``'s devices, each stage's
    memory counted as validate counts it (a region a stage boundary cuts runs whole)."""
    device, t = planned_device_type(cluster), cost.t
    groups = [st.nodes for st in plan.stages]
    copies, owned = graph.shared_copies(groups), graph.shared_owned(groups)
    stages = []
    for i, st in enumerate(plan.stages):
        st = st.model_copy(update={"devices": group_devices(st.devices, t), "tensor_parallel": t})
        mem = counted_memory(st, graph, device, plan.training, copies[i], owned[i], cost.split)
        memory = StageMemory(
            weights=mem.weights, optimizer=mem.optimizer, activations=mem.activations, peak=mem.peak
        )
        stages.append(st.model_copy(update={"memory": memory}))
    return plan.model_copy(update={"stages": stages, "cluster": cluster.to_json_dict()})


def _training(options: PartitionOptions, cost: CostModel) -> TrainingSetup:
    """What the plan's memory was counted for, so validate can count it again."""
    return TrainingSetup(
        precision=options.precision,
        bytes_per_param=cost.memory.bytes_per_param,
        recompute=options.recompute,
        zero=options.zero,
        optimizer=options.optimizer,  # type: ignore[arg-type]
        loss=options.loss,  # type: ignore[arg-type]
        max_grad_norm=options.max_grad_norm,
    )


def _refined(refine: RefineFn, *pipes: Pipeline | None) -> tuple[Pipeline | None, ...]:
    """``pipes`` (None where there is none) with their stages measured together."""
    measured = iter(refine([p for p in pipes if p is not None]))
    return tuple(None if p is None else next(measured) for p in pipes)


def _relabel(pipe: Pipeline) -> Pipeline:
    return dataclasses.replace(pipe, kind="gpp")


def _to_plan(
    graph: Graph,
    cluster: ClusterSpec,
    pipe: Pipeline,
    sim: SimResult,
    base: dict[str, Any] | None,
    structure: str = "sequential",
    training: TrainingSetup | None = None,
) -> GppPlan:
    stages = []
    for st in pipe.stages:
        mem = st.memory
        assert mem is not None
        stages.append(
            Stage(
                id=st.id,
                nodes=st.nodes,
                devices=st.devices,
                micro_batch_size=st.micro_batch_size,
                schedule=StageSchedule(kind=pipe.schedule_kind, k=pipe.k, actions=st.schedule),
                in_flight=st.in_flight,
                memory=StageMemory(
                    weights=mem.weights, optimizer=mem.optimizer, activations=mem.activations, peak=mem.peak
                ),
                recompute=st.recompute,
                zero=st.zero,  # type: ignore[arg-type]
                predicted={
                    "forward_time_s": _r(st.forward_time),
                    "backward_time_s": _r(st.backward_time),
                    "allreduce_time_s": _r(st.allreduce_time),
                    "time_per_sample_s": _r(st.time_per_sample),
                    "busy_s": _r(sim.busy[st.id]),
                    "peak_memory_bytes": _r(sim.peak_memory[st.id]),
                    **({"step_time_s": _r(st.step_time)} if st.step_time else {}),
                },
            )
        )
    edges = [
        StageEdge(
            src=e.src,
            dst=e.dst,
            tensors=[EdgeTensor(name=n, bytes=int(b * pipe.micro_batch_size)) for n, b in e.tensors],
            bytes=int(e.bytes_per_sample * pipe.micro_batch_size),
        )
        for e in pipe.edges
    ]
    shared = graph.shared_weights([st.nodes for st in pipe.stages])
    return GppPlan(
        kind=pipe.kind,
        model=ModelRef.of(graph),
        cluster=cluster.to_json_dict(),
        mini_batch_size=pipe.mini_batch_size,
        stages=stages,
        edges=edges,
        baseline=base,
        training=training or TrainingSetup(),
        shared_weights=[
            SharedWeight(
                name=w, stages=[pipe.stages[i].id for i in readers], bytes=graph.initializers[w].nbytes
            )
            for w, readers in shared.items()
        ],
        predicted={
            "iteration_time_s": _r(sim.iteration_time),
            "throughput_samples_per_s": _r(sim.throughput),
            "pipeline_depth": pipe.pipeline_depth,
            "bubble_fraction": _r(sim.bubble_fraction),
            "micro_batch_size": pipe.micro_batch_size,
            "num_stages": len(pipe.stages),
            "bottleneck_time_per_sample_s": _r(pipe.bottleneck_tps),
            "memory_limit_bytes": int(pipe.memory_limit),
            "cost_model": "roofline",
            "structure": structure,
        },
    )


def pipeline_options(  # noqa: PLR0913
    cluster: ClusterSpec,
    *,
    mini_batch: int,
    devices: int | None = None,
    schedule: str = "1f1b",
    memory_limit: int | float | str | None = None,
    k: int = 2,
    recompute: str = "never",
    bytes_per_param: float | None = None,
    zero: int | str = 0,
    tensor_parallel: int | str = 1,
    stages: int | None = None,
) -> PartitionOptions:
    """The search's options from what a user gives (``tessera plan``'s values); InputError names the
    value that cannot be planned with. ``memory_limit`` may only lower the devices' memory;
    ``bytes_per_param``: weights + gradients + optimizer state per parameter (default 16: Adam,
    mixed precision on GPUs, fp32 on CPUs); ``stages``: exactly that many pipeline stages."""
    if schedule not in SCHEDULE_CHOICES:
        raise InputError(f"--schedule {schedule!r}: expected one of {', '.join(SCHEDULE_CHOICES)}")
    if recompute not in ("never", "auto", "all"):
        raise InputError(f"--recompute {recompute!r}: expected never, auto or all")
    zero = int(zero) if zero in ("0", "1") else zero
    if zero not in ZERO_CHOICES:
        raise InputError(f"--zero {zero!r}: expected 0, 1 or auto")
    try:
        limit = (
            None
            if memory_limit is None
            else float(parse_bytes(memory_limit, field="--memory-limit", allow_zero=False))
        )
    except UnitError as err:
        raise InputError(str(err)) from None
    if bytes_per_param is not None and not 0 < bytes_per_param <= 1024:  # NaN included
        raise InputError(f"--bytes-per-param {bytes_per_param}: expected a number of bytes in (0, 1024]")
    tensor_parallel = _degree(tensor_parallel, devices)
    device_type = planned_device_type(cluster, devices)
    _check_stages(stages, devices or len(cluster.devices()), tensor_parallel)
    if limit is not None and limit > device_type.memory:
        raise InputError(
            f"--memory-limit {format_bytes(limit)} is more than a {cluster.devices()[0].type_name}'s "
            f"{format_bytes(device_type.memory)}: the limit can only lower the device memory "
            "(a plan over it would not run, and validate would reject it)"
        )
    return PartitionOptions(
        mini_batch=mini_batch,
        num_devices=devices,
        memory_limit=limit,
        schedule=schedule,  # type: ignore[arg-type]
        k=k if schedule == "kfkb" else 1,
        recompute=recompute,  # type: ignore[arg-type]
        zero=zero,  # type: ignore[arg-type]
        tensor_parallel=tensor_parallel,
        stages=stages,
        bytes_per_param=bytes_per_param,
        # CPUs train in fp32 (tessera's executor does, and CPU mixed precision is not a thing):
        # weights, gradients, activations and messages are counted at 4 bytes.
        precision="fp32" if device_type.kind == "cpu" else "mixed",
    )


def _check_stages(stages: int | None, devices: int, tensor_parallel: int) -> None:
    """``--stages``: a stage takes at least one device (``tensor_parallel`` with tensor parallelism)."""
    if stages is None:
        return
    per_stage = max(tensor_parallel, 1)
    if not 1 <= stages <= devices // per_stage:
        most = f"{devices // per_stage} (--devices {devices}" + (
            f" over --tensor-parallel {tensor_parallel})" if per_stage > 1 else ")"
        )
        raise InputError(f"--stages {stages}: expected 1 to {most}: a stage takes at least one device")


def _degree(given: int | str, devices: int | None) -> int:
    """``--tensor-parallel``'s value: a degree, or 0 for ``auto``."""
    if given == "auto":
        return 0
    try:
        t = int(given)
    except (TypeError, ValueError):
        t = 0
    if t < 1 or (devices is not None and devices % t):
        where = f"--devices {devices}" if devices is not None else "the devices"
        raise InputError(
            f"--tensor-parallel {given}: expected auto or a positive number of devices dividing {where}"
        )
    return t


@dataclass(frozen=True)
class RewriteChoice:
    """``--rewrite auto``'s outcome: each candidate model's plan (as given first), and the one kept."""

    candidates: list[Graph]
    results: list[PlanResult]
    kept: int

    @property
    def plan(self) -> PlanResult:
        return self.results[self.kept]


def plan_gpp_best(
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    *,
    kind: str = "gpp",
    baseline: bool = True,
    rewrite_auto: bool = False,
    measure: Callable[[Graph], MeasuredCosts] | None = None,
    refine: Callable[[Graph], RefineFn] | None = None,
) -> RewriteChoice:
    """:func:`plan_gpp` of ``graph`` and, with ``rewrite_auto``, of ``graph`` rewritten by every
    rewrite that changes it (:func:`tessera.core.rewrite.applicable`); the fastest as simulated is
    kept (a tie keeps the model as given). ``measure``: operator times for a candidate model
    (``--profile``), else the roofline's; ``refine``: its stages measured (:func:`plan_gpp`).
    InfeasibleError when no candidate fits."""
    candidates = [graph]
    if rewrite_auto:
        names, _ = applicable(graph.model, label=graph.source)
        if names:
            candidates.append(rewritten(graph, names))

    def attempt(g: Graph) -> PlanResult:
        measured = measure(g) if measure is not None else None
        stages = refine(g) if refine is not None else None
        return plan_gpp(g, cluster, options, kind=kind, baseline=baseline, measured=measured, refine=stages)

    # --rewrite auto: a model that does not fit leaves the other.
    found, best = _fastest((g, lambda g=g: attempt(g)) for g in candidates)
    return RewriteChoice([g for g, _ in found], [r for _, r in found], best)
