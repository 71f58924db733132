"""``tessera plan --kind gpp|spp``: partition, schedule, simulate, write the plan.

:func:`run_gpp_plan` is what the ``plan`` command calls; :func:`build_gpp_plan` is the pure part
(graph + cluster + options → :class:`GppPlan`), :func:`write_gantt` draws a simulated iteration.
"""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path
from typing import Any

import click

from tessera.core.cost import CostModel
from tessera.core.errors import InfeasibleError, InputError
from tessera.core.files import write_output
from tessera.core.graph import Graph, rewritten
from tessera.core.plans import (
    EdgeTensor,
    GppPlan,
    ModelRef,
    Stage,
    StageEdge,
    StageMemory,
    StageSchedule,
    TrainingSetup,
    dump_plan,
    write_plan,
)
from tessera.core.rewrite import applicable
from tessera.core.schedule import SCHEDULE_CHOICES, chain_order, to_pytorch_csv
from tessera.core.specs import ClusterSpec
from tessera.core.units import UnitError, format_bytes, parse_bytes
from tessera.planners.pipeline.profile import MeasuredCosts
from tessera.planners.pipeline.search import build_tree, partition, planned_device_type
from tessera.planners.pipeline.spp import method_name, plan_sequential, sequential_record
from tessera.planners.pipeline.types import PartitionOptions, Pipeline
from tessera.planners.sim import SimResult, simulate_pipeline


def _r(x: float) -> float:
    """Round predictions to 9 significant digits: stable JSON across platforms' float noise."""
    return float(f"{x:.9g}")


def build_gpp_plan(
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    *,
    kind: str = "gpp",
    baseline: bool = True,
    measured: MeasuredCosts | None = None,
) -> tuple[GppPlan, Pipeline, SimResult]:
    """Plan (GPP, or SPP with ``kind="spp"``), simulate it, and (for GPP) the SPP baseline.

    ``measured``: operator times from :func:`~tessera.planners.pipeline.profile.profile_graph` instead of
    the roofline's (the plan's ``predicted.cost_model`` then says where they were measured).
    """
    if kind not in ("gpp", "spp"):
        raise InputError(f"--kind {kind!r}: expected gpp or spp")
    device = planned_device_type(cluster, options.num_devices)
    try:
        cost = CostModel.for_device(device, options.precision, options.bytes_per_param, measured)
    except ValueError as exc:  # bytes per parameter below what weights and gradients take
        raise InputError(f"--bytes-per-param: {exc}") from None
    plan, pipe, sim = _build(graph, cluster, options, kind, baseline, cost)
    if measured is not None:
        plan.predicted["cost_model"] = measured.to_json()
    return plan, pipe, sim


def _build(
    graph: Graph, cluster: ClusterSpec, options: PartitionOptions, kind: str, baseline: bool, cost: CostModel
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
    spp_sim = simulate_pipeline(spp) if spp is not None else None
    if kind == "spp":
        assert spp is not None and spp_sim is not None
        plan = _to_plan(graph, cluster, spp, spp_sim, None, "sequential", _training(options, cost))
        plan.predicted.update(sequential_record(spp))  # which sequential planner, and the other's result
        return plan, spp, spp_sim
    try:
        pipe = partition(graph, cluster, options, tree=tree, cost=cost)
        sim = simulate_pipeline(pipe)
    except InfeasibleError:
        if spp is None:
            raise
        pipe, sim = None, None  # type: ignore[assignment]
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


def _training(options: PartitionOptions, cost: CostModel) -> TrainingSetup:
    """What the plan's memory was counted for, so validate can count it again."""
    return TrainingSetup(
        precision=options.precision, bytes_per_param=cost.memory.bytes_per_param, recompute=options.recompute
    )


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
                predicted={
                    "forward_time_s": _r(st.forward_time),
                    "backward_time_s": _r(st.backward_time),
                    "allreduce_time_s": _r(st.allreduce_time),
                    "time_per_sample_s": _r(st.time_per_sample),
                    "busy_s": _r(sim.busy[st.id]),
                    "peak_memory_bytes": _r(sim.peak_memory[st.id]),
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
    return GppPlan(
        kind=pipe.kind,
        model=ModelRef.of(graph),
        cluster=cluster.to_json_dict(),
        mini_batch_size=pipe.mini_batch_size,
        stages=stages,
        edges=edges,
        baseline=base,
        training=training or TrainingSetup(),
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


def run_gpp_plan(
    graph: Graph,
    cluster: ClusterSpec,
    *,
    kind: str = "gpp",
    mini_batch: int,
    devices: int | None = None,
    schedule: str = "1f1b",
    memory_limit: int | float | str | None = None,
    output: str | os.PathLike[str] | None = None,
    gantt: str | os.PathLike[str] | None = None,
    pytorch_csv: str | os.PathLike[str] | None = None,
    as_json: bool = False,
    no_baseline: bool = False,
    profile: bool = False,
    cache: str | os.PathLike[str] | None = None,
    k: int = 2,
    recompute: str = "never",
    bytes_per_param: float | None = None,
    rewrite_auto: bool = False,
) -> GppPlan:
    """The ``plan --kind gpp|spp`` command body: plan, write, print. Raises InfeasibleError (exit 3).

    ``profile``: measure operator times on this machine first (:mod:`tessera.planners.pipeline.profile`),
    cached in the profile cache at ``cache`` (default: the one ``tessera place`` uses).
    ``recompute``: activation recomputation in the backward on no stage (``never``), every stage
    (``all``), or the stages that need the memory (``auto``, chosen by the search); ``bytes_per_param``:
    weights + gradients + optimizer state per parameter (default 16: Adam, mixed precision).
    ``rewrite_auto`` (``--rewrite auto``): plan ``graph`` (loaded without rewrites) as given and
    with every rewrite that changes it (:func:`tessera.core.rewrite.applicable`), and keep the
    faster plan (the search, and the baseline, run twice). Otherwise, on a graph loaded without
    rewrites, the text output hints at those that would apply.
    """
    if cache is not None and not profile:
        raise InputError("--cache is the cache of --profile's measurements; give --profile too")
    if schedule not in SCHEDULE_CHOICES:
        raise InputError(f"--schedule {schedule!r}: expected one of {', '.join(SCHEDULE_CHOICES)}")
    if recompute not in ("never", "auto", "all"):
        raise InputError(f"--recompute {recompute!r}: expected never, auto or all")
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
    device_type = planned_device_type(cluster, devices)
    if limit is not None and limit > device_type.memory:
        raise InputError(
            f"--memory-limit {format_bytes(limit)} is more than a {cluster.devices()[0].type_name}'s "
            f"{format_bytes(device_type.memory)}: the limit can only lower the device memory "
            "(a plan over it would not run, and validate would reject it)"
        )
    options = PartitionOptions(
        mini_batch=mini_batch,
        num_devices=devices,
        memory_limit=limit,
        schedule=schedule,  # type: ignore[arg-type]
        k=k if schedule == "kfkb" else 1,
        recompute=recompute,
        bytes_per_param=bytes_per_param,
    )
    candidates = [graph]
    if rewrite_auto:
        names, _ = applicable(graph.model, label=graph.source)
        if names:
            candidates.append(rewritten(graph, names))
    results: list[tuple[GppPlan, Pipeline, SimResult]] = []
    infeasible: InfeasibleError | None = None
    for g in candidates:
        measured = profile_costs(g, cluster, cache, devices) if profile else None
        try:
            results.append(
                build_gpp_plan(g, cluster, options, kind=kind, baseline=not no_baseline, measured=measured)
            )
        except InfeasibleError as err:  # --rewrite auto: the other model may fit
            infeasible = infeasible or err
    if not results:
        assert infeasible is not None
        raise infeasible
    # The fastest as simulated; a tie keeps the model as given (the first).
    plan, pipe, sim = results[max(range(len(results)), key=lambda i: (results[i][2].throughput, -i))]
    if output is not None:
        write_plan(plan, output)
    if gantt is not None:
        write_gantt(sim, pipe, gantt)
    if pytorch_csv is not None:
        write_pytorch_csv(plan, pytorch_csv)
    if as_json:
        click.echo(dump_plan(plan), nl=False)
    else:
        click.echo(summary(plan, pipe))
        if len(candidates) > 1:
            click.echo(_compared(results, [g.rewrites for g in candidates], plan))
        names, replaced = (
            applicable(graph.model, label=graph.source) if not (graph.rewrites or rewrite_auto) else ([], [])
        )
        if names:
            shown = ", ".join(replaced[:4]) + (f" and {len(replaced) - 4} more" if len(replaced) > 4 else "")
            flags = " ".join(f"--rewrite {n}" for n in names)
            click.echo(f"hint: {flags} would replace {shown}; plan with it to compare", err=True)
    return plan


def _compared(
    results: list[tuple[GppPlan, Pipeline, SimResult]], rewrites: list[tuple[str, ...]], kept: GppPlan
) -> str:
    """``--rewrite auto``'s line: each model's simulated throughput and the one kept."""
    parts = []
    for (plan, _, sim), names in zip(results, rewrites, strict=True):
        label = f"rewritten ({', '.join(names)})" if names else "as given"
        parts.append(f"{label} {sim.throughput:,.1f} samples/s" + (" (kept)" if plan is kept else ""))
    return "rewrite auto: " + "; ".join(parts)


def profile_costs(
    graph: Graph,
    cluster: ClusterSpec,
    cache: str | os.PathLike[str] | None = None,
    devices: int | None = None,
) -> MeasuredCosts:
    """``--profile``: measure every operator on this machine (progress bar on a terminal; one summary
    line on stderr); ``devices``: how many of the cluster's devices the plan uses."""
    from tessera.cli.render import progress_bar
    from tessera.planners.pipeline.profile import open_cache, profile_graph

    device_type = planned_device_type(cluster, devices)
    store = open_cache(cache)
    try:
        with progress_bar() as bar:
            task = bar.add_task("profiling operators", total=None)
            measured = profile_graph(
                graph,
                device_type,
                cache=store,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
    finally:
        store.close()
    r = measured.report
    roofline = measured.roofline_types()
    fallback = (
        f", {sum(roofline.values())} on the roofline ({', '.join(f'{t} x{n}' for t, n in roofline.items())})"
        if roofline
        else ""
    )
    click.echo(
        f"tessera: profiled {r.operators} operators ({r.distinct} distinct) on {measured.source['device']}, "
        f"torch {measured.source['torch']}: {r.measurements} (operator, samples) measured, "
        f"{r.cache_hits} cached{fallback}, "
        f"{r.seconds:.1f}s (cache {store.path})",
        err=True,
    )
    return measured


def summary(plan: GppPlan, pipe: Pipeline) -> str:
    """A human summary: one line per stage, then the prediction and the baseline."""
    p = plan.predicted
    lines = [
        f"{plan.kind.upper()} plan: {len(plan.stages)} stage(s), depth {p['pipeline_depth']}, "
        f"mini-batch {plan.mini_batch_size}, micro-batch {p['micro_batch_size']}, "
        f"schedule {pipe.schedule_kind}, {pipe.num_units} units, search {pipe.search_time_s:.2f}s"
        + (f", model rewritten ({', '.join(plan.model.rewrites)})" if plan.model.rewrites else ""),
    ]
    # The recompute column where the planner was allowed to recompute (fw+bw includes it).
    recompute = plan.training.recompute != "never"
    lines.append(
        f"{'stage':>5} {'ops':>5} {'devices':>7} {'in-flight':>9} {'fw+bw/mb':>10} {'memory':>10}"
        + (f" {'recompute':>9}" if recompute else "")
        + "  first op"
    )
    for st in plan.stages:
        t = st.predicted["forward_time_s"] + st.predicted["backward_time_s"]
        lines.append(
            f"{st.id:>5} {len(st.nodes):>5} {len(st.devices):>7} {st.in_flight:>9} "
            f"{t * 1e3:>8.2f}ms {format_bytes(st.memory.peak):>10}"
            + (f" {'yes' if st.recompute else 'no':>9}" if recompute else "")
            + f"  {st.nodes[0]}"
        )
    lines.append(
        f"predicted: iteration {p['iteration_time_s'] * 1e3:.2f} ms, "
        f"{p['throughput_samples_per_s']:.1f} samples/s, bubble {p['bubble_fraction']:.1%}"
    )
    b = plan.baseline
    if b and "throughput_samples_per_s" in b:
        lines.append(
            f"SPP baseline: {b['throughput_samples_per_s']:.1f} samples/s, depth {b['pipeline_depth']} "
            f"(GPP speed-up {b['speedup']:.2f}x)"
        )
    elif b:
        lines.append(f"SPP baseline: infeasible ({b['infeasible']})")
    cost = p.get("cost_model")
    if isinstance(cost, dict) and cost.get("kind") == "measured":
        lines.append(
            f"costs: measured on {cost['device']} (torch {cost['torch']}, {cost['dtype']}), "
            f"{cost['roofline_operators']} of {cost['operators']} operators on the roofline"
        )
    return "\n".join(lines)


_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "send_F": "#55A868", "send_B": "#55A868", "allreduce": "#8C8C8C"}


def write_pytorch_csv(plan: GppPlan, path: str | os.PathLike[str]) -> Path:
    """``--pytorch-csv``: a chain plan's schedule in ``torch.distributed.pipelining``'s compute-only
    CSV (what ``_PipelineScheduleRuntime._load_csv`` reads): row ``r`` is rank ``r``, which runs
    stage ``r``; each cell an action such as ``2F3``. A graph of stages has no such form: an
    :class:`InputError` (the plan itself is written first)."""
    why = chain_order([st.id for st in plan.stages], [(e.src, e.dst) for e in plan.edges])
    if why is not None:
        raise InputError(
            f"--pytorch-csv: {why}; torch.distributed.pipelining runs a chain of stages "
            "(--kind spp plans one)",
            source=path,
        )
    return write_output(path, to_pytorch_csv({st.id: st.schedule.actions for st in plan.stages}))


def write_gantt(sim: SimResult, pipe: Pipeline, path: str | os.PathLike[str]) -> Path:
    """Draw the simulated iteration (stages × time; forward, backward, communication) as SVG/PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(pipe.stages)
    # A fixed hash salt: matplotlib's SVG ids are otherwise random, and the same plan must draw
    # the same bytes.
    with matplotlib.rc_context({"svg.hashsalt": "tessera", "svg.fonttype": "none"}):
        fig, ax = plt.subplots(figsize=(12, 0.5 * n + 1.5))
        data = _draw_gantt(fig, ax, sim, pipe, Path(path).suffix.lstrip(".").lower() or "svg")
    return write_output(path, data)


def _draw_gantt(fig: Any, ax: Any, sim: SimResult, pipe: Pipeline, fmt: str) -> bytes:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(pipe.stages)
    try:
        for e in sim.events:
            comm = e.kind.startswith("send")
            y = e.stage + (0.3 if comm else 0.0)
            h = 0.25 if comm else 0.6
            ax.broken_barh([(e.start * 1e3, (e.end - e.start) * 1e3)], (y - 0.3, h), color=_COLOURS[e.kind])
        ax.set_yticks(range(n))
        ax.set_yticklabels([f"stage {s.id} ({len(s.devices)} dev)" for s in pipe.stages])
        ax.invert_yaxis()
        ax.set_xlabel("time (ms)")
        ax.set_title(f"{pipe.kind.upper()}: one iteration, {sim.iteration_time * 1e3:.2f} ms", loc="left")
        ax.legend(
            handles=[
                Patch(color=_COLOURS["F"], label="forward"),
                Patch(color=_COLOURS["B"], label="backward"),
                Patch(color=_COLOURS["send_F"], label="communication"),
                Patch(color=_COLOURS["allreduce"], label="all-reduce"),
            ],
            # Above the axes, right of the title: inside them it covered the first stage's bars.
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            ncol=4,
            fontsize="small",
            frameon=False,
        )
        buf = io.BytesIO()
        metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None}}.get(fmt)
        fig.savefig(buf, format=fmt, metadata=metadata, bbox_inches="tight")
    finally:
        plt.close(fig)
    return buf.getvalue()
