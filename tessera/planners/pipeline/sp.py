"""Series-parallel decomposition of the operator DAG and its coarsening into units, the structure
GraphPipe's partitioner recurses over (series and parallel splits).

References: GraphPipe thesis §3.5, Algorithm 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import networkx as nx

from tessera.core.errors import InputError
from tessera.core.graph import Graph
from tessera.core.structure import activation_dag

Kind = Literal["leaf", "series", "parallel"]


@dataclass
class SPNode:
    """A node of the series-parallel tree (see the module docstring)."""

    kind: Kind
    children: list[SPNode] = field(default_factory=list)
    ops: tuple[str, ...] = ()  # leaf only: the activation operators of the unit, topological order
    cost: float = 0.0
    lo: int = 0  # unit range [lo, hi) in depth-first order, set by SPTree
    hi: int = 0

    def leaves(self) -> Iterable[SPNode]:
        if self.kind == "leaf":
            yield self
        else:
            for c in self.children:
                yield from c.leaves()

    def all_ops(self) -> list[str]:
        return [op for leaf in self.leaves() for op in leaf.ops]

    def depth(self) -> int:
        return 0 if self.kind == "leaf" else 1 + max(c.depth() for c in self.children)


@dataclass
class SPTree:
    """The decomposition of a graph: the root, the units (leaves) in order, and their operators."""

    root: SPNode
    units: list[tuple[str, ...]]  # operators of each unit, constants included, topological order
    unit_of: dict[str, int]  # operator → unit index
    converted: int = 0  # non-series-parallel subgraphs that were linearized

    @property
    def num_units(self) -> int:
        return len(self.units)

    def linearized(self) -> SPTree:
        """The same units as one series (a sequential chain): the SPP view of the same graph."""
        return self.chained(range(self.num_units))

    def chained(self, order: Sequence[int]) -> SPTree:
        """The units as one series in the order ``order`` (a permutation of their indices), and
        renumbered so: unit ``i`` of the result is unit ``order[i]`` here."""
        leaves = list(self.root.leaves())
        chain = [SPNode("leaf", ops=leaves[u].ops, cost=leaves[u].cost) for u in order]
        root = chain[0] if len(chain) == 1 else SPNode("series", children=chain, cost=self.root.cost)
        number_units(root, 0)
        index = {u: i for i, u in enumerate(order)}
        return SPTree(
            root=root,
            units=[self.units[u] for u in order],
            unit_of={op: index[u] for op, u in self.unit_of.items()},
            converted=self.converted,
        )


def decompose(
    graph: Graph,
    *,
    op_cost: Callable[[str], float] | None = None,
    max_units: int = 256,
) -> SPTree:
    """Series-parallel tree of ``graph``'s activation operators, coarsened to ``max_units`` units.

    ``op_cost`` weighs operators for coarsening (default: 1 + FLOPs / 1e6, a size proxy).
    """
    dag = nx.DiGraph(activation_dag(graph))
    order = [n for n in graph.order if n in dag]
    if not order:
        raise InputError(
            "no operator reads a model input or an activation: nothing to pipeline", source=graph.source
        )
    cost_fn = op_cost or (lambda n: 1.0 + graph.op(n).flops / 1e6)
    dag, members = _contract_unroutable(graph, dag, order)
    if members:
        first = {n: i for i, n in enumerate(order)}
        order = list(nx.lexicographical_topological_sort(dag, key=first.__getitem__))

    def leaf(n: str) -> SPNode:
        ops = members.get(n, (n,))
        return SPNode("leaf", ops=ops, cost=sum(cost_fn(o) for o in ops))

    position = {n: i for i, n in enumerate(order)}
    state = {"converted": 0}
    root = _decompose(dag, order, position, leaf, state)
    root = _flatten(root)
    threshold = root.cost / max(max_units, 1)
    cuts = CutBytes(graph)
    coarse = coarsen(root, threshold, cuts)
    while sum(1 for _ in coarse.leaves()) > max_units:
        threshold *= 2
        coarse = coarsen(root, threshold, cuts)
    number_units(coarse, 0)
    unit_ops = [list(leaf.ops) for leaf in coarse.leaves()]
    unit_of = {op: i for i, ops in enumerate(unit_ops) for op in ops}
    _attach_constants(graph, unit_ops, unit_of)
    rank = {n: i for i, n in enumerate(graph.order)}
    units = [tuple(sorted(ops, key=rank.__getitem__)) for ops in unit_ops]
    return SPTree(root=coarse, units=units, unit_of=unit_of, converted=state["converted"])


def _contract_unroutable(
    graph: Graph, dag: nx.DiGraph, order: Sequence[str]
) -> tuple[nx.DiGraph, dict[str, tuple[str, ...]]]:
    """``dag`` with the operators no stage boundary may separate contracted, and those groups by
    their first operator (its name is the group's node): operators joined by a tensor whose shape
    inference could not resolve (a count a ``NonZero`` chose, as in the legacy exporter's unrolled
    routing of experts), which a stage cannot size a buffer to receive, with every operator on a
    path between them (the strongly connected components of the contracted DAG: it stays acyclic)."""
    joined = nx.Graph()
    for u, v, tensors in dag.edges(data="tensors"):
        if any(t.shape is None for t in tensors):
            joined.add_edge(u, v)
    if not joined:
        return dag, {}
    group = {n: i for i, part in enumerate(nx.connected_components(joined)) for n in part}
    quotient = nx.DiGraph()
    quotient.add_nodes_from(group.get(n, n) for n in dag)
    quotient.add_edges_from((group.get(u, u), group.get(v, v)) for u, v in dag.edges)
    condensed = nx.condensation(quotient)
    parts: dict[int, list[str]] = {}
    for n in order:
        parts.setdefault(condensed.graph["mapping"][group.get(n, n)], []).append(n)
    contracted = nx.relabel_nodes(condensed, {i: ops[0] for i, ops in parts.items()})
    return contracted, {ops[0]: tuple(ops) for ops in parts.values() if len(ops) > 1}


def _decompose(
    dag: nx.DiGraph,
    nodes: Sequence[str],
    position: dict[str, int],
    leaf: Callable[[str], SPNode],
    state: dict[str, int],
) -> SPNode:
    if len(nodes) == 1:
        return leaf(nodes[0])
    sub = dag.subgraph(nodes)
    components = list(nx.weakly_connected_components(sub))
    if len(components) > 1:
        parts = [sorted(c, key=position.__getitem__) for c in components]
        parts.sort(key=lambda p: position[p[0]])
        children = [_decompose(dag, p, position, leaf, state) for p in parts]
        return SPNode("parallel", children=children, cost=sum(c.cost for c in children))
    cuts = _cut_positions(sub, nodes)
    if not cuts:
        # Not series-parallel: linearize in topological order (ordering edges; module docstring).
        state["converted"] += 1
        leaves = [leaf(n) for n in nodes]
        return SPNode("series", children=leaves, cost=sum(c.cost for c in leaves))
    children: list[SPNode] = []
    start = 0
    for k in cuts:
        if k > start:
            children.append(_decompose(dag, nodes[start:k], position, leaf, state))
        children.append(leaf(nodes[k]))
        start = k + 1
    if start < len(nodes):
        children.append(_decompose(dag, nodes[start:], position, leaf, state))
    if len(children) == 1:
        return children[0]
    return SPNode("series", children=children, cost=sum(c.cost for c in children))


def _cut_positions(sub: nx.DiGraph, nodes: Sequence[str]) -> list[int]:
    """Positions (in ``nodes``, a topological order) of operators comparable with all others.

    Position k is a cut iff no edge jumps over it, no sink of the subgraph lies before it and no
    source after it (then every earlier operator reaches it and it reaches every later one).
    """
    index = {n: i for i, n in enumerate(nodes)}
    n = len(nodes)
    # jump[k]: number of edges (u, v) with index u < k < index v, via a difference array.
    diff = [0] * (n + 1)
    for u, v in sub.edges:
        a, b = index[u], index[v]
        if b - a > 1:
            diff[a + 1] += 1
            diff[b] -= 1
    sinks_before = [0] * (n + 1)  # sinks among positions < k
    for i, node in enumerate(nodes):
        sinks_before[i + 1] = sinks_before[i] + (1 if sub.out_degree(node) == 0 else 0)
    sources_after = [0] * (n + 1)  # sources among positions > k-1 ... computed as suffix counts
    for i in range(n - 1, -1, -1):
        sources_after[i] = sources_after[i + 1] + (1 if sub.in_degree(nodes[i]) == 0 else 0)
    cuts: list[int] = []
    jump = 0
    for k in range(n):
        jump += diff[k]
        if jump == 0 and sinks_before[k] == 0 and sources_after[k + 1] == 0:
            cuts.append(k)
    return cuts


def _flatten(node: SPNode) -> SPNode:
    """Merge nested series into series and nested parallel into parallel."""
    if node.kind == "leaf":
        return node
    children: list[SPNode] = []
    for c in (_flatten(c) for c in node.children):
        if c.kind == node.kind:
            children.extend(c.children)
        else:
            children.append(c)
    return SPNode(node.kind, children=children, cost=node.cost)


def coarsen(node: SPNode, threshold: float, cuts: CutBytes | None = None) -> SPNode:
    if node.kind == "leaf":
        return SPNode("leaf", ops=node.ops, cost=node.cost)
    if node.cost <= threshold:
        return SPNode("leaf", ops=tuple(node.all_ops()), cost=node.cost)
    children = [coarsen(c, threshold, cuts) for c in node.children]
    if node.kind == "parallel":
        # Heaviest branches first (stable): the partitioner groups contiguous, similar branches.
        children.sort(key=lambda c: -c.cost)
    if node.kind == "series":
        crossing = cuts(children) if cuts is not None else [0.0] * (len(children) - 1)
        merged: list[SPNode] = []
        i = 0
        while i < len(children):
            j = i
            while j < len(children) and children[j].kind == "leaf":
                j += 1
            if j == i:
                merged.append(children[i])
                i += 1
                continue
            merged.extend(_merge_run(children[i:j], crossing[i : j - 1], threshold))
            i = j
        children = merged
    if len(children) == 1:
        return children[0]
    return SPNode(node.kind, children=children, cost=node.cost)


def _merge_run(leaves: list[SPNode], crossing: list[float], threshold: float) -> list[SPNode]:
    """Consecutive leaves of a series merged into units of cost at most ``threshold``, closing units
    at cheap cuts: a DP over the run minimizing Σ over units of ``1 + bytes(cut after it) / median
    cut`` — as few units as the budget allows, but a unit more where that moves cuts off the wide
    tensors (inside a transformer layer a cut carries the residual stream *and* the branch's
    activations; between layers, the residual stream only)."""
    n = len(leaves)
    positive = sorted(x for x in crossing if x > 0)
    ref = positive[len(positive) // 2] if positive else 1.0
    best = [0.0] + [math.inf] * n  # best[e]: cost of leaves [0, e) in units
    start = [0] * (n + 1)
    for e in range(1, n + 1):
        closing = 1.0 + (crossing[e - 1] / ref if e < n else 0.0)
        total = 0.0
        for b in range(e - 1, -1, -1):
            total += leaves[b].cost
            if b < e - 1 and total > threshold:
                break
            if best[b] + closing < best[e]:
                best[e], start[e] = best[b] + closing, b
    units: list[SPNode] = []
    e = n
    while e > 0:
        b = start[e]
        ops = tuple(op for leaf in leaves[b:e] for op in leaf.ops)
        units.append(SPNode("leaf", ops=ops, cost=sum(leaf.cost for leaf in leaves[b:e])))
        e = b
    return units[::-1]


class CutBytes:
    """Bytes crossing each boundary between consecutive children of a series node: the tensors
    produced at or before it (or entering the node from before) that are read after it (or leave
    the node). Weights (constant operators) are not activations and do not count."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def __call__(self, children: Sequence[SPNode]) -> list[float]:
        k = len(children)
        pos = {op: i for i, c in enumerate(children) for op in c.all_ops()}
        dag, constants = self.graph.dag, self.graph.constant_nodes
        span: dict[str, list[float]] = {}  # tensor -> [first position, last reader, bytes]
        for op, i in pos.items():
            for succ in dag.successors(op):
                reader = pos.get(succ, k)
                for t in dag.edges[op, succ]["tensors"]:
                    got = span.setdefault(t.name, [i, reader, t.nbytes])
                    got[1] = max(got[1], reader)
            for pred in dag.predecessors(op):
                if pred in pos or pred in constants:
                    continue
                for t in dag.edges[pred, op]["tensors"]:
                    got = span.setdefault(t.name, [-1, i, t.nbytes])
                    got[0], got[1] = -1, max(got[1], i)
        diff = [0.0] * (k + 1)
        for lo, hi, nbytes in span.values():
            a, b = max(int(lo), 0), min(int(hi), k - 1)
            if a < b:
                diff[a] += nbytes
                diff[b] -= nbytes
        out, run = [], 0.0
        for j in range(k - 1):
            run += diff[j]
            out.append(run)
        return out


def number_units(node: SPNode, start: int) -> int:
    node.lo = start
    if node.kind == "leaf":
        node.hi = start + 1
        return node.hi
    at = start
    for c in node.children:
        at = number_units(c, at)
    node.hi = at
    return at


def _attach_constants(graph: Graph, unit_ops: list[list[str]], unit_of: dict[str, int]) -> None:
    """Put every constant operator in the unit of its first non-constant consumer."""
    pending = [n for n in reversed(graph.order) if n in graph.constant_nodes]
    for n in pending:  # reverse topological: a constant's constant consumers are placed first
        targets = [unit_of[s] for s in graph.dag.successors(n) if s in unit_of]
        unit = min(targets) if targets else 0
        unit_of[n] = unit
        unit_ops[unit].append(n)
