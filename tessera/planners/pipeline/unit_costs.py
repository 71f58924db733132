"""Per-unit costs of a series-parallel tree's units with prefix sums, so that any unit range
is costed in O(1): compute, weights, activations and the tensors that cross between units."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from tessera.core.cost import CostModel
from tessera.core.graph import Graph
from tessera.planners.pipeline.sp import SPTree


class UnitCosts:
    """Per-unit costs with prefix sums, so any unit range [lo, hi) is costed in O(1)."""

    def __init__(
        self, graph: Graph, tree: SPTree, cost: CostModel, _per_unit: _PerUnit | None = None
    ) -> None:
        self.graph, self.tree, self.cost = graph, tree, cost
        n = tree.num_units
        self.n = n
        per = _per_unit if _per_unit is not None else _PerUnit.of(graph, tree.units, cost)
        self._per = per
        self.weights = _prefix(per.weights)
        self.optimizer = _prefix(per.optimizer)
        self.grads = _prefix(per.grads)
        self.act = _prefix(per.act)
        self.flops = _prefix(per.flops)
        # The activations crossing units (one walk over the DAG's edges: the flows, the bytes
        # entering unit ranges and Piper's cuts all derive from it).
        self.tensors = unit_tensors(graph, tree, cost)
        # Wire bytes per sample between units u < v (depth-first order is topological).
        flow = unit_flow(self.tensors, n)
        pair = np.zeros((n + 1, n + 1))
        pair[:n, :n] = np.triu(flow + flow.T)
        self._pair = pair
        self._enter = unit_entering(self.tensors, n)
        self._unit_keys = per.keys
        self._times: dict[int, tuple[list[float], list[float]]] = {}

    def computes(self, lo: int, hi: int) -> bool:
        """Whether units [lo, hi) hold a weight or compute FLOPs (:func:`computes` of their
        operators): a stage of shape arithmetic alone does neither."""
        return self.weights[hi] > self.weights[lo] or self.flops[hi] > self.flops[lo]

    def reordered(self, tree: SPTree, order: list[int]) -> UnitCosts:
        """The costs of ``tree``: these units in the order ``order`` (unit ``i`` of ``tree`` is
        unit ``order[i]`` here); per-unit costs are reused, not recomputed."""
        return UnitCosts(self.graph, tree, self.cost, self._per.permuted(order))

    def times(self, samples: int) -> tuple[list[float], list[float]]:
        """Prefix sums of forward and backward time per unit at ``samples`` samples."""
        got = self._times.get(samples)
        if got is None:
            fw, bw = self._per.times(self.graph, self.cost, samples)
            got = (_prefix(fw), _prefix(bw))
            self._times[samples] = got
        return got

    def block_key(self, lo: int, hi: int) -> tuple:
        """Identity of the costs of units [lo, hi): equal keys give equal stage costs for every
        sub-range at the same offset (unit costs, internal edges, bytes entering from before)."""
        inner = self._pair[lo:hi, lo:hi]
        entering = self._enter[lo : hi + 1, lo : hi + 1]
        return (tuple(self._unit_keys[lo:hi]), inner.tobytes(), entering.tobytes())

    def enter(self, lo: int, hi: int) -> float:
        """Wire bytes per sample entering units [lo, hi) from earlier units (each tensor once)."""
        return float(self._enter[lo, hi])


def computes(graph: Graph, nodes: Iterable[str]) -> bool:
    """Whether operators ``nodes`` hold a weight or compute FLOPs (:meth:`UnitCosts.computes`)."""
    return any(graph.op(n).flops > 0 or graph.op(n).params > 0 for n in nodes)


def unit_tensors(graph: Graph, tree: SPTree, cost: CostModel) -> list[tuple[int, tuple[int, ...], float]]:
    """Every activation that crosses units: ``(the unit that makes it, the later units that read
    it, its wire bytes per sample)``, in a fixed order (weights' producers excluded)."""
    readers: dict[tuple[str, int], tuple[float, set[int]]] = {}
    for u_name, v_name, data in graph.dag.edges(data=True):
        u, v = tree.unit_of[u_name], tree.unit_of[v_name]
        if u == v or u_name in graph.constant_nodes:
            continue
        for t in data["tensors"]:
            readers.setdefault((t.name, u), (cost.wire_bytes(t.nbytes), set()))[1].add(v)
    return [(p, tuple(sorted(units)), w) for (_, p), (w, units) in sorted(readers.items())]


def unit_flow(tensors: list[tuple[int, tuple[int, ...], float]], n: int) -> np.ndarray:
    """Wire bytes per sample from unit u to unit v of ``n`` (:func:`unit_tensors`), each tensor
    counted once per reading unit."""
    flow = np.zeros((n, n))
    for p, readers, w in tensors:
        for v in readers:
            flow[p, v] += w
    return flow


def unit_entering(tensors: list[tuple[int, tuple[int, ...], float]], n: int) -> np.ndarray:
    """``E[lo, hi]``: wire bytes per sample of the tensors made before unit ``lo`` that units
    [lo, hi) read, each tensor once however many of those units read it (a stage receives a
    tensor once: MMT's residual stream feeds a layer's norm and its residual add).

    A tensor made in unit ``p`` and read by units ``c_1 < … < c_k`` enters [lo, hi) when
    ``p < lo`` and its first reader at or after ``lo`` is before ``hi``; for ``lo`` in
    ``(c_{i-1}, c_i]`` (``c_0 = p``) that reader is ``c_i``. So the tensor adds its bytes to
    column ``c_i + 1`` of rows ``c_{i-1} + 1 … c_i`` (a difference array down the rows), and a
    running sum along each row counts it for every ``hi > c_i``. Exact in floating point for
    the whole-byte sizes of real models."""
    diff = np.zeros((n + 2, n + 2))
    for p, units, w in tensors:
        prev = p
        for c in (x for x in units if x > p):
            diff[prev + 1, c + 1] += w
            diff[c + 1, c + 1] -= w
            prev = c
    first = np.cumsum(diff, axis=0)  # first[lo, c + 1]: bytes whose first reader from lo is c
    return np.cumsum(first, axis=1)[: n + 1, : n + 1]


@dataclass(frozen=True, eq=False)
class _PerUnit:
    """What each unit costs, in the units' order: weight, optimizer and gradient bytes, stored
    activation bytes per sample, an operator-cost identity (equal keys give equal times at every
    sample count: the roofline's inputs, and the model's own times, since measured costs differ
    by operator type), and forward/backward times per sample count (filled as asked for)."""

    ops: list[list[str]]  # each unit's operators that store activations (not constants)
    weights: np.ndarray
    optimizer: np.ndarray
    grads: np.ndarray
    act: np.ndarray
    flops: np.ndarray
    keys: list[int]
    _times: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @classmethod
    def of(cls, graph: Graph, units: list[list[str]], cost: CostModel) -> _PerUnit:
        activation_ops = [[o for o in u if o not in graph.constant_nodes] for u in units]
        interned: dict[tuple, int] = {}
        keys = [
            interned.setdefault(
                tuple(
                    sorted(
                        (
                            o.op_type,
                            o.flops,
                            o.bytes_moved,
                            o.param_bytes,
                            o.params,
                            cost.activation_bytes(graph, o.name),
                            cost.forward_time(o, 1),
                            cost.backward_time(o, 1),
                        )
                        for o in (graph.op(n) for n in u)
                    )
                ),
                len(interned),
            )
            for u in units
        ]
        memory = np.array([cost.memory_of(graph, u) for u in units]).reshape(len(units), 3)
        return cls(
            ops=activation_ops,
            weights=memory[:, 0],
            optimizer=memory[:, 1],
            grads=np.array([sum(cost.gradient_bytes(graph.op(o)) for o in u) for u in units]),
            act=memory[:, 2],
            flops=np.array([sum(graph.op(o).flops for o in u) for u in units], dtype=np.float64),
            keys=keys,
        )

    def permuted(self, order: list[int]) -> _PerUnit:
        """The same units in the order ``order`` (times already computed come along)."""
        idx = np.array(order, dtype=np.int64)
        return _PerUnit(
            ops=[self.ops[u] for u in order],
            weights=self.weights[idx],
            optimizer=self.optimizer[idx],
            grads=self.grads[idx],
            act=self.act[idx],
            flops=self.flops[idx],
            keys=[self.keys[u] for u in order],
            _times={s: (fw[idx], bw[idx]) for s, (fw, bw) in self._times.items()},
        )

    def times(self, graph: Graph, cost: CostModel, samples: int) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward time of each unit at ``samples`` samples."""
        got = self._times.get(samples)
        if got is None:
            fw = np.array([sum(cost.forward_time(graph.op(o), samples) for o in u) for u in self.ops])
            bw = np.array([sum(cost.backward_time(graph.op(o), samples) for o in u) for u in self.ops])
            got = self._times[samples] = (fw, bw)
        return got


def _prefix(values: np.ndarray) -> list[float]:
    out = np.zeros(len(values) + 1)
    out[1:] = np.cumsum(values)
    return out.tolist()
