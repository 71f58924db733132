"""Collage's op-level placement optimizer: the dynamic program of Algorithm 1.

A state is an explored prefix (placed operators) with the backends of its open producers; at its
frontier every applicable candidate ``g`` extends it at Eq. 3's cost
``C_opt(s ∪ g) = min(C_opt(s ∪ g), C_opt(s) + M(P(g)) + ε)``, exact for size-dependent, backend-pair ε.
``max_states`` (default 128) keeps the cheapest prefixes per frontier: ``O(N · max_states · P)``.

References: Collage paper §4.2, Alg. 1, Eq. 3; thesis §2.4.2. Details: docs/placement.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tessera.core.graph import Graph
from tessera.planners.placement.candidates import PlacementCandidate, owned_constants

log = logging.getLogger(__name__)

# Costs above this stand for "cannot run" (a failed build is measured as inf).
UNUSABLE_S = 1e3


@dataclass(frozen=True)
class PlacedGroup:
    """A group of the chosen placement with its measured cost ``M(P(g))`` and the ε charged before it."""

    candidate: PlacementCandidate
    cost_s: float
    epsilon_s: float


@dataclass
class OpLevelResult:
    """The DP's placement (groups in execution order) and its predicted latency (Eq. 3)."""

    groups: list[PlacedGroup]
    predicted_s: float
    epsilon_s: float
    states: int  # explored prefixes
    candidates: int
    notes: list[str] = field(default_factory=list)


def frontier_order(graph: Graph) -> list[str]:
    """Operators by depth (longest path from a graph input over non-constant operators), ties in model
    order; each constant operator comes right before the first operator that reads it, the constants
    an operator owns (:func:`owned_constants`) right before it. A topological order."""
    owned = owned_constants(graph)
    owner = {c: v for v, cs in owned.items() for c in cs}
    index = {n: i for i, n in enumerate(graph.order)}
    depth: dict[str, int] = {}
    for n in graph.order:
        preds = [p for p in graph.dag.predecessors(n) if p not in graph.constant_nodes]
        depth[n] = 1 + max((depth[p] for p in preds), default=-1)
    order: list[str] = []
    done: set[str] = set()

    def emit(node: str) -> None:
        for c in sorted(owned.get(node, ()), key=index.__getitem__):
            if c not in done:
                done.add(c)
                order.append(c)
        done.add(node)
        order.append(node)

    import networkx as nx

    for n in sorted(
        (n for n in graph.order if n not in graph.constant_nodes), key=lambda n: (depth[n], index[n])
    ):
        ancestors = nx.ancestors(graph.dag, n)
        shared = [a for a in ancestors if a in graph.constant_nodes and a not in owner and a not in done]
        for c in sorted(shared, key=index.__getitem__):
            emit(c)
        emit(n)
    for n in graph.order:
        if n not in done and n not in owner:
            emit(n)
    return order


@dataclass
class _Cand:
    candidate: PlacementCandidate
    mask: int
    outside_preds: int
    inputs: tuple[tuple[str, int], ...]  # (producer, bytes) of activations read from outside
    cost_s: float
    producers: tuple[str, ...] = ()  # operators outside the group it reads from (they may close)


class NoCompletePlacement(Exception):  # noqa: N818
    """Some operator has no candidate that builds and runs (every one measured as failing)."""


def op_level_placement(  # noqa: C901
    graph: Graph,
    candidates: Sequence[PlacementCandidate],
    cost: Callable[[PlacementCandidate], float],
    epsilon: Callable[[str, str, int], float],
    *,
    max_states: int = 128,
) -> OpLevelResult:
    """Algorithm 1 over ``candidates`` with measured ``cost`` and context-switch ``epsilon(src, dst, bytes)``.

    Returns groups covering every operator exactly once, each convex, in an executable order.
    ``cost`` is asked once per candidate, when its root becomes a frontier (measure lazily).
    """
    order = frontier_order(graph)
    rank = {n: i for i, n in enumerate(order)}
    full = (1 << len(order)) - 1
    succ_mask = {n: _mask(rank, graph.dag.successors(n)) for n in order}

    by_root: dict[int, list[PlacementCandidate]] = {}
    for c in candidates:
        by_root.setdefault(min(rank[n] for n in c.nodes), []).append(c)
    prepared: dict[int, list[_Cand]] = {}

    def prepare(root: int) -> list[_Cand]:
        if root not in prepared:
            out = []
            for c in by_root.get(root, ()):
                m = cost(c)
                if not math.isfinite(m) or m >= UNUSABLE_S:
                    if not c.via.startswith("fallback:"):
                        continue
                    m = UNUSABLE_S  # the only way to cover the node: keep it, at a prohibitive cost
                out.append(_prepare(graph, c, rank, m))
            prepared[root] = out
        return prepared[root]

    # A state is an explored prefix with the backends of its open producers (placed operators with an
    # unplaced reader): ε of every later group depends on nothing else, so the recurrence is exact.
    # state key -> (cost, ε so far, previous key, candidate, open producers -> backend). The open
    # producers enter the key as a 64-bit sum of a mix of each (producer, backend), kept up to date as
    # producers open and close: a fan-out keeps hundreds open, and a sorted tuple of them per
    # transition made the search quadratic (a 1,000-operator fan-out: a minute).
    Key = tuple[int, int]
    start: Key = (0, 0)
    backend_code: dict[str, int] = {}

    def item(producer: str, backend: str) -> int:
        code = backend_code.setdefault(backend, len(backend_code))
        return _mix(rank[producer] * 1024 + code)

    states: dict[Key, tuple[float, float, Key | None, _Cand | None, dict[str, str]]] = {
        start: (0.0, 0.0, None, None, {})
    }
    buckets: dict[int, list[Key]] = {0: [start]}
    best_full: Key | None = None
    explored = 0
    for frontier in range(len(order)):
        keys = buckets.pop(frontier, None)
        if not keys:
            continue
        keys.sort(key=lambda k: (states[k][0], k))
        for dropped in keys[max_states:]:
            states.pop(dropped, None)
        for key in keys[:max_states]:
            explored += 1
            mask = key[0]
            c_s, eps_s, _, _, open_ = states[key]
            for cand in prepare(frontier):
                if cand.mask & mask or cand.outside_preds & ~mask:
                    continue
                eps = 0.0
                for producer, nbytes in cand.inputs:
                    src = open_.get(producer)
                    if src is not None and src != cand.candidate.backend:
                        eps += min(epsilon(src, cand.candidate.backend, nbytes), UNUSABLE_S)
                new_mask = mask | cand.mask
                new_cost = c_s + cand.cost_s + eps
                new_open, code = dict(open_), key[1]
                for producer in cand.producers:  # only the group's producers can close
                    if producer in new_open and not succ_mask[producer] & ~new_mask:
                        code = (code - item(producer, new_open.pop(producer))) & _BITS
                for n in cand.candidate.nodes:
                    if succ_mask[n] & ~new_mask:
                        new_open[n] = cand.candidate.backend
                        code = (code + item(n, cand.candidate.backend)) & _BITS
                new_key: Key = (new_mask, code)
                old = states.get(new_key)
                if old is not None and old[0] <= new_cost:
                    continue
                if old is None:
                    if new_mask == full:
                        best_full = new_key
                    else:
                        buckets.setdefault(_lowest_unset(new_mask), []).append(new_key)
                states[new_key] = (new_cost, eps_s + eps, key, cand, new_open)
    if best_full is None:  # an operator every candidate of which failed to build or run
        raise NoCompletePlacement("no candidate of some operator could be built and run")
    groups: list[PlacedGroup] = []
    total, eps_total = states[best_full][0], states[best_full][1]
    walk: Key | None = best_full
    while walk is not None and walk != start:
        _, eps_here, prev, cand, _ = states[walk]
        assert cand is not None and prev is not None
        groups.append(PlacedGroup(cand.candidate, cand.cost_s, eps_here - states[prev][1]))
        walk = prev
    groups.reverse()
    return OpLevelResult(groups, total, eps_total, explored, len(candidates))


def _prepare(graph: Graph, c: PlacementCandidate, rank: dict[str, int], cost_s: float) -> _Cand:
    members = c.nodes
    outside = 0
    inputs: dict[str, tuple[str, int]] = {}
    for n in members:
        for p in graph.dag.predecessors(n):
            if p not in members:
                outside |= 1 << rank[p]
        for t in graph.op(n).inputs:
            if not t or t in graph.initializers or t in inputs:
                continue
            producer = graph.producer.get(t)
            if producer is not None and producer not in members:
                info = graph.tensors.get(t)
                inputs[t] = (producer, info.nbytes if info is not None else 0)
    producers = tuple(sorted({p for n in members for p in graph.dag.predecessors(n) if p not in members}))
    return _Cand(
        c, _mask(rank, members), outside, tuple(inputs[t] for t in sorted(inputs)), cost_s, producers
    )


def _mask(rank: dict[str, int], nodes: object) -> int:
    m = 0
    for n in nodes:  # type: ignore[attr-defined]
        m |= 1 << rank[n]
    return m


_BITS = 2**64 - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a deterministic 64-bit spread of ``x`` (Python's str hash is salted
    per process; plans must not depend on it)."""
    x = (x + 0x9E3779B97F4A7C15) & _BITS
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _BITS
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _BITS
    return x ^ (x >> 31)


def _lowest_unset(mask: int) -> int:
    return (~mask & (mask + 1)).bit_length() - 1
