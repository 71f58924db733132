"""``launch --trace``: what each stage worker did when, and the trace-event file made of it.

A rank's :class:`Timeline` keeps its spans (waiting for inputs, a forward or backward, posting a
send, waiting for a receive, the all-reduce, the optimizer step) on the host's wall clock, with
the key of each message so that a send and its receive become one arrow. :func:`run_trace` puts
every rank's spans on a track of its own and, beside each, the plan's simulated iteration at the
start of every measured step. Layout: docs/traces.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from tessera.core.plans import GppPlan
from tessera.core.specs import ClusterSpec
from tessera.core.trace import COMPUTE, Trace
from tessera.planners.pipeline.trace import add_schedule, simulate_plan

__all__ = ["ALLREDUCE", "COMPUTE", "WAIT", "Timeline", "run_trace"]

WAIT = "waiting for inputs"  # the streams a worker adds to the plan trace's
ALLREDUCE = "all-reduce"


class Timeline:
    """One rank's spans: ``(step, stream, name, start, end, key)``, times in seconds of the wall
    clock (taken once, then advanced by the monotonic ``perf_counter`` the worker times with)."""

    def __init__(self) -> None:
        self._wall, self._pc = time.time(), time.perf_counter()
        self.spans: list[tuple[int, str, str, float, float, tuple[int, ...] | None]] = []

    def add(
        self, step: int, stream: str, name: str, start: float, end: float, key: tuple[int, ...] | None = None
    ) -> None:
        """A span between two ``perf_counter`` readings (``key``: a message's ``(step, backward,
        micro-batch, sender rank, receiver rank)``, on its send and on its receive)."""
        self.spans.append(
            (step, stream, name, self._wall + start - self._pc, self._wall + end - self._pc, key)
        )


def run_trace(
    plan: GppPlan, ranks: Sequence[Mapping[str, Any]], floating: Mapping[str, bool] | None = None
) -> dict[str, Any]:
    """The trace-event document of a run: ``ranks``' results (each with ``rank``, ``stage``,
    ``device`` and ``timeline``); rank ``r``'s measured track is process ``2r``, the plan's
    prediction for its stage process ``2r + 1``, the prediction restarted at each step's start."""
    spans = {r["rank"]: r["timeline"] for r in ranks}
    origin = min((s[3] for rank in spans.values() for s in rank), default=0.0)
    trace = Trace()
    predicted: dict[str, int] = {}
    for r in sorted(ranks, key=lambda r: r["rank"]):
        label = f"rank {r['rank']}: {r['device']} (stage {r['stage']})"
        trace.track(2 * r["rank"], f"{label} measured")
        trace.track(2 * r["rank"] + 1, f"{label} predicted")
        predicted[r["device"]] = 2 * r["rank"] + 1
    sends: dict[tuple[int, ...], tuple[int, str, float]] = {}
    for rank, rows in spans.items():
        for step, stream, name, start, end, key in rows:
            trace.span(
                2 * rank, stream, name, start - origin, end - origin, cat="measured", args={"step": step}
            )
            if key is not None and stream.startswith("send"):
                sends[key] = (2 * rank, stream, start - origin)
    for rank, rows in spans.items():
        for _, stream, name, start, _end, key in rows:
            if key is not None and stream.startswith("receive") and key in sends:
                trace.flow(name, sends[key], (2 * rank, stream, start - origin), cat="measured")
    if plan.cluster:
        cluster = ClusterSpec.from_json_dict(plan.cluster)
        sim = simulate_plan(plan, cluster, (lambda t: floating.get(t, True)) if floating else lambda t: True)
        stages = [(st.id, [d for d in st.devices if d in predicted]) for st in plan.stages]
        for step in sorted({s[0] for rows in spans.values() for s in rows}):
            start = min(s[3] for rows in spans.values() for s in rows if s[0] == step)
            add_schedule(trace, sim, stages, predicted, offset=start - origin, cat="predicted")
    return trace.to_json(
        what=f"tessera launch of a {plan.kind} plan: measured spans of every rank, the plan's simulated "
        "iteration beside them from the start of each step",
        model=plan.model.path if plan.model is not None else None,
        predicted_iteration_time_s=plan.predicted.get("iteration_time_s"),
    )
