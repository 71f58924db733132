"""Candidate subgraphs for the placement search: every pattern match and rule-generated group of the
chosen backends on one graph.

Support is asked once per backend and operator signature, not per group. A candidate absorbs the constant
operators that feed only it; a node no backend runs alone gets a one-node onnxruntime candidate with a
warning. :func:`region_candidates` adds regions (spans between narrow cuts, up to the whole model).

References: Collage paper §3, thesis §2.3 (backend pattern registry). Details: docs/placement.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from tessera.backends.patterns import find_matches, is_convex
from tessera.backends.registry import BackendEntry, BackendRegistry
from tessera.backends.rules import generate_groups
from tessera.core.graph import Graph

log = logging.getLogger(__name__)

DEFAULT_BACKEND = "onnxruntime"


@dataclass(frozen=True)
class PlacementCandidate:
    """A group of operators one backend can run as one kernel/subgraph, and what proposed it."""

    backend: str
    nodes: frozenset[str]
    via: str


def op_signature(graph: Graph, name: str) -> str:
    """What a backend's support for one operator depends on: type, attributes, operand types."""
    op = graph.op(name)

    def operand(t: str) -> list[object]:
        info = graph.tensors.get(t) if t else None
        kind = "weight" if t in graph.initializers else ("const" if _is_constant(graph, t) else "act")
        if info is None:
            return [kind, None, None]
        return [kind, list(info.shape) if info.shape is not None else None, info.dtype]

    return json.dumps(
        [
            op.op_type,
            op.domain,
            sorted((k, repr(v)) for k, v in op.attributes.items()),
            [operand(t) for t in op.inputs],
            [operand(t) for t in op.outputs],
        ],
        separators=(",", ":"),
    )


def _is_constant(graph: Graph, tensor: str) -> bool:
    producer = graph.producer.get(tensor)
    return producer is not None and producer in graph.constant_nodes


class SupportTable:
    """Per-operator support of each backend, asked once per operator signature (see module docstring)."""

    def __init__(self, registry: BackendRegistry) -> None:
        self.registry = registry
        self._answers: dict[tuple[str, str], bool] = {}

    def supports(self, backend: str, graph: Graph, node: str) -> bool:
        key = (backend, op_signature(graph, node))
        if key not in self._answers:
            try:
                self._answers[key] = bool(self.registry.backend(backend).supports(graph, [node]))
            except Exception as exc:  # noqa: BLE001 - a backend's query must not end the search
                log.debug("%s support query failed on %s: %s", backend, node, exc)
                self._answers[key] = False
        return self._answers[key]


def absorb_constants(graph: Graph, nodes: Iterable[str]) -> frozenset[str]:
    """``nodes`` plus the constant operators whose values only they read (transitively)."""
    members = set(nodes)
    changed = True
    while changed:
        changed = False
        for name in list(members):
            for pred in graph.dag.predecessors(name):
                if pred in members or pred not in graph.constant_nodes:
                    continue
                consumers = set(graph.dag.successors(pred))
                if consumers <= members and not any(t in graph.outputs for t in graph.op(pred).outputs):
                    members.add(pred)
                    changed = True
    return frozenset(members)


def owned_constants(graph: Graph) -> dict[str, frozenset[str]]:
    """For each operator, the constant operators whose values only it reads (transitively).

    An owned constant is always placed with its owner: every candidate holding the owner absorbs it
    (:func:`absorb_constants` is monotone), and no candidate holds it without the owner.
    """
    owned: dict[str, frozenset[str]] = {}
    for name in graph.order:
        extra = absorb_constants(graph, [name]) - {name}
        if extra:
            owned[name] = frozenset(extra)
    return owned


def enumerate_candidates(
    graph: Graph,
    registry: BackendRegistry,
    backends: Sequence[str],
    *,
    support: SupportTable | None = None,
    max_group_ops: int = 0,
) -> list[PlacementCandidate]:
    """Every candidate of ``backends`` on ``graph`` (deduplicated, deterministic order).

    Groups come from each backend's patterns (:func:`find_matches`) and pattern rules
    (:func:`generate_groups`), plus every operator alone; a group is kept when the backend runs each
    of its operators and it is convex after absorbing its owned constants (:func:`owned_constants`).
    ``max_group_ops`` (0: no cap) bounds a group's size on top of the rules' own caps. An operator no
    backend runs alone gets a fallback candidate on onnxruntime (logged), so every node is coverable.
    """
    support = support or SupportTable(registry)
    owned = owned_constants(graph)
    owner = {c: v for v, cs in owned.items() for c in cs}
    seen: set[tuple[str, frozenset[str]]] = set()
    out: list[PlacementCandidate] = []

    def admissible(nodes: frozenset[str]) -> bool:
        return all(owner.get(n, n) in nodes for n in nodes)

    def add(backend: str, nodes: frozenset[str], via: str) -> None:
        nodes = absorb_constants(graph, nodes)
        if (backend, nodes) in seen:
            return
        seen.add((backend, nodes))
        if max_group_ops and len(nodes) > max_group_ops:
            return
        if not admissible(nodes) or not all(support.supports(backend, graph, n) for n in nodes):
            return
        if len(nodes) > 1 and not is_convex(graph, nodes):
            return
        out.append(PlacementCandidate(backend, nodes, via))

    for name in backends:
        for nodes, via in _proposed(graph, registry.entry(name), owner):
            add(name, nodes, via)

    out += _fallbacks(graph, support, backends, owned, owner, {c.nodes for c in out})
    singles = {frozenset([n]) | owned.get(n, frozenset()) for n in graph.order if n not in owner}
    covered = {c.nodes for c in out}
    assert all(s in covered for s in singles)
    return out


def _proposed(
    graph: Graph, entry: BackendEntry, owner: dict[str, str]
) -> Iterator[tuple[frozenset[str], str]]:
    """The groups a backend's registry ``entry`` proposes, and how: its patterns' matches, its rules'
    groups, then every operator alone (with what it owns), whatever the rules propose."""
    for named in entry.patterns:
        for nodes in find_matches(graph, named.pattern):
            yield nodes, f"pattern:{named.name}"
    for rule in entry.rules:
        for group in generate_groups(graph, rule):
            yield group.nodes, f"rule:{rule.name}"
    for node in graph.order:
        if node not in owner:
            yield frozenset([node]), "single-op"


def _fallbacks(
    graph: Graph,
    support: SupportTable,
    backends: Sequence[str],
    owned: dict[str, frozenset[str]],
    owner: dict[str, str],
    have: set[frozenset[str]],
) -> list[PlacementCandidate]:
    """A candidate on the default backend for each operator no candidate in ``have`` runs alone
    (with what it owns), each logged with why no backend took it."""
    out = []
    for node in graph.order:
        alone = frozenset([node]) | owned.get(node, frozenset())
        if node in owner or alone in have:
            continue
        op = graph.op(node)
        said = "; ".join(_why_not(support, b, graph, alone) for b in backends) or "no backend chosen"
        log.warning(
            "no backend runs node %r (%s) on its own (%s); placing it on %s, the default backend",
            node,
            op.op_type,
            said,
            DEFAULT_BACKEND,
        )
        out.append(PlacementCandidate(DEFAULT_BACKEND, alone, f"fallback:{DEFAULT_BACKEND}"))
    return out


def _why_not(support: SupportTable, backend: str, graph: Graph, nodes: frozenset[str]) -> str:
    entry = support.registry.entry(backend)
    ok, reason = entry.backend().available() if entry.factory is not None else (False, "not loaded")
    if not ok:
        return f"{backend}: unavailable ({reason})"
    rejected = [n for n in sorted(nodes) if not support.supports(backend, graph, n)]
    if not rejected:
        return f"{backend}: no candidate proposed"
    ops = ", ".join(sorted({graph.op(n).op_type for n in rejected}))
    return f"{backend}: does not run {ops} on its own"


def narrow_cuts(graph: Graph, order: Sequence[str], max_cuts: int) -> list[int]:
    """Up to ``max_cuts`` positions of ``order`` (a topological order) where the fewest activations
    cross the cut, spread evenly over the model. A cut never separates a constant from its owner."""
    owned = owned_constants(graph)
    owner = {c: v for v, cs in owned.items() for c in cs}
    position = {n: i for i, n in enumerate(order)}
    last_read: dict[str, int] = {}
    for n in order:
        for t in graph.op(n).outputs:
            readers = graph.consumers.get(t, ())
            if t and readers and n not in graph.constant_nodes:
                last_read[t] = max(position[r] for r in readers)
    # live[p]: activations produced before position p and read at or after it.
    opened = [0] * (len(order) + 1)
    for t, last in last_read.items():
        first = position[graph.producer[t]] + 1
        if first <= last:
            opened[first] += 1
            opened[last + 1] -= 1
    live, running = [], 0
    for p in range(len(order)):
        running += opened[p]
        live.append(running)
    valid = [p for p in range(1, len(order)) if order[p - 1] not in owner and live[p] > 0]
    if not valid or max_cuts <= 0:
        return []
    narrowest = min(live[p] for p in valid)
    narrow = [p for p in valid if live[p] == narrowest]
    chosen: list[int] = []
    for k in range(1, max_cuts + 1):
        target = k * len(order) / (max_cuts + 1)
        best = min((p for p in narrow if p not in chosen), key=lambda p: (abs(p - target), p), default=None)
        if best is not None:
            chosen.append(best)
    return sorted(chosen)


def region_candidates(
    graph: Graph,
    backends: Sequence[str],
    order: Sequence[str],
    *,
    support: SupportTable,
    max_cuts: int = 6,
) -> list[PlacementCandidate]:
    """Every span of ``order`` between two of :func:`narrow_cuts` (and the model's ends) as a
    candidate of each backend that runs all its operators (see the module docstring).

    A span of a topological order is convex, so every region is a valid group.
    """
    bounds = [0, *narrow_cuts(graph, order, max_cuts), len(order)]
    out: list[PlacementCandidate] = []
    for backend in backends:
        runs = [support.supports(backend, graph, n) for n in order]
        for i, lo in enumerate(bounds):
            for hi in bounds[i + 1 :]:
                if hi - lo > 1 and all(runs[lo:hi]):
                    nodes = frozenset(order[lo:hi])
                    via = "region:whole-model" if (lo, hi) == (0, len(order)) else f"region:{lo}-{hi}"
                    out.append(PlacementCandidate(backend, nodes, via))
    return out
