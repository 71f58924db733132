"""The top-level series-parallel view of a graph: where it is a chain and where it branches.

The graph is cut at its *articulation operators*: the operators every input→output path passes
through (the dominators of a virtual sink, with a virtual source feeding every input). Between two
consecutive cuts lies a segment; its branches are the weakly connected components of the operators
strictly inside it, plus one for a direct edge from the segment's first cut to its last (a residual
skip). A chain has one branch everywhere; MMT has as many as it has modality branches.

Operators that read no activation (Constant, or ops over initializers only) are left out of the
view: they hang off the side of the graph and would otherwise bypass every cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from tessera.core.graph import Graph

_SOURCE = "__tessera_source__"
_SINK = "__tessera_sink__"


@dataclass(frozen=True)
class Segment:
    """A parallel composition between two cut operators (None = the graph's edge)."""

    start: str | None
    end: str | None
    branches: int
    nodes: int


@dataclass(frozen=True)
class BranchStructure:
    cuts: tuple[str, ...]
    segments: tuple[Segment, ...]

    @property
    def max_branches(self) -> int:
        return max((s.branches for s in self.segments), default=1)

    @property
    def parallel_segments(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.branches > 1)

    def to_json(self) -> dict[str, object]:
        return {
            "max_parallel_branches": self.max_branches,
            "articulation_operators": len(self.cuts),
            "parallel_segments": [
                {"start": s.start, "end": s.end, "branches": s.branches, "nodes": s.nodes}
                for s in self.parallel_segments
            ],
        }


def activation_dag(graph: Graph) -> nx.DiGraph:
    """The DAG without operators that depend on no activation (constant producers)."""
    return graph.dag.subgraph(n for n in graph.order if n not in graph.constant_nodes)


def branch_structure(graph: Graph) -> BranchStructure:
    """Compute the top-level series-parallel view (see the module docstring)."""
    dag = nx.DiGraph(activation_dag(graph))
    order = [n for n in graph.order if n in dag]
    if not order:
        return BranchStructure(cuts=(), segments=())
    dag.add_node(_SOURCE)
    dag.add_node(_SINK)
    for n in order:
        if dag.in_degree(n) == 0:
            dag.add_edge(_SOURCE, n)
        if dag.out_degree(n) == 0 or any(t in graph.outputs for t in graph.op(n).outputs):
            dag.add_edge(n, _SINK)
    idom = nx.immediate_dominators(dag, _SOURCE)
    chain = [_SINK]
    while chain[-1] != _SOURCE:
        chain.append(idom[chain[-1]])
    chain.reverse()  # SOURCE, cut1, ..., SINK
    position = {n: i for i, n in enumerate(order)}
    cut_pos = [-1] + [position[c] for c in chain[1:-1]] + [len(order)]
    segments: list[Segment] = []
    for k in range(len(chain) - 1):
        lo, hi = cut_pos[k], cut_pos[k + 1]
        inside = order[lo + 1 : hi]
        start, end = chain[k], chain[k + 1]
        if not inside:
            continue
        components = nx.number_weakly_connected_components(dag.subgraph(inside))
        skip = 1 if dag.has_edge(start, end) else 0
        segments.append(
            Segment(
                start=None if start == _SOURCE else start,
                end=None if end == _SINK else end,
                branches=components + skip,
                nodes=len(inside),
            )
        )
    return BranchStructure(cuts=tuple(chain[1:-1]), segments=tuple(segments))
