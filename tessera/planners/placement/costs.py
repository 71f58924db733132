"""Measured costs for the placement search: Collage's ``M(P(g))`` per candidate and ``ε`` per tensor size.

:class:`CandidateCosts` measures candidates with the :class:`~tessera.backends.measure.Measurer`, once per
structure (:func:`structure_key`) and as the composite model runs them, and skips fused candidates far
slower than the best backend on each of their operators (``screen_ratio``). :class:`ContextSwitch`
measures ε (:func:`measure_switch`) at a few tensor sizes and interpolates.

References: Collage paper §4.2, Eq. 2; thesis §2.4.2. Details and measurements: docs/placement.md.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera.backends.measure import Measurement, Measurer
from tessera.backends.profile_cache import device_fingerprint
from tessera.backends.registry import BackendRegistry
from tessera.core.graph import Graph
from tessera.planners.placement.candidates import PlacementCandidate, owned_constants

log = logging.getLogger(__name__)

SWITCH_SIZES = tuple(1024 * 16**k for k in range(5))  # 1 KiB … 64 MiB
# A fused group reading more activations than this is not measured (a wide Sum or Concat with one of
# its producers fused in): each costs a session over every input, and fusing one producer of hundreds
# wins next to nothing.
MAX_FUSED_INPUTS = 64


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

    max_fused: int | None = None  # fused candidates measured at most (None: no bound at all)
    unmeasured: int = 0  # fused candidates left out by bound(): too wide, or past max_fused
    _left_out: set[PlacementCandidate] = field(default_factory=set)
    composed: bool = False  # measure onnxruntime as a placement with several backends runs it
    known: dict[tuple[str, frozenset[str]], float] = field(default_factory=dict)  # from the search memo

    def __post_init__(self) -> None:
        self._measured_as: dict[str, object] = {}
        if self.composed:
            from tessera.backends.composite import ORT_BACKENDS, ComposedOnnxRuntime

            for name in ORT_BACKENDS:
                if name in self.registry.names():
                    self._measured_as[name] = ComposedOnnxRuntime(self.registry.backend(name))
        self._index = {n: i for i, n in enumerate(self.graph.order)}
        owned = owned_constants(self.graph)
        self._owner = {c: v for v, cs in owned.items() for c in cs}

    def key(self, c: PlacementCandidate) -> tuple[object, ...]:
        if c not in self._keys:
            self._keys[c] = structure_key(self.graph, c.nodes, self._index)
        return self._keys[c]

    def measurement(self, c: PlacementCandidate) -> Measurement:
        remembered = self.known.get((c.backend, c.nodes))
        if remembered is not None:
            return Measurement(c.backend, c.nodes, "", remembered, math.nan, 0, None, True)
        k = (c.backend, self.key(c))
        if k not in self.measured:
            if self.progress is not None:
                self.progress(c.backend)
            self.measured[k] = self.measurer.measure(self._measured_on(c), self.graph, c.nodes)
        return self.measured[k]

    def _measured_on(self, c: PlacementCandidate) -> Any:
        """The backend as the composite model runs ``c``; the whole model alone runs as the backend builds it."""
        if len(c.nodes) < len(self._index) and c.backend in self._measured_as:
            return self._measured_as[c.backend]
        return self.registry.backend(c.backend)

    def answers(self, candidates: Sequence[PlacementCandidate]) -> dict[tuple[str, frozenset[str]], float]:
        """``M(P(g))`` of every candidate measured (or remembered) so far, for the search memo."""
        out = {}
        for c in candidates:
            if (c.backend, c.nodes) in self.known:
                out[(c.backend, c.nodes)] = self.known[(c.backend, c.nodes)]
            elif c in self._keys and (c.backend, self._keys[c]) in self.measured:
                out[(c.backend, c.nodes)] = self.measured[(c.backend, self._keys[c])].median_s
        return out

    def _anchors(self, c: PlacementCandidate) -> list[str]:
        return [n for n in c.nodes if n not in self._owner]

    def screen(self, candidates: Sequence[PlacementCandidate]) -> None:
        """Measure every one-operator candidate (what screening compares against)."""
        for c in candidates:
            anchors = self._anchors(c)
            if len(anchors) == 1:
                self._single[(c.backend, anchors[0])] = self.measurement(c).median_s

    def bound(self, candidates: Sequence[PlacementCandidate]) -> None:
        """Keep at most ``max_fused`` fused (several-operator) candidates to measure: those that can
        still win the most, the sum of the best one-operator times of their operators (what the
        group replaces at best), ties in candidate order. The rest cost infinity: the search stays
        bounded on wide graphs (a fan-out of 1,000 operators has 1,000 fused candidates of its
        1,000-input ``Sum``), and is the same on a warm cache as on a cold one."""
        if self.max_fused is None:
            return
        best: dict[str, float] = {}
        for (_, n), v in self._single.items():
            best[n] = min(v, best.get(n, math.inf))
        fused = [(i, c) for i, c in enumerate(candidates) if len(self._anchors(c)) > 1]
        wide = {c for _, c in fused if self._inputs(c) > MAX_FUSED_INPUTS}
        win = {c: sum(best.get(n, 0.0) for n in self._anchors(c)) for _, c in fused}
        ranked = sorted((ic for ic in fused if ic[1] not in wide), key=lambda ic: (-win[ic[1]], ic[0]))
        self._left_out = wide | {c for _, c in ranked[self.max_fused :]}
        self.unmeasured = len(self._left_out)

    def _inputs(self, c: PlacementCandidate) -> int:
        """Activations a group reads from outside (what its measurement binds on every run)."""
        made = {t for n in c.nodes for t in self.graph.op(n).outputs}
        return len(
            {
                t
                for n in c.nodes
                for t in self.graph.op(n).inputs
                if t and t not in made and t not in self.graph.initializers
            }
        )

    def __call__(self, c: PlacementCandidate) -> float:
        if c in self._left_out:
            return math.inf
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


SWITCH_WORK = 256  # the first group's MatMul is SWITCH_WORK² x SWITCH_WORK: ~0.1-0.3 ms on a CPU core


def _switch_graph(nbytes: int) -> Graph:
    """Group ``first``: a MatMul (work long enough for the other runtime's threads to fall asleep, as
    between real groups) and a Relu writing the handed-over tensor ``h`` of ``nbytes``; group
    ``second``: a Relu reading ``h``."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from tessera.core.graph import build_graph

    n, k = max(1, nbytes // 4), SWITCH_WORK
    value = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    weight = numpy_helper.from_array(np.full((k, k), 1.0 / k, dtype=np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["m"], name="work"),
        helper.make_node("Relu", ["x"], ["h"], name="first"),
        helper.make_node("Relu", ["h"], ["y"], name="second"),
    ]
    graph = helper.make_graph(
        nodes,
        "context_switch",
        [value("a", [k, k]), value("x", [n])],
        [value("m", [k, k]), value("y", [n])],
        initializer=[weight],
        value_info=[value("h", [n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return build_graph(model, label="context_switch")


def measure_switch(registry: BackendRegistry, src: str, dst: str, nbytes: int, *, seed: int = 0) -> float:
    """ε of a tensor of ``nbytes`` handed from a group on ``src`` to one on ``dst`` in a composite
    model (seconds, ≥ 0): the two groups run through the composite model, minus each group's time
    alone (called back to back, as ``M(P(g))`` is measured). See the module docstring."""
    import numpy as np

    from tessera.backends.composite import CompositeModel
    from tessera.backends.measure import time_runs

    graph = _switch_graph(nbytes)
    rng = np.random.default_rng(seed)
    feeds = {t: rng.standard_normal(graph.inputs[t].shape).astype(np.float32) for t in ("a", "x")}
    groups = [(src, ["work", "first"]), (dst, ["second"])]
    model = CompositeModel(graph, groups, registry=registry, mixed=True)
    across = time_runs(lambda: model.run(feeds), repeat=15).median_s
    env: dict[str, np.ndarray] = dict(feeds)
    alone = 0.0
    for step in model.steps:
        ins = {t: env[t] for t in step.inputs}
        alone += time_runs(lambda r=step.runnable, i=ins: r.run(i), repeat=15).median_s
        env.update(step.runnable.run(ins))
    return max(0.0, across - alone)


class ContextSwitch:
    """``ε(src, dst, bytes)``: measured at :data:`SWITCH_SIZES`, interpolated (see module docstring)."""

    def __init__(self, registry: BackendRegistry, measurer: Measurer) -> None:
        self.registry = registry
        self.measurer = measurer
        self._points: dict[tuple[str, str, int], float] = {}

    def point(self, src: str, dst: str, nbytes: int) -> float:
        key = (src, dst, nbytes)
        if key not in self._points:
            self._points[key] = self._measure(src, dst, nbytes)
        return self._points[key]

    def _measure(self, src: str, dst: str, nbytes: int) -> float:
        """Cached in the profile cache under ``<backend>+composed`` names (the runtimes as composed)."""
        a, b = self.registry.backend(src), self.registry.backend(dst)
        names = (f"{src}+composed", f"{dst}+composed")  # not Measurer.context_switch's ε
        versions = f"{a.version}|{b.version}"
        device = device_fingerprint(f"{a.device} -> {b.device}")
        cache = self.measurer.cache
        value = cache.get_switch(*names, versions, device, nbytes)
        if value is None:
            try:
                value = measure_switch(self.registry, src, dst, nbytes, seed=self.measurer.seed)
            except Exception as exc:  # noqa: BLE001 - a pair that cannot be chained is never switched
                log.warning("cannot measure the %s -> %s switch: %s", src, dst, exc)
                return 1.0
            cache.put_switch(*names, versions, device, nbytes, value)
        return value

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
