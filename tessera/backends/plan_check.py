"""Validity of a placement plan beyond its schema: every group's backend is registered and runs on
the plan's device, a reduced-precision backend has the tolerance it was placed under, and the groups
can run in some order. Registered in :data:`tessera.core.plans.PLAN_CHECKS` for kind ``placement``
when this module is imported (``tessera.backends`` imports it), so ``tessera validate`` runs it."""

from __future__ import annotations

import math
from typing import Any

import networkx as nx

from tessera.backends.base import runs_on
from tessera.backends.registry import default_registry
from tessera.core.plans import PLAN_CHECKS


def check_placement_plan(plan: Any, graph: Any) -> list[str]:
    """A covering placement that still cannot run: a group on a backend no registry knows (one
    not available on this machine is fine: the plan may be for another), or groups that feed each
    other in a cycle (no order runs them). A plan that does not cover the model's operators exactly
    once is left to the structural check, which reports that first."""
    named = [n for g in plan.groups for n in g.nodes]
    if len(named) != len(set(named)) or set(named) != set(graph.order):
        return []
    problems = _tolerance_problems(plan)
    registry = default_registry()
    known = set(registry.names())
    for g in plan.groups:
        if g.backend not in known:
            problems.append(
                f"group {g.id}: backend {g.backend!r} is not a registered backend (known: {', '.join(sorted(known))})"
            )
            continue
        problems.extend(_backend_problems(plan, g, registry))
    try:
        cycle = nx.find_cycle(graph.quotient(g.nodes for g in plan.groups))
    except nx.NetworkXNoCycle:
        cycle = []
    if cycle:
        ids = [plan.groups[i].id for i, _ in cycle]
        path = " -> ".join(map(str, ids)) + f" -> {ids[0]}"
        problems.append(f"groups feed each other in a cycle ({path}): no order runs them")
    return problems


def _tolerance_problems(plan: Any) -> list[str]:
    """``measured.tolerance`` is what place was given: absent (exact backends only) or a finite
    relative error in (0, 1], as ``--tolerance`` accepts."""
    tolerance = plan.measured.get("tolerance")
    if tolerance is None:
        return []
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float):
        return [f"measured.tolerance is {tolerance!r}: a relative output error in (0, 1] or null"]
    if not (math.isfinite(tolerance) and 0 < tolerance <= 1):
        return [f"measured.tolerance is {tolerance!r}: a relative output error in (0, 1] or null"]
    return []


def _backend_problems(plan: Any, group: Any, registry: Any) -> list[str]:
    """A backend that computes in reduced precision needs the plan's tolerance; a backend runs on
    the plan's device. A backend this machine cannot build is left alone (the plan may be for
    another machine): only what it says of itself is checked."""
    entry = registry.entry(group.backend)
    if entry.factory is None:
        return []
    try:
        backend = entry.backend()
        exact, device = backend.exact, backend.device
    except Exception:  # noqa: BLE001 - a backend that cannot be built here says nothing of itself
        return []
    problems = []
    if not exact and plan.measured.get("tolerance") is None:
        problems.append(
            f"group {group.id}: backend {group.backend!r} computes in reduced precision, and the plan has no "
            "measured.tolerance (place it with --tolerance)"
        )
    if not runs_on(device, plan.device):
        problems.append(
            f"group {group.id}: backend {group.backend!r} runs on {device}, not on the plan's device {plan.device!r}"
        )
    return problems


if check_placement_plan not in PLAN_CHECKS.setdefault("placement", []):
    PLAN_CHECKS["placement"].append(check_placement_plan)
