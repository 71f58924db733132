"""``tessera plan --kind gpp|spp``: a graph-pipeline-parallel or sequential training plan; the
planning is :func:`tessera.planners.pipeline.plan.plan_gpp_best`, this module parses, writes, prints."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tessera.cli.options import (
    FigureFile,
    FiniteFloat,
    OptionGroup,
    OutputFile,
    check_outputs,
    load_model_option,
)
from tessera.cli.plan.gantt import write_gantt
from tessera.cli.render import progress_bar
from tessera.core.errors import InputError
from tessera.core.files import write_output
from tessera.core.graph import Graph
from tessera.core.plan_files import json_text
from tessera.core.plans import GppPlan, dump_plan, write_plan
from tessera.core.rewrite import REWRITES, applicable
from tessera.core.schedule import SCHEDULE_CHOICES, chain_order, to_pytorch_csv
from tessera.core.specs import ClusterSpec, load_cluster
from tessera.core.units import format_bytes

if TYPE_CHECKING:  # the planner imports torch: loaded when a plan is made, not for every command
    from tessera.planners.pipeline.plan import RewriteChoice
    from tessera.planners.pipeline.types import Pipeline


class RecomputeChoice(click.Choice):
    """``--recompute``'s value, which is optional (``--recompute`` alone is ``all``): click then
    takes the next word as the value, so ``--recompute MODEL`` names the model as the mode."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if (
            isinstance(value, str)
            and value not in self.choices
            and (value.endswith(".onnx") or os.path.exists(value))
        ):
            self.fail(
                f"{value!r} is not one of {', '.join(map(repr, self.choices))}; it looks like the model: "
                "write --recompute after MODEL, or give its value (--recompute all)",
                param,
                ctx,
            )
        return super().convert(value, param, ctx)


OPTIONS = OptionGroup(
    click.option(
        "--mini-batch", type=click.IntRange(min=1), help="[gpp/spp] Samples per training iteration."
    ),
    click.option(
        "--devices", type=click.IntRange(min=1), help="[gpp/spp] Use this many devices (default: all)."
    ),
    click.option(
        "--schedule",
        type=click.Choice(SCHEDULE_CHOICES),
        default="1f1b",
        show_default=True,
        help="[gpp/spp] Micro-batch schedule of every stage; auto: the 1F1B search's plans, rescheduled by Algorithm 4 (greedy) where that is faster, the fastest kept.",
    ),
    click.option(
        "--k",
        type=click.IntRange(min=1),
        default=2,
        help="[gpp/spp] k of kFkB (--schedule kfkb only; default 2).",
    ),
    click.option("--memory-limit", metavar="BYTES", help="[gpp/spp] Per-device memory cap, e.g. 8GiB."),
    click.option("--gantt", type=FigureFile(), help="[gpp/spp] Draw the simulated schedule (SVG)."),
    click.option(
        "--trace",
        type=OutputFile(),
        help="[gpp/spp] Write the simulated schedule as a trace (Chrome trace-event JSON: open it in "
        "ui.perfetto.dev): a track per device, a stream per peer, every send an arrow to its receive.",
    ),
    click.option(
        "--pytorch-csv",
        type=OutputFile(),
        help="[gpp/spp] Also write the schedule as torch.distributed.pipelining's CSV (rank r runs stage r; chain plans only: exit 2 for a graph of stages, after -o is written).",
    ),
    click.option("--no-baseline", is_flag=True, help="[gpp] Skip predicting the sequential baseline."),
    click.option(
        "--recompute",
        type=RecomputeChoice(["never", "auto", "all"]),
        is_flag=False,
        flag_value="all",
        default="never",
        show_default=True,
        help="[gpp/spp] Recompute activations in the backward pass: a recomputing stage keeps only its inputs per micro-batch in flight and runs its forward again. auto: on the stages the search finds need the memory; all (also --recompute alone): on every stage. launch runs it with torch.utils.checkpoint.",
    ),
    click.option(
        "--zero",
        type=click.Choice(["0", "1", "auto"]),
        default="0",
        show_default=True,
        help="[gpp/spp] ZeRO-1: a stage's data-parallel replicas each keep 1/d of its optimizer state (gradients reduce-scattered, updated weights all-gathered: the all-reduce's traffic). auto: on the replicated stages whose memory needs it; 1: on every replicated stage; 0: on none.",
    ),
    click.option(
        "--tensor-parallel",
        default="1",
        show_default=True,
        help="[gpp/spp] Every stage's replicas are groups of this many devices of one node, the model's matrix products split Megatron-style (columns then rows, attention by heads; found from the graph's dataflow, docs/gpp.md); auto: the fastest degree dividing each node's devices, as simulated. --devices counts every device.",
    ),
    click.option(
        "--stages",
        type=click.IntRange(min=1),
        default=None,
        help="[gpp/spp] Exactly this many pipeline stages (each on at least one device; the search places "
        "them and their devices). Default: the number the search finds fastest.",
    ),
    click.option(
        "--rewrite",
        "rewrites",
        type=click.Choice([*REWRITES, "all", "auto"]),
        multiple=True,
        help="[gpp/spp] Plan on the model rewritten (repeatable; recorded in the plan, which validate and launch apply too; all: every rewrite; auto: plan as given and with every rewrite that applies, keep the faster, at twice the time). reduce-concat: a reduction over other axes than a Concat's moves above it, one per input. concat-matmul: a fully connected layer over a Concat becomes one product per concatenated input and a Sum, so its parts run inside the branches (exact up to summation order; the trained weights are the parts).",
    ),
    click.option(
        "--bytes-per-param",
        type=FiniteFloat(maximum=1024),
        default=None,
        help="[gpp/spp] Training memory per parameter: weights + gradients + optimizer state [default: 16, Adam in mixed precision: 2 + 2 + 12].",
    ),
    click.option(
        "--optimizer",
        type=click.Choice(["sgd", "adamw", "adam"]),
        default="sgd",
        show_default=True,
        help="[gpp/spp] The optimizer launch will train with (its --optimizer): --profile times each stage's "
        "step with it, and the plan records it.",
    ),
    click.option(
        "--loss",
        type=click.Choice(["mse", "ce"]),
        default="mse",
        show_default=True,
        help="[gpp/spp] The loss launch will train with (its --loss): with ce, --profile times the model's "
        "logits scored by cross-entropy; the plan records it.",
    ),
    click.option(
        "--max-grad-norm",
        type=FiniteFloat(),
        default=None,
        help="[gpp/spp] The global gradient norm launch will clip to (its --max-grad-norm): --profile times "
        "each stage's step with the norm's pass, the simulation charges its all-reduce over every rank "
        "before the optimizer steps; the plan records it.",
    ),
    click.option(
        "--profile",
        is_flag=True,
        help="Measure on this machine instead of the roofline model; cached. [gpp/spp] Every operator's forward "
        "and backward (torch), then the chosen plan's stages as the workers run them. [cp] MODEL's own decode "
        "step (traced; compiled too with --compile): its operations' host time in place of the cluster's "
        "decode_op_overhead (CPU clusters).",
    ),
    click.option(
        "--cache",
        "cache_path",
        type=click.Path(dir_okay=False, path_type=str),
        default=None,
        help="Profile cache of --profile (SQLite; default ~/.cache/tessera/profiles.sqlite).",
    ),
)


def runner(kind: str) -> Callable[..., None]:
    """The plan command's body for ``--kind gpp`` or ``spp``."""

    def run(  # noqa: PLR0913
        *,
        model: str | None,
        input_shapes: tuple[str, ...],
        cluster: str,
        output: str | None,
        as_json: bool,
        mini_batch: int | None,
        devices: int | None,
        schedule: str,
        memory_limit: str | None,
        gantt: str | None,
        trace: str | None,
        export: str | None,
        pytorch_csv: str | None,
        k: int,
        profile: bool,
        cache_path: str | None,
        recompute: str,
        zero: str,
        tensor_parallel: str,
        stages: int | None,
        bytes_per_param: float | None,
        optimizer: str,
        loss: str,
        max_grad_norm: float | None,
        rewrites: tuple[str, ...],
        no_baseline: bool = False,
    ) -> None:
        """Graph-pipeline-parallel (gpp) or sequential (spp) training plan: GraphPipe, thesis ch. 3."""
        from tessera.planners.pipeline.search import planned_device_type

        spec = load_cluster(cluster)
        if model is None:
            raise click.UsageError(f"--kind {kind} needs MODEL (an ONNX file)")
        if mini_batch is None:
            raise click.UsageError(f"--kind {kind} needs --mini-batch")
        planned_device_type(spec, devices, source=cluster)  # before the model is loaded
        check_outputs(
            {"-o": output, "--gantt": gantt, "--trace": trace, "--pytorch-csv": pytorch_csv},
            {"model": model, "cluster spec": cluster if os.path.isfile(cluster) else None},
        )
        if "auto" in rewrites and len(set(rewrites)) > 1:
            raise click.UsageError("--rewrite auto chooses the rewrites itself: give it alone")
        if "all" in rewrites:
            rewrites = tuple(REWRITES)
        run_pipeline_plan(
            load_model_option(model, input_shapes, () if "auto" in rewrites else rewrites),
            spec,
            kind=kind,
            mini_batch=mini_batch,
            devices=devices,
            schedule=schedule,
            memory_limit=memory_limit,
            output=output,
            gantt=gantt,
            trace=trace,
            export=export,
            pytorch_csv=pytorch_csv,
            as_json=as_json,
            no_baseline=no_baseline,
            profile=profile,
            cache=cache_path,
            k=k,
            recompute=recompute,
            zero=zero,
            tensor_parallel=tensor_parallel,
            stages=stages,
            bytes_per_param=bytes_per_param,
            optimizer=optimizer,
            loss=loss,
            max_grad_norm=max_grad_norm,
            rewrite_auto="auto" in rewrites,
        )

    return run


def run_pipeline_plan(  # noqa: PLR0913
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
    trace: str | os.PathLike[str] | None = None,
    export: str | None = None,
    pytorch_csv: str | os.PathLike[str] | None = None,
    as_json: bool = False,
    no_baseline: bool = False,
    profile: bool = False,
    cache: str | os.PathLike[str] | None = None,
    k: int = 2,
    recompute: str = "never",
    zero: int | str = 0,
    tensor_parallel: int | str = 1,
    stages: int | None = None,
    bytes_per_param: float | None = None,
    optimizer: str = "sgd",
    loss: str = "mse",
    max_grad_norm: float | None = None,
    rewrite_auto: bool = False,
) -> GppPlan:
    """The ``plan --kind gpp|spp`` command body: plan, write, print. Raises InfeasibleError (exit 3).

    ``profile``: measure operator times on this machine first (:mod:`tessera.planners.pipeline.profile`),
    cached in the profile cache at ``cache`` (default: the one ``tessera place`` uses).
    ``recompute``: activation recomputation in the backward on no stage (``never``), every stage
    (``all``), or the stages that need the memory (``auto``, chosen by the search); ``bytes_per_param``:
    weights + gradients + optimizer state per parameter (default 16: Adam, mixed precision);
    ``zero``: ZeRO-1 on no replicated stage (0), every one (1), or those that need the memory (auto);
    ``tensor_parallel``: every replica a group of that many devices of a node (docs/gpp.md);
    ``stages``: exactly that many stages.
    ``rewrite_auto`` (``--rewrite auto``): plan ``graph`` (loaded without rewrites) as given and
    with every rewrite that changes it (:func:`tessera.core.rewrite.applicable`), and keep the
    faster plan (the search, and the baseline, run twice). Otherwise, on a graph loaded without
    rewrites, the text output hints at those that would apply.
    """
    from tessera.api.planning import plan_pipeline
    from tessera.planners.pipeline.checks import untrainable_message

    with progress_bar() as bar:
        tasks: dict[str, Any] = {}  # a bar for each measurement, shown once it starts

        def progress(what: str, done: int, total: int | None) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(what, total=total)
            bar.update(tasks[what], completed=done, total=total)

        choice = plan_pipeline(
            graph, cluster, kind=kind, mini_batch=mini_batch, devices=devices, schedule=schedule,
            memory_limit=memory_limit, k=k, recompute=recompute, zero=zero, tensor_parallel=tensor_parallel,
            stages=stages, bytes_per_param=bytes_per_param, optimizer=optimizer, loss=loss, max_grad_norm=max_grad_norm, baseline=not no_baseline, rewrite_auto=rewrite_auto, profile=profile, cache=cache,
            progress=progress,
            note=lambda line: click.echo(f"tessera: {line}", err=True),
        )  # fmt: skip
    plan, pipe, sim = choice.plan
    if profile and (hint := _uncalibrated_hint(cluster, plan)) is not None:
        click.echo(hint, err=True)
    if (why := untrainable_message(graph)) is not None:  # a plan to simulate; launch would refuse it
        click.echo(f"tessera: warning: {graph.source}: launch cannot train this model: {why}", err=True)
    if bound := [k for k in graph.defaulted_dims if not k.rsplit(":", 1)[1].startswith("0 ")]:
        # the batch axis takes the micro-batch; any other symbolic dim stays 1 (a sequence of one token)
        click.echo(
            f"tessera: warning: {graph.source}: symbolic dims bound to 1: {', '.join(bound)}: the plan, and "
            "launch, train at that size (give --input-shape NAME=DIMS for another)",
            err=True,
        )
    _write_files(
        plan,
        pipe,
        sim,
        graph,
        output=output,
        gantt=gantt,
        trace=trace,
        pytorch_csv=pytorch_csv,
        export=export,
    )
    if as_json:
        click.echo(dump_plan(plan), nl=False)
    else:
        click.echo(summary(plan, pipe))
        for line in _export_lines(plan):
            click.echo(line)
        if len(choice.results) > 1:
            click.echo(_compared(choice))
        names, replaced = (
            applicable(graph.model, label=graph.source) if not (graph.rewrites or rewrite_auto) else ([], [])
        )
        if names:
            shown = ", ".join(replaced[:4]) + (f" and {len(replaced) - 4} more" if len(replaced) > 4 else "")
            flags = " ".join(f"--rewrite {n}" for n in names)
            click.echo(f"hint: {flags} would replace {shown}; plan with it to compare", err=True)
    if export is not None and not (made := plan.exports[export])["expressible"]:
        raise InputError(f"--export {export}: {made['why']}")
    return plan


def _write_files(  # noqa: PLR0913
    plan: GppPlan,
    pipe: Pipeline,
    sim: Any,
    graph: Graph,
    *,
    output: str | os.PathLike[str] | None,
    gantt: str | os.PathLike[str] | None,
    trace: str | os.PathLike[str] | None,
    pytorch_csv: str | os.PathLike[str] | None,
    export: str | None,
) -> None:
    """The plan (with its ``--export``) and the files drawn from it."""
    if export == "megatron":
        from tessera.planners.pipeline.exports import megatron_config

        plan.exports["megatron"] = megatron_config(plan, graph)
    if output is not None:
        write_plan(plan, output)
    if gantt is not None:
        write_gantt(sim, pipe, gantt)
    if trace is not None:
        from tessera.planners.pipeline.trace import schedule_trace

        write_output(trace, json_text(schedule_trace(plan, sim)))
    if pytorch_csv is not None:
        write_pytorch_csv(plan, pytorch_csv)


def _export_lines(plan: GppPlan) -> list[str]:
    """The plan in other engines' terms (``--export``), one line each."""
    lines = []
    for engine, made in plan.exports.items():
        if made["expressible"]:
            command = " ".join(
                ["torchrun", "pretrain_gpt.py", *(f"'{a}'" if "|" in a else a for a in made["args"])]
            )
            lines.append(f"{engine}: {command}" + (f" ({made['why']})" if made["why"] else ""))
        else:
            lines.append(f"{engine}: not expressible: {made['why']}")
    return lines


def _uncalibrated_hint(cluster: ClusterSpec, plan: GppPlan) -> str | None:
    """A hint when a plan of several CPU ranks is priced with a preset's links and overheads: on
    this machine gloo's all-reduce took 3 ms where a preset prices 0.2 (a +86% prediction)."""
    ranks = sum(len(st.devices) for st in plan.stages)
    types = cluster.device_types.values()
    if ranks < 2 or any(t.kind != "cpu" for t in types):
        return None
    link = cluster.links.intra_node
    if any(t.action_overhead > 0 for t in types) or (link is not None and link.allreduce_curve):
        return None
    return (
        f"hint: {cluster.name}'s links and per-message costs are not this machine's measurements: "
        "`tessera calibrate -o spec.yaml` measures them, and --cluster spec.yaml plans with them"
    )


def _compared(choice: RewriteChoice) -> str:
    """``--rewrite auto``'s line: each model's simulated throughput and the one kept."""
    parts = []
    for i, (graph, (_, _, sim)) in enumerate(zip(choice.candidates, choice.results, strict=True)):
        names = graph.rewrites
        label = f"rewritten ({', '.join(names)})" if names else "as given"
        parts.append(f"{label} {sim.throughput:,.1f} samples/s" + (" (kept)" if i == choice.kept else ""))
    return "rewrite auto: " + "; ".join(parts)


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
    zero = any(st.zero for st in plan.stages)  # the ZeRO column where a stage shards its state
    tp = any(st.tensor_parallel > 1 for st in plan.stages)  # the tensor-parallel degree, where used
    lines.append(
        f"{'stage':>5} {'ops':>5} {'devices':>7} {'in-flight':>9} {'fw+bw/mb':>10} {'memory':>10}"
        + (f" {'recompute':>9}" if recompute else "")
        + (f" {'zero':>4}" if zero else "")
        + (f" {'tp':>3}" if tp else "")
        + "  first op"
    )
    for st in plan.stages:
        t = st.predicted["forward_time_s"] + st.predicted["backward_time_s"]
        lines.append(
            f"{st.id:>5} {len(st.nodes):>5} {len(st.devices):>7} {st.in_flight:>9} "
            f"{t * 1e3:>8.2f}ms {format_bytes(st.memory.peak):>10}"
            + (f" {'yes' if st.recompute else 'no':>9}" if recompute else "")
            + (f" {st.zero:>4}" if zero else "")
            + (f" {st.tensor_parallel:>3}" if tp else "")
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
