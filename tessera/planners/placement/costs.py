"""Measured costs for the placement search: Collage's ``M(P(g))`` per candidate and ``ε`` per tensor size.

:class:`CandidateCosts` measures each candidate with the :class:`~tessera.backends.measure.Measurer`
(SQLite-cached across runs). Within one search, candidates with the same structure — the same layer
at several places — are measured once: :func:`structure_key` is a name-free key at least as fine as
the profile cache's canonical hash, computed from the graph IR without extracting a sub-model.

Screening (on by default, ``screen_ratio``): every operator's one-operator candidates are measured
first; a multi-operator candidate of a backend that is more than ``screen_ratio`` times slower than
the best backend on *each* of its operators alone is not measured (a fused kernel does not make up
such a gap on CPU, and untuned TVM kernels take seconds to build). Set it to ``None`` to measure all.

:class:`ContextSwitch` gives ``ε(src, dst, bytes)`` (Eq. 2): measured by
:meth:`~tessera.backends.measure.Measurer.context_switch` at tensor sizes 1 KiB · 16^k up to 64 MiB and
interpolated linearly in between, so a graph's many tensor sizes cost a handful of measurements.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tessera.backends.measure import Measurement, Measurer
from tessera.backends.registry import BackendRegistry
from tessera.core.graph import Graph
from tessera.planners.placement.candidates import PlacementCandidate, owned_constants

log = logging.getLogger(__name__)

SWITCH_SIZES = tuple(1024 * 16**k for k in range(5))  # 1 KiB … 64 MiB


def structure_key(graph: Graph, nodes: frozenset[str], index: dict[str, int]) -> tuple[object, ...]:
    """A hashable, name-free description of the sub-model ``graph.extract(nodes)`` computes."""
    members = sorted(nodes, key=index.__getitem__)
    position = {n: i for i, n in enumerate(members)}
    outside: dict[str, int] = {}
    parts: list[object] = []
    for n in members:
        op = graph.op(n)
        ins: list[object] = []
        for t in op.inputs:
            info = graph.tensors.get(t) if t else None
            typ = (info.shape, info.dtype) if info is not None else None
            producer = graph.producer.get(t) if t else None
            if not t:
                ins.append(None)
            elif t in graph.initializers:
                ins.append(("w", typ))
            elif producer in position:
                ins.append(("n", position[producer], graph.op(producer).outputs.index(t)))
            else:
                ins.append(("in", outside.setdefault(t, len(outside)), typ))
        outs = []
        for t in op.outputs:
            info = graph.tensors.get(t) if t else None
            read_outside = t in graph.outputs or any(c not in nodes for c in graph.consumers.get(t, ()))
            outs.append(((info.shape, info.dtype) if info is not None else None, read_outside))
        attrs = tuple(sorted((k, repr(v)) for k, v in op.attributes.items()))
        parts.append((op.op_type, op.domain, attrs, tuple(ins), tuple(outs)))
    return tuple(parts)


@dataclass
class CandidateCosts:
    """``M(P(g))`` for the candidates of one graph (see the module docstring)."""

    graph: Graph
    registry: BackendRegistry
    measurer: Measurer
    screen_ratio: float | None = 4.0
    progress: Callable[[str], None] | None = None
    measured: dict[tuple[str, tuple[object, ...]], Measurement] = field(default_factory=dict)
    screened: int = 0
    _keys: dict[PlacementCandidate, tuple[object, ...]] = field(default_factory=dict)
    _single: dict[tuple[str, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {n: i for i, n in enumerate(self.graph.order)}
        owned = owned_constants(self.graph)
        self._owner = {c: v for v, cs in owned.items() for c in cs}

    def key(self, c: PlacementCandidate) -> tuple[object, ...]:
        if c not in self._keys:
            self._keys[c] = structure_key(self.graph, c.nodes, self._index)
        return self._keys[c]

    def measurement(self, c: PlacementCandidate) -> Measurement:
        k = (c.backend, self.key(c))
        if k not in self.measured:
            if self.progress is not None:
                self.progress(c.backend)
            self.measured[k] = self.measurer.measure(self.registry.backend(c.backend), self.graph, c.nodes)
        return self.measured[k]

    def _anchors(self, c: PlacementCandidate) -> list[str]:
        return [n for n in c.nodes if n not in self._owner]

    def screen(self, candidates: Sequence[PlacementCandidate]) -> None:
        """Measure every one-operator candidate (what screening compares against)."""
        for c in candidates:
            anchors = self._anchors(c)
            if len(anchors) == 1:
                self._single[(c.backend, anchors[0])] = self.measurement(c).median_s

    def __call__(self, c: PlacementCandidate) -> float:
        anchors = self._anchors(c)
        if self.screen_ratio is not None and len(anchors) > 1 and self._single:
            slow = True
            for n in anchors:
                mine = self._single.get((c.backend, n), math.inf)
                best = min((v for (b, m), v in self._single.items() if m == n), default=math.inf)
                if not (mine > self.screen_ratio * best):
                    slow = False
                    break
            if slow:
                self.screened += 1
                return math.inf
        return self.measurement(c).median_s


class ContextSwitch:
    """``ε(src, dst, bytes)``: measured at :data:`SWITCH_SIZES`, interpolated (see module docstring)."""

    def __init__(self, registry: BackendRegistry, measurer: Measurer) -> None:
        self.registry = registry
        self.measurer = measurer
        self._points: dict[tuple[str, str, int], float] = {}

    def point(self, src: str, dst: str, nbytes: int) -> float:
        key = (src, dst, nbytes)
        if key not in self._points:
            value = self.measurer.context_switch(
                self.registry.backend(src), self.registry.backend(dst), nbytes
            )
            self._points[key] = value if math.isfinite(value) else 1.0
        return self._points[key]

    def __call__(self, src: str, dst: str, nbytes: int) -> float:
        if src == dst:
            return 0.0
        n = min(max(nbytes, SWITCH_SIZES[0]), SWITCH_SIZES[-1])
        hi = bisect.bisect_left(SWITCH_SIZES, n)
        if SWITCH_SIZES[hi] == n:
            return self.point(src, dst, n)
        lo_n, hi_n = SWITCH_SIZES[hi - 1], SWITCH_SIZES[hi]
        lo_v, hi_v = self.point(src, dst, lo_n), self.point(src, dst, hi_n)
        return lo_v + (hi_v - lo_v) * (n - lo_n) / (hi_n - lo_n)

    def table(self) -> list[dict[str, object]]:
        """The measured points, for the plan."""
        return [
            {"src": s, "dst": d, "bytes": n, "seconds": v} for (s, d, n), v in sorted(self._points.items())
        ]
