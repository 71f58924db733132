"""``tessera inspect MODEL``: what a model is made of, and where it branches."""

from __future__ import annotations

from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from tessera.api.results import inspect_report
from tessera.cli.options import OutputFile, check_outputs, json_option, model_options, output_option
from tessera.cli.render import console, emit_json, human_bytes, human_count
from tessera.core.files import write_output
from tessera.core.graph import Graph, write_model
from tessera.core.plan_files import json_text


@click.command()
@model_options
@json_option
@output_option
@click.option(
    "--write-named",
    type=OutputFile(),
    help="Write the model with every node named.",
)
@click.option(
    "--top",
    type=click.IntRange(min=0),
    default=12,
    show_default=True,
    help="Op types shown in the histogram (human output).",
)
def inspect(graph: Graph, as_json: bool, output: str | None, write_named: str | None, top: int) -> None:
    """Summarize MODEL: nodes, op types, parameters, FLOPs, inputs/outputs and branch structure."""
    check_outputs({"-o": output, "--write-named": write_named}, {"model": graph.source})
    report = inspect_report(graph)
    if write_named:
        write_model(graph.named_model(), write_named)
    if output:
        write_output(output, json_text(report))
    if as_json:
        emit_json(report)
        return
    out = console()
    params = report["parameters"]
    out.print(
        f"[bold]{escape(graph.source)}[/bold]  (IR {report['model']['ir_version']}, opsets {report['model']['opsets']})"
    )
    out.print(
        f"nodes {report['nodes']}   parameters {human_count(params['count'])} ({human_bytes(params['bytes'])})   "
        f"FLOPs {human_count(report['flops'])}   bytes moved {human_bytes(report['bytes_moved'])}"
    )
    io = Table(title="inputs and outputs", title_justify="left")
    for col in ("", "name", "shape", "dtype"):
        io.add_column(col)
    for kind in ("inputs", "outputs"):
        for t in report[kind]:
            io.add_row(kind[:-1], escape(t["name"]), "x".join(map(str, t["shape"] or ["?"])), t["dtype"])
    out.print(io)
    hist = Table(title="op types", title_justify="left")
    hist.add_column("op")
    hist.add_column("count", justify="right")
    items = list(report["op_types"].items())
    for op, n in items[:top]:
        hist.add_row(escape(op), str(n))
    if len(items) > top:
        hist.add_row(f"… {len(items) - top} more", str(sum(n for _, n in items[top:])))
    out.print(hist)
    b = report["branches"]
    segments = b["parallel_segments"]
    out.print(
        f"branches: up to {b['max_parallel_branches']} in parallel; "
        f"{len(segments)} parallel segment(s), {b['articulation_operators']} articulation operator(s)"
    )
    for seg in segments[:5]:
        out.print(
            f"  {seg['branches']} branches, {seg['nodes']} nodes: "
            f"{escape(seg['start'] or 'inputs')} → {escape(seg['end'] or 'outputs')}"
        )
    _print_notes(out, graph, report)


def _print_notes(out: Any, graph: Graph, report: dict[str, Any]) -> None:
    """The decoder found, symbolic dims bound, and why the graph cannot be planned."""
    if (decoder := report["decoder"]) is not None:
        out.print(f"decoder: {escape(_describe(decoder))}")
    if graph.defaulted_dims:
        dims = ", ".join(f"{k}={v}" for k, v in graph.defaulted_dims.items())
        out.print(f"symbolic dims bound to 1: {escape(dims)} (override with --input-shape)")
    if report["traced_for_example"] is not None:
        out.print(f"plan, place and launch refuse this graph: {escape(report['traced_for_example'])}")


def _describe(decoder: dict[str, Any]) -> str:
    if not decoder["recognized"]:
        return f"not recognized ({decoder['why']})"
    rotary = decoder["rotary"]
    parts = [
        f"{decoder['layers']} layers, hidden {decoder['hidden']}, {decoder['heads']} heads "
        f"({decoder['kv_heads']} KV) of {decoder['head_dim']}, FFN {decoder['ffn']}"
        + (" gated" if decoder["gated_ffn"] else "")
        + (
            f" × {decoder['experts']} experts, {decoder['experts_per_token']} per token"
            + (f", shared FFN {decoder['shared_ffn']}" if decoder["shared_ffn"] else "")
            + (
                f"; {decoder['dense_layers']} layer(s) with a dense FFN {decoder['dense_ffn']} instead"
                if decoder.get("dense_layers")
                else ""
            )
            if decoder["experts"] > 1
            else ""
        ),
        f"vocab {decoder['vocab']}" + (" tied" if decoder["tied_embeddings"] else ""),
        f"rotary {rotary['dim']}"
        if rotary
        else f"{decoder['positions']} learned positions"
        if decoder["positions"]
        else "no position table",
        f"{decoder['norm'] or 'no norm found'}, {decoder['qkv']} QKV"
        + (", parallel residual" if decoder["parallel_residual"] else ""),
    ]
    windows = decoder.get("layer_windows") or []
    windowed = [i for i, w in enumerate(windows) if w is not None]
    scores = [
        f"window {'/'.join(str(w) for w in dict.fromkeys(windows[i] for i in windowed))}"
        + ("" if len(windowed) == len(windows) else f" on layer(s) {', '.join(map(str, windowed))}")
    ] if windowed else []  # fmt: skip
    scores += [f"soft-cap {decoder['softcap']}"] if decoder.get("softcap") else []
    scores += ["ALiBi"] if decoder.get("alibi") else []
    scores += ["attention sinks"] if any(decoder.get("layer_sinks") or ()) else []
    return "; ".join(parts + ([", ".join(scores)] if scores else []))
