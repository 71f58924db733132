"""``tessera plan [MODEL] --kind KIND …``: make a plan of one kind.

Each kind (:data:`KINDS`) is a module of this package with its option group and the function that
loads inputs, calls the planner and prints; the command checks that no option of another kind was
given and calls it. Examples are in the README.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from tessera.cli.options import json_option, output_option
from tessera.cli.plan import cp, pipeline

__all__ = ["KINDS", "PlanKind", "plan"]


@dataclass(frozen=True)
class PlanKind:
    """A plan kind: the function that makes and prints it, and the kind-specific options it reads."""

    run: Callable[..., None]
    options: frozenset[str]


EXPORTS = {"megatron": ("gpp", "spp"), "vllm": ("cp",), "sglang": ("cp",), "trtllm": ("cp",)}  # -> kinds

KINDS: dict[str, PlanKind] = {
    "cp": PlanKind(cp.run, cp.OPTIONS.names | {"profile", "cache_path"}),
    "gpp": PlanKind(pipeline.runner("gpp"), pipeline.OPTIONS.names),
    "spp": PlanKind(pipeline.runner("spp"), pipeline.OPTIONS.names - {"no_baseline"}),  # spp is the baseline
}


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
@click.option(
    "--export",
    type=click.Choice(sorted(EXPORTS)),
    default=None,
    help="Also give the plan in another engine's terms, checked against that engine's constraints: "
    "[gpp/spp] megatron (Megatron-LM's --pipeline-model-parallel-layout and flags, chain plans of a decoder, "
    "stored in the plan's exports); [cp] vllm, sglang, trtllm (every cp plan's serving block holds all three). "
    "Exit 2, after -o is written, when the engine cannot run the plan, with the reason.",
)
@output_option
@json_option
@cp.OPTIONS
@pipeline.OPTIONS
def plan(
    model: str | None,
    kind: str,
    cluster: str,
    input_shapes: tuple[str, ...],
    export: str | None,
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
            if defaulted and foreign[0] in cp.OPTIONS.names
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
    if export is not None and kind not in EXPORTS[export]:
        raise click.UsageError(
            f"--export {export} applies to --kind {' or '.join(EXPORTS[export])}, not {kind}"
        )
    spec.run(
        model=model,
        export=export,
        input_shapes=input_shapes,
        cluster=cluster,
        output=output,
        as_json=as_json,
        **{name: value for name, value in options.items() if name in spec.options},
    )
