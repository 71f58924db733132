"""``place --trace``: a placement's groups as trace-event tracks, one per backend, each group a
slice of its measured time. Groups run in the plan's order; in a concurrent plan (parallel
branches) a group starts once the groups it reads from have ended. Layout: docs/traces.md."""

from __future__ import annotations

from typing import Any

from tessera.core.graph import Graph
from tessera.core.plans import PlacementPlan
from tessera.core.trace import COMPUTE, Trace

__all__ = ["placement_trace"]


def placement_trace(plan: PlacementPlan, graph: Graph) -> dict[str, Any]:
    """The trace-event document of ``plan`` (its groups' measured times on ``graph``'s dataflow)."""
    group_of = {n: g.id for g in plan.groups for n in g.nodes}
    needs: dict[int, set[int]] = {g.id: set() for g in plan.groups}
    for u, v in graph.dag.edges():
        a, b = group_of.get(u), group_of.get(v)
        if a is not None and b is not None and a != b:
            needs[b].add(a)
    backends = sorted({g.backend for g in plan.groups})
    trace = Trace()
    for pid, backend in enumerate(backends):
        trace.track(pid, backend)
    ends: dict[int, float] = {}
    clock = 0.0
    for g in plan.groups:
        ready = max((ends.get(p, 0.0) for p in needs[g.id]), default=0.0)
        start = ready if plan.concurrent else clock
        ends[g.id] = start + (g.measured_time_s or 0.0)
        clock = max(clock, ends[g.id])
        trace.span(
            backends.index(g.backend), COMPUTE, f"group {g.id}: {g.pattern}", start, ends[g.id],
            cat="measured", args={"operators": len(g.nodes), "first": g.nodes[0], "last": g.nodes[-1]},
        )  # fmt: skip
    return trace.to_json(
        what="tessera place: the placement's groups, each at its measured time",
        model=plan.model.path if plan.model is not None else None,
        latency_s=plan.predicted.get("latency_s"),
    )
