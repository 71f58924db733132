"""What ``tessera launch`` reports for a plan of any kind: measured against predicted.

:class:`RunReport` holds the pieces every kind shares — ``measured``, ``predicted``, their
``ratio`` (:func:`over`: measured / predicted), one row per step and one per rank — and each kind
adds its own keys (:meth:`RunReport.details`). One warm-up rule for every kind: measured means
leave out the first :data:`WARM_UP_STEPS` steps (:func:`counted_steps`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

WARM_UP_STEPS = 1
"""Steps a measured mean leaves out when there are more: the first pays for warm-up (the allocator,
first-touch pages, gloo's lazily made buffers)."""

T = TypeVar("T")


def counted_steps(steps: Sequence[T]) -> Sequence[T]:
    """The steps a measured mean counts: all but the first :data:`WARM_UP_STEPS`, or every step
    when that would leave none."""
    kept = steps[WARM_UP_STEPS:]
    return kept if len(kept) else steps


def steady_mean(values: Sequence[float]) -> float:
    """The mean of per-step ``values`` over the counted steps (:func:`counted_steps`)."""
    return float(np.mean(counted_steps(values)))


def over(measured: float | None, predicted: float | None) -> float | None:
    """``measured / predicted``; None where the plan predicts nothing (or zero)."""
    if measured is None or not predicted:
        return None
    return measured / predicted


def ratios(
    measured: Mapping[str, Any], predicted: Mapping[str, Any], names: Mapping[str, str]
) -> dict[str, float | None]:
    """``{ratio name: measured / predicted}`` of the metric each name stands for (``names``: ratio
    name → metric key); every name is present, None where the plan predicts nothing."""
    return {name: over(measured.get(key), predicted.get(key)) for name, key in names.items()}


def gathered(results: Mapping[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's result from :func:`~tessera.executor.launcher.launch_workers`' results: rank 0
    gathers them all (under ``all``); on another node of a multi-node launch only its own ranks'."""
    mine = results.get(0) or next(iter(results.values()))
    return mine.get("all") or list(results.values())


def slowest(per_rank: Iterable[dict[str, Any]], step: int, key: str) -> float:
    """A step's ``key`` on the slowest of ``per_rank`` (ranks advance in lockstep: the step ends
    when the last one is done)."""
    return max(r["steps"][step][key] for r in per_rank)


@dataclass(kw_only=True)
class RunReport:
    """Measured against predicted for one launch; ``to_json`` is the ``tessera launch --json``
    output. Subclasses add their kind's fields and :meth:`details`."""

    plan_path: str
    kind: str
    measured: dict[str, Any]
    predicted: dict[str, Any]
    ratio: dict[str, float | None]
    steps: list[dict[str, Any]] = field(default_factory=list)  # one row per step
    ranks: list[dict[str, Any]] = field(default_factory=list)  # one row per rank

    @property
    def failure(self) -> str | None:
        """Why the launch failed though it ran to the end (exit 4 after the report); None if not."""
        return None

    def details(self) -> dict[str, Any]:
        """The kind's own keys of the JSON report."""
        return {}

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan_path,
            "kind": self.kind,
            **self.details(),
            "steps": self.steps,
            "ranks": self.ranks,
            "measured": self.measured,
            "predicted": self.predicted,
            "ratio": self.ratio,
        }
