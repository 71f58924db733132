"""The warnings ``tessera launch`` gives before a run whose prediction the plan does not hold: a
profiled training plan timed with another optimizer, loss, precision or clipping, a decoding plan
predicted for another decode step."""

from __future__ import annotations

import click

from tessera.core.plans import CpPlan, GppPlan

__all__ = ["warn_if_stepped_otherwise", "warn_if_timed_otherwise"]


def warn_if_timed_otherwise(
    plan: GppPlan, plan_path: str, optimizer: str, loss: str, precision: str, max_grad_norm: float | None
) -> None:
    """A profiled plan's stages were timed with its optimizer's step and its loss, in fp32: say so
    when this run trains with others, whose times the prediction does not hold."""
    if precision != "fp32":
        click.echo(
            f"tessera: warning: {plan_path}: the plan's stages were timed in fp32, this run computes its "
            f"products in {precision}: the prediction is fp32's",
            err=True,
        )
    for what, planned, given in (
        ("optimizer", plan.training.optimizer, optimizer),
        ("loss", plan.training.loss, loss),
    ):
        if planned != given:
            click.echo(
                f"tessera: warning: {plan_path}: the plan's stages were timed with {what} {planned}, this run "
                f"trains with {given}: plan with --{what} {given} for a prediction of it",
                err=True,
            )
    if (plan.training.max_grad_norm is None) != (max_grad_norm is None):
        planned, given = ("without", "with") if max_grad_norm is not None else ("with", "without")
        click.echo(
            f"tessera: warning: {plan_path}: the plan was timed {planned} gradient clipping, this run trains "
            f"{given} it: plan {given} --max-grad-norm for a prediction of it",
            err=True,
        )


def warn_if_stepped_otherwise(plan: CpPlan, plan_path: str, compiled: bool) -> None:
    """A cp plan predicts the traced decode step, or with ``plan --compile`` the compiled one: say so
    when this run steps the other way."""
    planned = bool((plan.predicted.get("cost_model") or {}).get("compiled"))
    if planned != compiled:
        given = "with" if compiled else "without"
        click.echo(
            f"tessera: warning: {plan_path}: the plan predicts the decode step "
            f"{'compiled' if planned else 'traced, not compiled'}, this run steps it {given} --compile: "
            f"plan {given} --compile for a prediction of it",
            err=True,
        )
