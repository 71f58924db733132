"""``tessera validate PLAN.json``: check a plan against its schema and the model it names."""

from __future__ import annotations

import click

from tessera.cli.options import json_option, load_model_option, plan_model_option, plan_model_path
from tessera.cli.render import emit_json
from tessera.core.errors import InputError
from tessera.core.plans import CpPlan, check_plan_against_model, load_plan
from tessera.planners.gpp import checks as _gpp_checks  # noqa: F401 - registers C1–C5 + memory checks


@click.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False, path_type=str))
@plan_model_option
@json_option
def validate(plan_path: str, model: str | None, as_json: bool) -> None:
    """Check PLAN against its schema and against its model (sha256, nodes, coverage, constraints).

    Exit code 0 when valid, 2 with a one-line reason when not.
    """
    plan = load_plan(plan_path)
    if plan.model is None:  # a cp plan made from an LLM config (--llm), not from an ONNX model
        _check_llm_source(plan, plan_path)
        summary = {"valid": True, "plan": plan_path, "kind": plan.kind, "llm_config": plan.llm_config.path}
        if as_json:
            emit_json(summary)
        else:
            click.echo(f"{plan_path}: valid {plan.kind} plan for LLM config {plan.llm_config.path}")
        return
    model_path = plan_model_path(plan_path, plan.model.path, model)
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


def _check_llm_source(plan: CpPlan, plan_path: str) -> None:
    """The LLM config a plan names must still exist and be unchanged (sha256)."""
    from tessera.planners.cp.llm import load_llm_config

    ref = plan.llm_config
    assert ref is not None
    try:
        _, source = load_llm_config(ref.path)
    except InputError as exc:
        raise InputError(
            f"the LLM config the plan names is unusable: {exc.one_line()}", source=plan_path
        ) from None
    if source.sha256 != ref.sha256:
        raise InputError(
            f"LLM config changed: the plan was made for sha256 {ref.sha256[:12]}…, {ref.path} is {source.sha256[:12]}…",
            source=plan_path,
        )
