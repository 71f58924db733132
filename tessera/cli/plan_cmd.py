"""``tessera plan [MODEL] --kind KIND …``: make a plan of one kind.

Each kind is a function registered in :data:`KINDS` with the options it reads; the command parses,
checks that no option of another kind was given, and calls it. The planning itself lives in
``tessera.planners.<kind>``; a kind's function only loads inputs, calls the planner and prints.

``--kind gpp`` / ``--kind spp`` (pipeline-parallel training, GraphPipe)::

    tessera plan mmt.onnx --kind gpp --cluster graphpipe-v100 --mini-batch 256 -o plan.json --gantt plan.svg
    tessera plan mmt.onnx --kind gpp --cluster local-cpu --mini-batch 32 --profile --cache profiles.sqlite

``--kind cp`` (cache-parallel decoding, thesis ch. 4)::

    tessera plan --kind cp --llm llama-7b --cluster a5000-4x --batch 32 --context 32K -o plan.json
    tessera plan gpt.onnx --kind cp --cluster h200 --batch 8 --context 512 --output-len 256 --json
    tessera plan --kind cp --llm llama-7b --cluster a5000-4x --batch 32 --layers 1 \\
        --sweep-context 1K,10K,100K --plot sweep.svg
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
from rich.table import Table

from tessera.cli.options import (
    FigureFile,
    OutputFile,
    check_outputs,
    json_option,
    load_model_option,
    output_option,
)
from tessera.cli.render import console, emit_json, human_bytes
from tessera.core.plans import ModelRef, dump_plan, write_plan
from tessera.core.rewrite import REWRITES
from tessera.core.schedule import SCHEDULE_CHOICES
from tessera.core.specs import load_cluster

__all__ = ["KINDS", "PlanKind", "plan"]


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


@dataclass(frozen=True)
class PlanKind:
    """A plan kind: the function that makes and prints it, and the kind-specific options it reads."""

    run: Callable[..., None]
    options: frozenset[str]


# -- --kind cp ------------------------------------------------------------------------------------

_CP_OPTIONS = frozenset({"llm", "batch", "context", "output_len", "layers", "dtype", "sweep_context", "plot"})


def run_cp(
    *,
    model: str | None,
    input_shapes: tuple[str, ...],
    cluster: str,
    output: str | None,
    as_json: bool,
    llm: str | None,
    batch: int | None,
    context: str | None,
    output_len: str,
    layers: int | None,
    dtype: str | None,
    sweep_context: str | None,
    plot: str | None,
) -> None:
    """Cache-parallel decode plan: see :func:`tessera.planners.cp.plan.plan_cp`."""
    from tessera.core.errors import InputError
    from tessera.planners.cp.llm import LlmSource, load_llm_config
    from tessera.planners.cp.plan import plan_cp, sweep_to_json
    from tessera.planners.cp.plan import sweep_context as sweep
    from tessera.planners.cp.recognize import position_limit, recognize_llm
    from tessera.planners.cp.workload import (
        MAX_TOKENS,
        Workload,
        parse_output_lengths,
        parse_token_count,
        parse_token_counts,
    )

    spec = load_cluster(cluster)
    if (model is None) == (llm is None):
        raise click.UsageError(
            "--kind cp takes either MODEL (an ONNX decoder) or --llm CONFIG, not both or neither"
        )
    if llm is not None and input_shapes:
        raise click.UsageError("--input-shape binds MODEL's inputs: it does not apply to --llm")
    if batch is None:
        raise click.UsageError("--kind cp needs --batch")
    if context is None and sweep_context is None:
        raise click.UsageError("--kind cp needs --context (or --sweep-context)")
    if context is None and output is not None:
        raise click.UsageError("-o writes the plan for --context; give --context")
    if plot is not None and sweep_context is None:
        raise click.UsageError("--plot draws the --sweep-context table; give --sweep-context")
    check_outputs(
        {"-o": output, "--plot": plot},
        {"model": model, "LLM config": llm, "cluster spec": cluster if os.path.isfile(cluster) else None},
    )
    model_ref = None
    if model is not None:
        graph = load_model_option(model, input_shapes)
        config = recognize_llm(graph)
        source = LlmSource(kind="onnx", path=graph.source, sha256=graph.sha256)
        model_ref = ModelRef.of(graph)
    else:
        assert llm is not None
        config, source = load_llm_config(llm)
    config = config.with_dtype(dtype)
    if layers is not None and not 1 <= layers <= config.layers:
        raise InputError(f"--layers: must be in 1..{config.layers} (the model's layers); got {layers}")
    output_lengths = parse_output_lengths(output_len)
    contexts = (
        parse_token_counts(sweep_context, option="--sweep-context") if sweep_context is not None else []
    )
    base_context = parse_token_count(context, option="--context") if context is not None else contexts[0]
    workload = Workload(batch, base_context, output_lengths)
    # A request feeds back all but its last generated token: context + output - 1 positions.
    longest = max([base_context, *contexts]) + output_lengths.max - 1
    needs = f"context {max([base_context, *contexts])} plus output lengths up to {output_lengths.max} needs {longest} positions"
    if model is not None and (limit := position_limit(graph, config.hidden)) is not None and longest > limit:
        raise InputError(
            f"{needs}, but the model's position table has {limit}: give a shorter --context or --output-len",
            source=graph.source,
        )
    if longest > MAX_TOKENS:  # what launch can decode (and what a plan's context may be)
        raise InputError(f"{needs}; a request may hold at most {MAX_TOKENS} (1024M)")

    plan = None
    if context is not None:
        plan = plan_cp(config, spec, workload, model=model_ref, source=source, layers=layers)
        if output:
            write_plan(plan, output)
    rows = sweep(config, spec, workload, contexts, layers=layers) if contexts else []
    if plot:
        from tessera.planners.cp.plot import plot_sweep

        per = f", {layers} layer{'s' if layers > 1 else ''}" if layers else ""
        plot_sweep(rows, plot, title=f"{config.name} on {spec.name}, batch {batch}{per}")

    if as_json:
        if rows:
            import json

            emit_json(
                {"plan": None if plan is None else json.loads(dump_plan(plan)), "sweep": sweep_to_json(rows)}
            )
        elif plan is not None:
            click.echo(dump_plan(plan), nl=False)
        return
    out = console()
    if plan is not None:
        _print_cp_plan(out, plan, output)
    if rows:
        _print_sweep(out, rows, unit="tokens/s per layer" if layers == 1 else "tokens/s")
    if plot:
        out.print(f"plot written to {plot}")


def _print_cp_plan(out: Any, plan: Any, output: str | None) -> None:
    p = plan.predicted
    llm = plan.llm
    out.print(
        f"[bold]{llm['name']}[/bold] ({llm['layers']} layers, E={llm['hidden']}, H={llm['heads']}, "
        f"kv_heads={llm['kv_heads']}, {llm['dtype']}) on {plan.cluster['name']}: "
        f"batch {plan.workload['batch']}, context {plan.workload['context']}, "
        f"output {plan.workload['output_len']['spec']}"
        + (f", {p['layers_evaluated']} layer(s) evaluated" if p["per_layer"] else "")
    )
    out.print(
        f"best: [bold]{plan.strategy.upper()} x{plan.degree}[/bold]  {p['tokens_per_s']:.6g} tokens/s, "
        f"{p['per_token_latency_s'] * 1e3:.4g} ms per token, "
        f"memory {human_bytes(p['memory_per_device']['total'])} of "
        f"{human_bytes(p['memory_per_device']['capacity'])} per device"
    )
    for c in plan.collectives:
        out.print(
            f"  per layer: {c['op']} {human_bytes(c['bytes'])} over {len(c['group'])} devices ({c['what']})"
        )
    table = Table(
        title="all strategies (per-device step: GPU compute, communication, host)", title_justify="left"
    )
    for col in ("", "x", "tokens/s", "ms/token", "GPU ms", "comm ms", "host ms", "memory"):
        table.add_column(col, justify="left" if not col else "right")
    chosen = {"strategy": plan.strategy, "degree": plan.degree, "feasible": True, **p}
    infeasible = []
    for a in sorted([chosen, *plan.alternatives], key=lambda a: (-(a["tokens_per_s"] or -1), a["degree"])):
        b = a["breakdown"]
        name = a["strategy"].upper() + (" *" if a is chosen else "")
        if not a["feasible"]:
            infeasible.append(f"  {a['strategy'].upper()} x{a['degree']}: {a['reason']}")
        table.add_row(
            name,
            str(a["degree"]),
            f"{a['tokens_per_s']:.4g}" if a["feasible"] else "-",
            f"{a['per_token_latency_s'] * 1e3:.3g}" if a["feasible"] else "-",
            f"{b['compute_s'] * 1e3:.3g}",
            f"{b['communication_s'] * 1e3:.3g}",
            f"{b['host_s'] * 1e3:.3g}",
            human_bytes(a["memory_per_device"]["total"]),
        )
    out.print(table)
    if infeasible:
        out.print("infeasible:")
        for line in infeasible:
            out.print(line)
    if output:
        out.print(f"plan written to {output}")


def _print_sweep(out: Any, rows: list[Any], *, unit: str) -> None:
    from tessera.planners.cp.cost import STRATEGIES

    table = Table(title=f"context sweep ({unit}, best degree of each strategy)", title_justify="left")
    table.add_column("strategy")
    for row in rows:
        table.add_column(f"{row.context}", justify="right")
    for strategy in STRATEGIES:
        cells = []
        for row in rows:
            e = row.best[strategy]
            cells.append("-" if e is None else f"{e.tokens_per_s:.4g} (x{e.degree})")
        table.add_row(strategy.upper(), *cells)
    table.add_row("best", *[(row.winner or "none").upper() for row in rows])
    out.print(table)


# -- --kind gpp / spp ------------------------------------------------------------------------------

_GPP_OPTIONS = frozenset(
    {
        "mini_batch",
        "devices",
        "schedule",
        "memory_limit",
        "gantt",
        "pytorch_csv",
        "no_baseline",
        "k",
        "profile",
        "cache_path",
        "recompute",
        "rewrites",
        "bytes_per_param",
    }
)


def _pipeline_runner(kind: str) -> Callable[..., None]:
    def run(
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
        pytorch_csv: str | None,
        k: int,
        profile: bool,
        cache_path: str | None,
        recompute: str,
        bytes_per_param: float | None,
        rewrites: tuple[str, ...],
        no_baseline: bool = False,
    ) -> None:
        """Graph-pipeline-parallel (gpp) or sequential (spp) training plan: GraphPipe, thesis ch. 3."""
        from tessera.planners.pipeline.cli import run_gpp_plan
        from tessera.planners.pipeline.search import planned_device_type

        spec = load_cluster(cluster)
        if model is None:
            raise click.UsageError(f"--kind {kind} needs MODEL (an ONNX file)")
        if mini_batch is None:
            raise click.UsageError(f"--kind {kind} needs --mini-batch")
        planned_device_type(spec, devices, source=cluster)  # before the model is loaded
        check_outputs(
            {"-o": output, "--gantt": gantt, "--pytorch-csv": pytorch_csv},
            {"model": model, "cluster spec": cluster if os.path.isfile(cluster) else None},
        )
        if "auto" in rewrites and len(set(rewrites)) > 1:
            raise click.UsageError("--rewrite auto chooses the rewrites itself: give it alone")
        if "all" in rewrites:
            rewrites = tuple(REWRITES)
        run_gpp_plan(
            load_model_option(model, input_shapes, () if "auto" in rewrites else rewrites),
            spec,
            kind=kind,
            mini_batch=mini_batch,
            devices=devices,
            schedule=schedule,
            memory_limit=memory_limit,
            output=output,
            gantt=gantt,
            pytorch_csv=pytorch_csv,
            as_json=as_json,
            no_baseline=no_baseline,
            profile=profile,
            cache=cache_path,
            k=k,
            recompute=recompute,
            bytes_per_param=bytes_per_param,
            rewrite_auto="auto" in rewrites,
        )

    return run


KINDS: dict[str, PlanKind] = {
    "cp": PlanKind(run_cp, _CP_OPTIONS),
    "gpp": PlanKind(_pipeline_runner("gpp"), _GPP_OPTIONS),
    "spp": PlanKind(_pipeline_runner("spp"), _GPP_OPTIONS - {"no_baseline"}),  # spp is the baseline
}


# -- the command ----------------------------------------------------------------------------------


@click.command()
@click.argument("model", required=False, type=click.Path(dir_okay=False, path_type=str))
@click.option(
    "--kind",
    type=click.Choice(sorted(KINDS)),
    default="gpp",
    show_default=True,
    help="What to plan: a graph-pipeline-parallel (gpp) or sequential (spp) training plan, or cp decoding.",
)
@click.option("--cluster", required=True, metavar="SPEC", help="Cluster spec: a YAML file or a preset name.")
@click.option(
    "--input-shape",
    "input_shapes",
    multiple=True,
    metavar="NAME=DxD…",
    help="Concrete shape for a MODEL input with symbolic dims (repeatable).",
)
@output_option
@json_option
@click.option(
    "--llm", metavar="CONFIG", help="[cp] LLM config YAML or preset (llama-7b, gpt2) instead of MODEL."
)
@click.option(
    "--batch", type=click.IntRange(min=1), help="[cp] Concurrent requests (the batch limit; 1..65536)."
)
@click.option(
    "--context", metavar="TOKENS", help="[cp] Prompt length already in the KV cache, e.g. 32K (K = 1024)."
)
@click.option(
    "--output-len",
    default="uniform:1-1024",
    show_default=True,
    metavar="DIST",
    help="[cp] Output lengths: N, uniform:A-B or file:PATH (one integer per line); tokens 1..1024M.",
)
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    help="[cp] Evaluate only this many layers, without embedding and LM head (the thesis measures 1).",
)
@click.option(
    "--dtype", type=click.Choice(["fp32", "fp16", "bf16", "fp8", "int8"]), help="[cp] Serve in this dtype."
)
@click.option(
    "--sweep-context", metavar="LIST", help="[cp] Also predict these contexts, e.g. 1K,10K,100K,1M."
)
@click.option("--plot", type=FigureFile(), help="[cp] Draw the sweep (SVG).")
@click.option("--mini-batch", type=click.IntRange(min=1), help="[gpp/spp] Samples per training iteration.")
@click.option("--devices", type=click.IntRange(min=1), help="[gpp/spp] Use this many devices (default: all).")
@click.option(
    "--schedule",
    type=click.Choice(SCHEDULE_CHOICES),
    default="1f1b",
    show_default=True,
    help="[gpp/spp] Micro-batch schedule of every stage; auto: the 1F1B search's plans, "
    "rescheduled by Algorithm 4 (greedy) where that is faster, the fastest kept.",
)
@click.option(
    "--k",
    type=click.IntRange(min=1),
    default=2,
    help="[gpp/spp] k of kFkB (--schedule kfkb only; default 2).",
)
@click.option("--memory-limit", metavar="BYTES", help="[gpp/spp] Per-device memory cap, e.g. 8GiB.")
@click.option(
    "--gantt",
    type=FigureFile(),
    help="[gpp/spp] Draw the simulated schedule (SVG).",
)
@click.option(
    "--pytorch-csv",
    type=OutputFile(),
    help="[gpp/spp] Also write the schedule as torch.distributed.pipelining's CSV (rank r runs "
    "stage r; chain plans only: exit 2 for a graph of stages, after -o is written).",
)
@click.option("--no-baseline", is_flag=True, help="[gpp] Skip predicting the sequential baseline.")
@click.option(
    "--recompute",
    type=RecomputeChoice(["never", "auto", "all"]),
    is_flag=False,
    flag_value="all",
    default="never",
    show_default=True,
    help="[gpp/spp] Recompute activations in the backward pass: a recomputing stage keeps only its "
    "inputs per micro-batch in flight and runs its forward again. auto: on the stages the search "
    "finds need the memory; all (also --recompute alone): on every stage. launch runs it with "
    "torch.utils.checkpoint.",
)
@click.option(
    "--rewrite",
    "rewrites",
    type=click.Choice([*REWRITES, "all", "auto"]),
    multiple=True,
    help="[gpp/spp] Plan on the model rewritten (repeatable; recorded in the plan, which validate "
    "and launch apply too; all: every rewrite; auto: plan as given and with every rewrite that applies, "
    "keep the faster, at twice the time). reduce-concat: a reduction over other axes than a "
    "Concat's moves above it, "
    "one per input. concat-matmul: a fully connected layer over a Concat becomes one product per "
    "concatenated input and a Sum, so its parts run inside the branches (exact up to summation order; "
    "the trained weights are the parts).",
)
@click.option(
    "--bytes-per-param",
    type=click.FloatRange(min=0, min_open=True, max=1024),
    default=None,
    help="[gpp/spp] Training memory per parameter: weights + gradients + optimizer state "
    "[default: 16, Adam in mixed precision: 2 + 2 + 12].",
)
@click.option(
    "--profile",
    is_flag=True,
    help="[gpp/spp] Measure every operator's forward and backward on this machine (torch) instead of "
    "the roofline model; cached.",
)
@click.option(
    "--cache",
    "cache_path",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="[gpp/spp] Profile cache of --profile (SQLite; default ~/.cache/tessera/profiles.sqlite).",
)
def plan(
    model: str | None,
    kind: str,
    cluster: str,
    input_shapes: tuple[str, ...],
    output: str | None,
    as_json: bool,
    **options: Any,
) -> None:
    """Plan how to run MODEL on a cluster.

    --kind gpp: a graph-pipeline-parallel training plan (GraphPipe, thesis ch. 3); --kind spp: the
    strongest sequential pipeline (PipeDream-style) on the same cost model; --kind cp: parallel LLM
    decoding (cache parallelism vs TP vs DP, thesis ch. 4).

    Exit codes: 0 planned, 2 bad input (including a model that is not a decoder-only transformer),
    3 infeasible (nothing fits in device memory).
    """
    spec = KINDS[kind]
    ctx = click.get_current_context()
    foreign = [
        name
        for name in options
        if name not in spec.options
        and ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    ]
    if foreign:
        flag = next(p.opts[0] for p in ctx.command.params if p.name == foreign[0])  # as typed: --rewrite
        defaulted = ctx.get_parameter_source("kind") is click.core.ParameterSource.DEFAULT
        hint = (
            " (the default kind; decoding plans need --kind cp)"
            if defaulted and foreign[0] in _CP_OPTIONS
            else ""
        )
        raise click.UsageError(f"{flag} does not apply to --kind {kind}{hint}")
    if (
        ctx.get_parameter_source("k") is not click.core.ParameterSource.DEFAULT
        and options.get("schedule") != "kfkb"
    ):
        raise click.UsageError(
            f"--k is the k of kFkB: it needs --schedule kfkb (not {options.get('schedule')})"
        )
    spec.run(
        model=model,
        input_shapes=input_shapes,
        cluster=cluster,
        output=output,
        as_json=as_json,
        **{name: value for name, value in options.items() if name in spec.options},
    )
