"""The final choice of ``place``: the searched placement against every whole-model backend, timed in
one run, and kept only when faster than the best single backend beyond :data:`NOISE_MARGIN`. The
medians are stored in the profile cache, and a run that finds every contender there reads them
instead of timing again, so repeat runs make the same choice. Narrative: docs/placement.md.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from tessera.backends.profile_cache import Profile, ProfileCache

__all__ = ["NOISE_MARGIN", "FinalChoice", "final_choice", "remembered_latencies", "whole_model_key"]

NOISE_MARGIN = 0.05
"""How much faster than the best single backend a mixed placement must measure to be kept: repeated
timings of one model on this CPU vary by a few percent (2% between inception_v2's backends)."""

_PREFIX = "final/"  # cache rows of whole-model timings, apart from the subgraph costs


@dataclass(frozen=True)
class FinalChoice:
    """Whether the placement is kept, the best single backend it was compared with, and why."""

    keep_placement: bool
    best_single: str | None
    note: str


def final_choice(
    placement_s: float, singles: Mapping[str, float], margin: float = NOISE_MARGIN
) -> FinalChoice:
    """Keep the placement only if it beats the fastest single backend (ties: by name) by ``margin``."""
    finite = {b: t for b, t in singles.items() if math.isfinite(t)}
    if not finite:
        return FinalChoice(True, None, "no single backend ran the whole model: the placement is kept")
    best = min(finite, key=lambda b: (finite[b], b))
    if math.isfinite(placement_s) and placement_s < finite[best] * (1 - margin):
        return FinalChoice(
            True,
            best,
            f"the placement measured {finite[best] / placement_s:.2f}x the speed of {best}, the fastest "
            f"single backend, beyond the {margin:.0%} noise margin: kept",
        )
    return FinalChoice(
        False,
        best,
        f"the placement ({placement_s * 1e3:.4g} ms) is not faster than {best} ({finite[best] * 1e3:.4g} ms) "
        f"beyond the {margin:.0%} noise margin: {best} runs the whole model",
    )


def whole_model_key(model_sha256: str, groups: Iterable[tuple[str, Iterable[str]]]) -> str:
    """The cache key of a whole-model contender: the model and its groups (backend, nodes)."""
    document = [model_sha256, sorted([b, sorted(nodes)] for b, nodes in groups)]
    return hashlib.sha256(json.dumps(document).encode()).hexdigest()


def remembered_latencies(
    cache: ProfileCache,
    keys: Mapping[str, str],
    versions: str,
    device: str,
    measure: Callable[[], dict[str, float]],
) -> tuple[dict[str, float], bool]:
    """``(medians, cached)``: every contender's stored median when all of ``keys`` (contender ->
    key) are in ``cache`` for these backend ``versions`` and ``device``; else ``measure()`` now,
    stored for the next run."""
    stored = {name: cache.get(_PREFIX + name, versions, device, key) for name, key in keys.items()}
    if all(p is not None for p in stored.values()):
        return {name: p.median_s for name, p in stored.items() if p is not None}, True
    measured = measure()
    for name, key in keys.items():
        if name in measured:
            cache.put(Profile(_PREFIX + name, versions, device, key, measured[name], 0.0, 1))
    return measured, False
