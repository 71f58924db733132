"""A multi-branch model cut at its parallel branches, for running them concurrently.

The operators every path from the inputs to the outputs passes through (the dominators of a virtual
sink) are the model's series spine; between two consecutive spine operators, the weakly connected
pieces of what is left run in parallel. A segment whose two largest pieces each hold at least
``min_share`` of the model's FLOPs is cut: each of its pieces becomes a group; the operators
between such segments form the sequential groups around them. Constant operators go with the first
operator that reads them. Details: docs/placement.md ("Parallel branches").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx

from tessera.backends.base import cpu_cores
from tessera.backends.composite import CompositeModel
from tessera.backends.registry import BackendRegistry
from tessera.core.graph import Graph

SOURCE, SINK = ("<source>",), ("<sink>",)


def branch_groups(graph: Graph, *, min_share: float = 0.05) -> list[frozenset[str]] | None:
    """The groups (in topological order of their first operator) of ``graph`` cut at its parallel
    branches, or None when no segment has two branches of ``min_share`` of the FLOPs each."""
    work = [n for n in graph.order if n not in graph.constant_nodes]
    dag = nx.DiGraph(graph.dag.subgraph(work))
    dag.add_edges_from((SOURCE, n) for n in work if dag.in_degree(n) == 0)
    dag.add_edges_from((n, SINK) for n in work if dag.out_degree(n) == 0)
    if not work:
        return None
    dominators = nx.immediate_dominators(dag.reverse(copy=False), SINK)  # post-dominators
    spine, node = [], dominators[SOURCE]
    while node != SINK:
        spine.append(node)
        node = dominators[node]
    index = {n: i for i, n in enumerate(spine)}
    rest = dag.subgraph(n for n in work if n not in index)
    segments: dict[int, list[frozenset[str]]] = {}
    for piece in nx.weakly_connected_components(rest):
        ancestors = [index[p] for n in piece for p in dag.predecessors(n) if p in index]
        segments.setdefault(max(ancestors, default=-1), []).append(frozenset(piece))
    total = max(1, graph.total_flops)
    cut = {
        at: pieces
        for at, pieces in segments.items()
        if len(pieces) > 1
        and sorted((sum(graph.op(n).flops for n in p) for p in pieces), reverse=True)[1] >= min_share * total
    }
    if not cut:
        return None
    return _groups(graph, spine, index, segments, cut)


def _groups(
    graph: Graph,
    spine: list[str],
    index: dict[str, int],
    segments: dict[int, list[frozenset[str]]],
    cut: dict[int, list[frozenset[str]]],
) -> list[frozenset[str]]:
    """Each cut segment's pieces as groups, and the operators between cut segments as one group each
    (a spine operator at or before a cut segment's fork precedes it; its pieces and after follow)."""
    forks = sorted(cut)
    gap_of = {}
    for n in spine:
        gap_of[n] = sum(1 for f in forks if f < index[n])
    for at, pieces in segments.items():
        if at in cut:
            continue
        for piece in pieces:
            for n in piece:
                gap_of[n] = sum(1 for f in forks if f <= at)
    gaps: dict[int, set[str]] = {}
    for n, g in gap_of.items():
        gaps.setdefault(g, set()).add(n)
    groups = [frozenset(gaps[g]) for g in sorted(gaps)]
    groups += [p for f in forks for p in cut[f]]
    groups = _with_constants(graph, groups)
    position = {n: i for i, n in enumerate(graph.order)}
    return sorted(groups, key=lambda g: min(position[n] for n in g))


def _with_constants(graph: Graph, groups: list[frozenset[str]]) -> list[frozenset[str]]:
    """``groups`` with each constant operator in the group of the first operator that reads it
    (transitively through other constants)."""
    of = {n: i for i, g in enumerate(groups) for n in g}
    members = [set(g) for g in groups]
    for n in reversed(graph.order):  # readers before the constants they read
        if n in graph.constant_nodes and n not in of:
            readers = [r for t in graph.op(n).outputs for r in graph.consumers.get(t, ()) if r in of]
            target = of[readers[0]] if readers else 0
            of[n] = target
            members[target].add(n)
    return [frozenset(m) for m in members if m]


@dataclass(frozen=True)
class BranchContender:
    """The model cut at its parallel branches, every group on ``backend``, built to run concurrently."""

    backend: str
    groups: list[frozenset[str]]
    model: CompositeModel

    @property
    def name(self) -> str:
        return f"branches:{self.backend}"

    @property
    def key_groups(self) -> list[tuple[str, frozenset[str]]]:
        """Its groups as a profile-cache key names them (concurrent: not the sequential placement's)."""
        return [(f"{self.backend}/concurrent", g) for g in self.groups]


def branch_contenders(
    graph: Graph, backends: Sequence[str], registry: BackendRegistry
) -> list[BranchContender]:
    """:func:`branch_groups` on each of ``backends``, built; none for a model without parallel
    branches or a one-core machine, and none on a backend that cannot build a branch."""
    groups = branch_groups(graph)
    if groups is None or cpu_cores() < 2:
        return []
    out = []
    for backend in backends:
        try:
            model = CompositeModel(graph, [(backend, g) for g in groups], registry=registry, concurrent=True)
        except Exception:  # noqa: BLE001 - a backend that cannot build a branch: no contender
            continue
        out.append(BranchContender(backend, groups, model))
    return out
