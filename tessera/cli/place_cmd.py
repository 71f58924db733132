"""``tessera place MODEL``: place a model's operators on backends (Collage), write the plan, measure it.

``tessera launch placement.json`` runs the plan: :mod:`tessera.executor.placement`.
"""

from __future__ import annotations

import time
from typing import Any

import click

from tessera.cli.options import (
    FiniteFloat,
    OutputFile,
    check_outputs,
    json_option,
    model_options,
    output_option,
)
from tessera.cli.render import console, emit_json, progress_bar
from tessera.core.errors import InputError, LaunchError
from tessera.core.files import write_output
from tessera.core.graph import Graph
from tessera.core.plan_files import json_text
from tessera.core.plans import PlacementPlan, dump_plan, write_plan
from tessera.executor.placement import verify_placement, worst_output


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


@click.command()
@model_options
@click.option("--device", default="cpu", show_default=True, help="Device whose backends to place on.")
@click.option(
    "--backends",
    "backend_list",
    default=None,
    metavar="A,B,…",
    help="Backends to consider (default: every available backend of the device; see 'tessera backends').",
)
@click.option(
    "--search",
    type=click.Choice(["op", "graph"]),
    default="op",
    show_default=True,
    help="op: the op-level DP (Collage Alg. 1); graph: then the graph-level evolutionary search (§4.3).",
)
@click.option(
    "--budget",
    "budget_s",
    type=FiniteFloat(),
    default=60.0,
    show_default=True,
    help="Seconds the graph-level search may spend.",
)
@click.option(
    "--cache",
    "cache_path",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Profile cache (SQLite; default ~/.cache/tessera/profiles.sqlite).",
)
@click.option(
    "--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of inputs and search."
)
@click.option(
    "--max-states",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Explored prefixes kept per frontier in the DP.",
)
@click.option(
    "--verify", is_flag=True, help="Check the placed model's outputs against onnxruntime (exit 4 if not)."
)
@click.option(
    "--tvm-trials",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="MetaSchedule trials (in all) to tune the model's TVM kernels before the search (with tvm among "
    "the backends); records are kept under tessera's cache folder (tvm/records) and reused, so a kernel is "
    "tuned once. 0: TVM's default schedules.",
)
@click.option(
    "--tolerance",
    type=FiniteFloat(maximum=1),
    default=None,
    help="Largest relative output error allowed (max |error| / max |fp32 output|): lets reduced-precision "
    "backends (openvino-bf16, onnxruntime-int8) run groups. Default: exact fp32.",
)
@click.option(
    "--data",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Inputs to check the outputs on (.npz, one array per model input at the model's shapes), "
    "e.g. real samples for --tolerance. Default: seeded random inputs.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=FiniteFloat(maximum=86400),
    default=120.0,
    show_default=True,
    help="Seconds one whole-model run of the reference (onnxruntime) may take before place stops it.",
)
@click.option(
    "--trace",
    type=OutputFile(),
    default=None,
    help="Write the placement as a trace (Chrome trace-event JSON: open it in ui.perfetto.dev): a track "
    "per backend, each group at its measured time.",
)
@output_option
@json_option
def place(  # noqa: PLR0913
    graph: Graph,
    device: str,
    backend_list: str | None,
    search: str,
    budget_s: float,
    cache_path: str | None,
    seed: int,
    max_states: int,
    tvm_trials: int,
    verify: bool,
    tolerance: float | None,
    data: str | None,
    timeout_s: float,
    trace: str | None,
    output: str | None,
    as_json: bool,
) -> None:
    """Place MODEL's operators on the available backends, measured on this machine.

    Writes the placement plan (-o) with every group's backend, operators, pattern and measured time,
    the predicted latency, and — measured in the same run — the placed model's latency and every
    available backend's latency on the whole model. Exit codes: 0 done, 2 bad model or options (also
    a model onnxruntime cannot run: it is the reference every placement is checked against), 4 nothing
    could be measured, or --verify found different outputs.
    """
    from tessera.backends.measure import Measurer
    from tessera.backends.native_output import summary as native_summary
    from tessera.backends.profile_cache import ProfileCache
    from tessera.planners.placement import PlacementOptions, plan_placement

    backends = tuple(b.strip() for b in backend_list.split(",") if b.strip()) if backend_list else None
    if backend_list is not None and not backends:
        raise InputError("--backends names no backend")
    options = PlacementOptions(
        device=device,
        backends=backends,
        search=search,
        budget_s=budget_s,
        seed=seed,
        max_states=max_states,
        tolerance=tolerance,
        data=data,
        tvm_trials=tvm_trials,
        run_timeout_s=timeout_s,
    )
    if cache_path is not None and not cache_path.strip():
        raise InputError("--cache '' names no file")
    check_outputs({"-o": output, "--trace": trace}, {"model": graph.source, "--cache": cache_path})
    cache = ProfileCache(cache_path)
    cache.check()  # a path that cannot hold the cache fails now, before any measuring
    measurer = Measurer(cache, seed=seed)
    start = time.perf_counter()
    with progress_bar() as bar:
        task = bar.add_task("profiling", total=None)
        result = plan_placement(
            graph,
            options,
            measurer=measurer,
            progress=lambda backend: bar.update(task, advance=1, description=f"profiling {backend}"),
        )
    search_s = time.perf_counter() - start
    plan = result.plan
    verified = verify_placement(graph, plan, seed, data) if verify else None
    for line in (*measurer.failures(), *native_summary()):  # one line per backend, not one per build
        click.echo(f"tessera: warning: {line}", err=True)
    if output:
        write_plan(plan, output)
    if trace:
        from tessera.planners.placement.trace import placement_trace

        write_output(trace, json_text(placement_trace(plan, graph)))
    if as_json:
        import json

        emit_json(
            {
                "plan": json.loads(dump_plan(plan)),
                "search_s": search_s,
                "timings": result.report["timings"],
                "measured_candidates": result.report["measured_candidates"],
                "final_timings_cached": result.report["final_timings_cached"],
                "verify": verified,
                "output": output,
            }
        )
    else:
        _print_summary(plan, search_s, verified, output, result.report)
    if verified is not None and not verified["ok"]:
        raise LaunchError(f"the placed model's outputs differ from onnxruntime's: {worst_output(verified)}")


def _print_summary(
    plan: PlacementPlan,
    search_s: float,
    verified: dict[str, Any] | None,
    output: str | None,
    run: dict[str, Any],
) -> None:
    from rich.markup import escape
    from rich.table import Table

    # Paths, backend and node names are the user's text: escaped, never read as rich markup.
    out = console()
    m, s = plan.measured, plan.search
    out.print(
        escape(
            f"placed {plan.model.path} ({plan.model.num_nodes} operators) on {', '.join(s['backends'])}: "
            f"{len(plan.groups)} group(s), {s['kind']}-level search in {search_s:.1f} s "
            f"({s['candidates']} candidates, {run['measured_candidates']} measured); chosen: {s['chosen']}"
        )
    )
    table = Table(title="groups per backend")
    for col in ("backend", "groups", "operators", "measured (sum)"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    per: dict[str, list[Any]] = {}
    for g in plan.groups:
        row = per.setdefault(g.backend, [0, 0, 0.0])
        row[0] += 1
        row[1] += len(g.nodes)
        row[2] += g.measured_time_s or 0.0
    for backend, (groups, ops, t) in sorted(per.items()):
        table.add_row(escape(backend), str(groups), str(ops), _ms(t))
    out.print(table)
    singles = m["single_backend_latency_s"]
    out.print(
        escape(
            f"predicted {_ms(plan.predicted['latency_s'])}; measured {_ms(m['latency_s'])} "
            + " ".join(f"| {b} alone {_ms(t)}" for b, t in singles.items())
            + "".join(
                f" | parallel branches on {b} {_ms(t)}"
                for b, t in m.get("parallel_branches_latency_s", {}).items()
            )
        )
    )
    if m.get("best_single_backend"):
        out.print(
            escape(
                f"speed-up over the best single backend ({m['best_single_backend']}): "
                f"{m['speedup_over_best_single']:.2f}x"
            )
        )
    if m.get("tolerance") is not None and m.get("best_fp32_single_backend"):
        out.print(
            escape(
                f"under --tolerance {m['tolerance']:g}: {m['speedup_over_best_fp32']:.2f}x the best fp32 single "
                f"backend ({m['best_fp32_single_backend']}), relative error {m['error']['max_rel']:.3g}"
            )
        )
    if m.get("decision"):
        cached = " (medians read from the profile cache)" if run.get("final_timings_cached") else ""
        out.print(escape(f"{m['decision']}{cached}"))
    if verified is not None:
        out.print(
            ("outputs match onnxruntime" if verified["ok"] else "OUTPUTS DIFFER")
            + escape(f" ({worst_output(verified)})")
        )
    if output:
        out.print(escape(f"wrote {output}"))
