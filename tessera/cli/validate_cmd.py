"""``tessera validate PLAN.json``: check a plan against its schema and the model it names."""

from __future__ import annotations

import click

from tessera import api
from tessera.cli.options import json_option, plan_model_option
from tessera.cli.render import emit_json, human_bytes
from tessera.core.errors import InputError


@click.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False, path_type=str))
@plan_model_option
@json_option
def validate(plan_path: str, model: str | None, as_json: bool) -> None:
    """Check PLAN against its schema and against its model (sha256, nodes, coverage, constraints).

    Exit code 0 when valid, 2 with a one-line reason when not (with --json, also the verdict on
    stdout: valid false and every problem found).
    """
    try:
        _validate(plan_path, model, as_json)
    except InputError as exc:
        if as_json:
            problems = getattr(exc, "problems", None) or [exc.message]
            emit_json({"valid": False, "plan": plan_path, "problems": problems})
        raise


def _validate(plan_path: str, model: str | None, as_json: bool) -> None:
    result = api.validate(plan_path, model=model)
    if as_json:
        emit_json(result.to_json())
        return
    if result.llm_config is not None:
        click.echo(f"{plan_path}: valid {result.plan.kind} plan for LLM config {result.llm_config}")
        return
    click.echo(f"{plan_path}: valid {result.plan.kind} plan for {result.model}")
    for w in result.shared_weights:
        stages = ", ".join(map(str, w["stages"]))
        click.echo(
            f"  shared weight {w['name']} ({human_bytes(w['bytes'])}) read by stages {stages}: "
            "one copy per stage, gradients summed across them at launch"
        )
