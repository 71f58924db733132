"""Validity of a placement plan beyond its schema: every group's backend is registered and the groups
can run in some order. Registered in :data:`tessera.core.plans.PLAN_CHECKS` for kind ``placement``
when this module is imported (``tessera.backends`` imports it), so ``tessera validate`` runs it."""

from __future__ import annotations

from typing import Any

import networkx as nx

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
    problems = []
    known = set(default_registry().names())
    for g in plan.groups:
        if g.backend not in known:
            problems.append(
                f"group {g.id}: backend {g.backend!r} is not a registered backend (known: {', '.join(sorted(known))})"
            )
    try:
        cycle = nx.find_cycle(graph.quotient(g.nodes for g in plan.groups))
    except nx.NetworkXNoCycle:
        cycle = []
    if cycle:
        ids = [plan.groups[i].id for i, _ in cycle]
        path = " -> ".join(map(str, ids)) + f" -> {ids[0]}"
        problems.append(f"groups feed each other in a cycle ({path}): no order runs them")
    return problems


if check_placement_plan not in PLAN_CHECKS.setdefault("placement", []):
    PLAN_CHECKS["placement"].append(check_placement_plan)
