"""``tessera validate PLAN.json``: check a plan against its schema and the model it names."""

from __future__ import annotations

from pathlib import Path

import click

from tessera.cli.options import json_option, load_model_option
from tessera.cli.render import emit_json
from tessera.core.errors import InputError
from tessera.core.plans import check_plan_against_model, load_plan


@click.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False, path_type=str))
@click.option(
    "--model",
    type=click.Path(dir_okay=False, path_type=str),
    help="The model (default: the path in the plan).",
)
@json_option
def validate(plan_path: str, model: str | None, as_json: bool) -> None:
    """Check PLAN against its schema and against its model (sha256, nodes, coverage, constraints).

    Exit code 0 when valid, 2 with a one-line reason when not.
    """
    plan = load_plan(plan_path)
    model_path = model or plan.model.path
    if not Path(model_path).is_file():
        raise InputError(
            f"the model {model_path!r} the plan names does not exist (give --model)", source=plan_path
        )
    shapes = tuple(f"{k}={'x'.join(map(str, v))}" for k, v in plan.model.input_shapes.items())
    graph = load_model_option(model_path, shapes)
    problems = check_plan_against_model(plan, graph)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InputError(f"{problems[0]}{more}", source=plan_path)
    summary = {
        "valid": True,
        "plan": plan_path,
        "kind": plan.kind,
        "model": model_path,
        "sha256": graph.sha256,
    }
    if as_json:
        emit_json(summary)
    else:
        click.echo(f"{plan_path}: valid {plan.kind} plan for {model_path}")
