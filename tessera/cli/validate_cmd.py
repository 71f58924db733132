"""``tessera validate PLAN.json``: check a plan against its schema and the model it names."""

from __future__ import annotations

import click

from tessera.cli.options import check_plan_llm_config, json_option, load_plan_model, plan_model_option
from tessera.cli.render import emit_json, human_bytes
from tessera.core.errors import InputError
from tessera.core.plans import load_plan


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
    plan = load_plan(plan_path, command="validate")
    if plan.model is None:  # a cp plan made from an LLM config (--llm), not from an ONNX model
        check_plan_llm_config(plan, plan_path, must_exist=True)
        summary = {"valid": True, "plan": plan_path, "kind": plan.kind, "llm_config": plan.llm_config.path}
        if as_json:
            emit_json(summary)
        else:
            click.echo(f"{plan_path}: valid {plan.kind} plan for LLM config {plan.llm_config.path}")
        return
    graph = load_plan_model(plan, plan_path, model)
    model_path = graph.source
    summary = {
        "valid": True,
        "plan": plan_path,
        "kind": plan.kind,
        "model": model_path,
        "sha256": graph.sha256,
    }
    shared = getattr(plan, "shared_weights", [])
    if shared:
        summary["shared_weights"] = [w.model_dump() for w in shared]
    if as_json:
        emit_json(summary)
        return
    click.echo(f"{plan_path}: valid {plan.kind} plan for {model_path}")
    for w in shared:
        stages = ", ".join(map(str, w.stages))
        click.echo(
            f"  shared weight {w.name} ({human_bytes(w.bytes)}) read by stages {stages}: "
            "one copy per stage, gradients summed across them at launch"
        )
