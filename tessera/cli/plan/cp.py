"""``tessera plan --kind cp``: a cache-parallel (or TP, DP) decode plan of an ONNX decoder or an LLM
config; the planning is :func:`tessera.planners.cp.plan.plan_cp_request`."""

from __future__ import annotations

import json
import os
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from tessera.api.planning import plan_decoding
from tessera.cli.options import FigureFile, OptionGroup, check_outputs, load_model_option
from tessera.cli.render import console, emit_json, human_bytes
from tessera.core.errors import InputError
from tessera.core.plans import dump_plan, write_plan
from tessera.core.specs import load_cluster
from tessera.planners.cp.cost import STRATEGIES
from tessera.planners.cp.plan import sweep_to_json
from tessera.planners.cp.workload import parse_token_count, parse_token_counts

OPTIONS = OptionGroup(
    click.option(
        "--llm", metavar="CONFIG", help="[cp] LLM config YAML or preset (llama-7b, gpt2) instead of MODEL."
    ),
    click.option(
        "--batch", type=click.IntRange(min=1), help="[cp] Concurrent requests (the batch limit; 1..65536)."
    ),
    click.option(
        "--context", metavar="TOKENS", help="[cp] Prompt length already in the KV cache, e.g. 32K (K = 1024)."
    ),
    click.option(
        "--output-len",
        default="uniform:1-1024",
        show_default=True,
        metavar="DIST",
        help="[cp] Output lengths: N, uniform:A-B or file:PATH (one integer per line); tokens 1..1024M.",
    ),
    click.option(
        "--layers",
        type=click.IntRange(min=1),
        help="[cp] Evaluate only this many layers, without embedding and LM head (the thesis measures 1).",
    ),
    click.option(
        "--dtype",
        type=click.Choice(["fp32", "fp16", "bf16", "fp8", "int8"]),
        help="[cp] Serve in this dtype.",
    ),
    click.option(
        "--sweep-context", metavar="LIST", help="[cp] Also predict these contexts, e.g. 1K,10K,100K,1M."
    ),
    click.option("--plot", type=FigureFile(), help="[cp] Draw the sweep (SVG)."),
    click.option(
        "--strategy",
        type=click.Choice(["auto", *STRATEGIES]),
        default="auto",
        show_default=True,
        help="[cp] Parallelize by cp, tp or dp; auto: the fastest predicted.",
    ),
    click.option(
        "--degree",
        type=click.IntRange(min=1),
        help="[cp] Devices to decode on (default: the fastest predicted).",
    ),
    click.option(
        "--compile",
        "compile_",
        is_flag=True,
        help="[cp] Predict the decode step as launch --compile runs it (torch.compile's inductor): each "
        "operation at the cluster's decode_compiled_op_overhead.",
    ),
)


def run(  # noqa: PLR0913
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
    strategy: str = "auto",
    degree: int | None = None,
    export: str | None = None,
    compile_: bool = False,
    profile: bool = False,
    cache_path: str | None = None,
) -> None:
    """Cache-parallel decode plan: load the decoder (or its config), plan, write, print."""
    spec = load_cluster(cluster)
    _check_options(model, llm, input_shapes, batch, context, sweep_context, output, plot)
    check_outputs(
        {"-o": output, "--plot": plot},
        {"model": model, "LLM config": llm, "cluster spec": cluster if os.path.isfile(cluster) else None},
    )
    contexts = (
        parse_token_counts(sweep_context, option="--sweep-context") if sweep_context is not None else []
    )
    planned = plan_decoding(
        spec,
        graph=load_model_option(model, input_shapes) if model is not None else None,
        llm=llm,
        batch=batch,
        context=parse_token_count(context, option="--context") if context is not None else None,
        output_len=output_len,
        sweep_contexts=contexts,
        layers=layers,
        dtype=dtype,
        strategy=strategy,
        degree=degree,
        compile=compile_,
        profile=profile,
        cache=cache_path,
    )
    for line in planned.warnings:
        click.echo(f"tessera: warning: {line}", err=True)
    plan, rows, config = planned.plan, planned.rows, planned.config
    if plan is not None and output:
        write_plan(plan, output)
    if plot:
        from tessera.planners.cp.plot import plot_sweep

        per = f", {layers} layer{'s' if layers > 1 else ''}" if layers else ""
        plot_sweep(rows, plot, title=f"{config.name} on {spec.name}, batch {batch}{per}")

    _emit(
        planned,
        output,
        as_json=as_json,
        plot=plot,
        pinned=strategy != "auto" or degree is not None,
        layers=layers,
    )
    if export is not None and plan is not None and not (made := plan.serving[export])["expressible"]:
        raise InputError(f"--export {export}: {made['why']}")


def _check_options(
    model: str | None,
    llm: str | None,
    input_shapes: tuple[str, ...],
    batch: int | None,
    context: str | None,
    sweep_context: str | None,
    output: str | None,
    plot: str | None,
) -> None:
    """The cp options that exclude or need each other: a usage error (exit 2) naming them."""
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


def _emit(
    planned: Any, output: str | None, *, as_json: bool, plot: str | None, pinned: bool, layers: int | None
) -> None:
    """The plan and the sweep, as JSON or as tables, as asked."""
    plan, rows = planned.plan, planned.rows
    if as_json:
        if rows:
            emit_json(
                {"plan": None if plan is None else json.loads(dump_plan(plan)), "sweep": sweep_to_json(rows)}
            )
        elif plan is not None:
            click.echo(dump_plan(plan), nl=False)
    else:
        out = console()
        if plan is not None:
            _print_cp_plan(out, plan, output, pinned=pinned)
        if rows:
            _print_sweep(out, rows, unit="tokens/s per layer" if layers == 1 else "tokens/s")
        if plot:
            out.print(f"plot written to {plot}")


SERVE_COMMANDS = {  # engine -> (its name, the command that serves MODEL)
    "vllm": ("vLLM", "vllm serve MODEL"),
    "sglang": ("SGLang", "python -m sglang.launch_server --model-path MODEL"),
    "trtllm": ("TensorRT-LLM", "trtllm-serve MODEL"),
}


def _print_cp_plan(out: Any, plan: Any, output: str | None, *, pinned: bool = False) -> None:
    p = plan.predicted
    llm = plan.llm
    out.print(
        f"[bold]{llm['name']}[/bold] ({llm['layers']} layers, E={llm['hidden']}, H={llm['heads']}, "
        f"kv_heads={llm['kv_heads']}"
        + (
            f", {llm['experts']} experts, {llm['experts_per_token']} per token"
            + (f" ({llm['dense_layers']} dense layer(s))" if llm.get("dense_layers") else "")
            if llm.get("experts", 1) > 1
            else ""
        )
        + f", {llm['dtype']}) on {plan.cluster['name']}: "
        f"batch {plan.workload['batch']}, context {plan.workload['context']}, "
        f"output {plan.workload['output_len']['spec']}"
        + (f", {p['layers_evaluated']} layer(s) evaluated" if p["per_layer"] else "")
    )
    out.print(
        f"{'chosen' if pinned else 'best'}: [bold]{plan.strategy.upper()} x{plan.degree}[/bold]  "
        f"{p['tokens_per_s']:.6g} tokens/s, "
        f"{p['per_token_latency_s'] * 1e3:.4g} ms per token, "
        f"memory {human_bytes(p['memory_per_device']['total'])} of "
        f"{human_bytes(p['memory_per_device']['capacity'])} per device"
    )
    if "expert_split" in plan.workload:
        out.print(f"  experts: {plan.workload['expert_split']}")
    for c in plan.collectives:
        out.print(
            f"  per layer: {c['op']} {human_bytes(c['bytes'])} over {len(c['group'])} devices ({c['what']})"
        )
    if p.get("launch"):
        launch = p["launch"]
        held = (
            "the dense part on every device"
            if "weights_whole" not in launch
            else f"{1 - launch['weights_whole']:.0%} of the layers' weights split, the LM head whole"
        )
        per_layer = "; ".join(f"{c['per']}: {c['op']} of the {c['what']}" for c in launch["collectives"])
        out.print(f"  tessera launch: {launch['step_time_s'] * 1e3:.4g} ms per token ({held}; {per_layer})")
    for engine, config in plan.serving.items():
        name, command = SERVE_COMMANDS.get(engine, (engine, engine))
        serve = " ".join([command, *config["args"]])
        out.print(
            f"{name}: {escape(serve)} ({escape(config['why'])})"
            if config["expressible"]
            else f"{name}: not expressible: {escape(config['why'])}"
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
