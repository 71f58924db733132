"""Tensor-parallel splits of a graph's matrix products, found by dataflow (Megatron-style).

A matrix product with a weight of its own whose input is whole (replicated) may be split by columns;
the split follows the product's output through the operators that keep it split (elementwise ops,
reshapes into heads, per-head attention, norms over other axes) to products that contract the split
axis: split by rows, their partial sums all-reduced. What such a chain reaches and cannot keep split
(a norm over the split axis, a stage output) returns its columns to being whole: only chains that
close are split. Whole tensors entering a split chain go through a copy whose gradient is
all-reduced (Megatron's f), row outputs through an all-reduce (its g). Nothing is matched by name or
layer: the analysis reads the operators and the concrete shapes. Narrative: docs/gpp.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from onnx import numpy_helper

from tessera.core.graph import Graph, OpNode, TensorInfo

__all__ = ["Region", "TpSplit", "shard", "tensor_parallel"]

_UNARY = frozenset(
    {"Relu", "Gelu", "Sigmoid", "Tanh", "Erf", "Neg", "Exp", "Log", "Sqrt", "Reciprocal", "Abs", "Cast",
     "Identity", "Softplus", "Softsign", "HardSigmoid", "HardSwish", "LeakyRelu", "Elu", "Selu", "Celu",
     "Mish", "Sin", "Cos", "Floor", "Ceil", "Round", "Sign", "Not", "IsNaN", "IsInf", "Dropout", "Clip",
     "ThresholdedRelu", "Swish"}
)  # fmt: skip
_BROADCAST = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Equal", "Less", "Greater", "LessOrEqual",
     "GreaterOrEqual", "And", "Or", "Xor", "Where", "PRelu", "CastLike"}
)  # fmt: skip
_REDUCE = frozenset(
    {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
     "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"}
)  # fmt: skip
_REGROUP = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Expand"})


@dataclass(frozen=True)
class Region:
    """One closed chain of split products: columns in, rows out.

    ``weights``: initializer → (axis, parts): each rank holds its 1/t block of each of ``parts``
    equal parts along ``axis`` (:func:`shard`; column and row weights, a column's bias; parts > 1 for a
    fused QKV); ``split``: activation → its split axis; ``operands``: (node, input index) of a whole
    tensor a split node reads → ``None`` (read through the copy) or (axis, part size) it is cut along at
    run time (the rank's block of each part, read through the copy); ``shapes``: Reshape/Expand nodes → the axis of
    their shape input the rank divides by t (-1: a fused product's Split, every part size).
    """

    columns: frozenset[str]
    rows: frozenset[str]
    nodes: frozenset[str]
    weights: Mapping[str, tuple[int, int]]
    split: Mapping[str, int]
    operands: Mapping[tuple[str, int], tuple[int, int] | None]
    shapes: Mapping[str, int]
    constants: Mapping[str, int]  # Shape/Size of a split tensor → its split axis
    copied: frozenset[str]  # whole tensors read through the copy whose gradient is all-reduced

    def reduce_bytes(self, graph: Graph) -> int:
        """Bytes the forward all-reduces (the rows' outputs)."""
        return sum(graph.tensors[graph.op(n).outputs[0]].nbytes for n in self.rows)


@dataclass(frozen=True)
class TpSplit:
    """A graph's ``t``-way tensor-parallel regions (none when ``t`` is 1 or nothing closes)."""

    t: int
    regions: tuple[Region, ...] = ()

    def restrict(self, nodes: Iterable[str]) -> TpSplit:
        """The regions lying wholly among ``nodes`` (a stage): a stage boundary through a region
        leaves it whole there."""
        members = set(nodes)
        kept = tuple(r for r in self.regions if r.nodes <= members)
        return TpSplit(self.t, kept)

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(n for r in self.regions for n in r.nodes)

    @property
    def weights(self) -> dict[str, tuple[int, int]]:
        """Every region's split initializers: name → (axis, parts) (:func:`shard`)."""
        return {w: ax for r in self.regions for w, ax in r.weights.items()}


class _Conflict(Exception):
    def __init__(self, seeds: frozenset[str]) -> None:
        super().__init__("conflict")
        self.seeds = seeds


@dataclass
class _Label:
    axis: int
    seeds: frozenset[str]
    pieces: int = 1  # the rank holds its block of each of this many equal parts (shard())


def tensor_parallel(
    graph: Graph, t: int, *, within: Iterable[str] | None = None, outputs: Iterable[str] | None = None
) -> TpSplit:
    """The ``t``-way tensor-parallel split of ``graph`` (see the module docstring); ``within``: of
    these nodes alone (the others are never run: a decode step's, what its logits need), ``outputs``
    the tensors that must end whole (default: the graph's outputs)."""
    if t <= 1:
        return TpSplit(max(t, 1))
    members = None if within is None else frozenset(within)
    ends = tuple(graph.outputs if outputs is None else outputs)
    columns = {n for n in graph.order if _weight(graph, n) is not None and (members is None or n in members)}
    while True:
        dead: set[str] = set()
        found = _Pass(graph, t, columns, dead).run(members, ends)
        if not dead:
            return found
        columns -= dead


def _weight(graph: Graph, name: str) -> str | None:
    """The weight of a product that may be split: its own 2-D floating initializer."""
    op = graph.op(name)
    if op.op_type not in ("MatMul", "Gemm") or len(op.inputs) < 2 or name in graph.constant_nodes:
        return None
    w = op.inputs[1]
    info = graph.initializers.get(w)
    x = graph.tensors.get(op.inputs[0])
    if info is None or info.shape is None or len(info.shape) != 2 or not info.floating:
        return None
    if x is None or x.shape is None or len(x.shape) < 2 or graph.consumers.get(w, ()) != (name,):
        return None
    if op.op_type == "Gemm" and op.attributes.get("transA", 0):
        return None
    return w


def _width(graph: Graph, name: str) -> tuple[int, int]:
    """(column axis, row axis) of a product's weight."""
    op = graph.op(name)
    return (0, 1) if op.op_type == "Gemm" and op.attributes.get("transB", 0) else (1, 0)


class _Pass:
    """One labelling of the graph with the columns allowed; conflicts collect in ``dead``."""

    def __init__(self, graph: Graph, t: int, columns: set[str], dead: set[str]) -> None:
        self.g, self.t, self.columns, self.dead = graph, t, columns, dead
        self.labels: dict[str, _Label] = {}
        self.rows: dict[str, frozenset[str]] = {}
        self.node_seeds: dict[str, frozenset[str]] = {}
        self.weights: dict[str, tuple[tuple[int, int], frozenset[str]]] = {}
        self.operands: dict[tuple[str, int], tuple[tuple[int, int] | None, frozenset[str]]] = {}
        self.shapes: dict[str, tuple[int, frozenset[str]]] = {}
        self.constants: dict[str, tuple[int, frozenset[str]]] = {}
        self.differentiable = {n for n, i in graph.inputs.items() if i.floating}
        self.piece = self.out_piece = 1  # the parts of the node's split inputs and outputs (_Label.pieces)

    def run(self, members: frozenset[str] | None, outputs: Sequence[str]) -> TpSplit:
        g = self.g
        for name in g.order:
            if members is not None and name not in members:
                continue
            op = g.op(name)
            if any(
                i in self.differentiable or _trainable(g, i) for i in (*op.inputs, *op.implicit_inputs) if i
            ):
                self.differentiable.update(o for o in op.outputs if o in g.tensors and g.tensors[o].floating)
            try:
                self._node(name)
            except _Conflict as c:
                self.dead.update(c.seeds)
        for out in outputs:
            if out in self.labels:
                self.dead.update(self.labels[out].seeds)
        return self._regions() if not self.dead else TpSplit(self.t)

    # -- one node ----------------------------------------------------------------------------

    def _node(self, name: str) -> None:
        g, op = self.g, self.g.op(name)
        split = {k: self.labels[i] for k, i in enumerate(op.inputs) if i in self.labels}
        inner = [self.labels[i].seeds for i in op.implicit_inputs if i in self.labels]
        if inner:  # a subgraph (If, Loop) reading a split tensor: not followed inside
            raise _Conflict(frozenset().union(*inner))
        if _weight(g, name) is not None:
            self._product(name, split)
            return
        if not split:
            return
        seeds = frozenset().union(*(lab.seeds for lab in split.values()))
        if op.op_type in ("Shape", "Size"):
            self.constants[name] = (next(iter(split.values())).axis, seeds)
            self.node_seeds[name] = seeds
            return
        pieces = {lab.pieces for lab in split.values()}
        if len(pieces) != 1:
            raise _Conflict(seeds)
        self.piece = self.out_piece = pieces.pop()
        axis = self._rule(name, split, seeds)
        if axis is None:
            raise _Conflict(seeds)
        self.node_seeds[name] = seeds
        piece = self.out_piece
        for k, o in enumerate(op.outputs):
            if not o or (op.op_type == "Dropout" and k > 0):
                continue
            if k > 0 and op.op_type not in ("Split",):
                raise _Conflict(seeds)
            self.labels[o] = _Label(axis, seeds, piece)

    def _product(self, name: str, split: Mapping[int, _Label]) -> None:
        g, op = self.g, self.g.op(name)
        w = op.inputs[1]
        col_axis, row_axis = _width(g, name)
        x = g.tensors[op.inputs[0]]
        if 0 in split:
            lab = split[0]
            if lab.axis != len(x.shape) - 1 or any(k > 1 for k in split):
                raise _Conflict(lab.seeds)
            self.rows[name] = lab.seeds
            self.node_seeds[name] = lab.seeds
            self.weights[w] = ((row_axis, lab.pieces), lab.seeds)
            return
        if split:  # the bias of a product whose input is whole, split by another chain
            raise _Conflict(frozenset().union(*(lab.seeds for lab in split.values())))
        width = g.initializers[w].shape[col_axis]
        if name not in self.columns or width % self.t:
            return
        seeds = frozenset({name})
        out = g.tensors[op.outputs[0]]
        pieces = _pieces(g, op.outputs[0])
        if (width // pieces) % self.t:
            return
        self.node_seeds[name] = seeds
        self.weights[w] = ((col_axis, pieces), seeds)
        self.operands[(name, 0)] = (None, seeds)
        self.piece = pieces
        if len(op.inputs) > 2 and op.inputs[2]:  # Gemm's bias, added to the split output
            if not self._whole(name, 2, len(out.shape) - 1, out.shape, seeds):
                raise _Conflict(seeds)
        self.labels[op.outputs[0]] = _Label(len(out.shape) - 1, seeds, pieces)

    def _rule(self, name: str, split: Mapping[int, _Label], seeds: frozenset[str]) -> int | None:  # noqa: PLR0911
        g, op = self.g, self.g.op(name)
        kind = op.op_type
        first = next(iter(split.values()))
        shape_in = g.tensors[op.inputs[next(iter(split))]].shape
        out = g.tensors.get(op.outputs[0])
        if not _ruled(op, out, shape_in):
            return None
        rank = len(out.shape)
        if kind == "Split" and op.attributes.get("axis", 0) % len(shape_in) == first.axis:
            return self._parts(name, first.axis, seeds)
        if kind in _UNARY:
            return first.axis if list(split) == [0] else None
        if kind in _BROADCAST:
            return self._broadcast(name, split, seeds, out.shape)
        if kind in ("Softmax", "LogSoftmax"):
            ax = op.attributes.get("axis", -1) % rank
            return first.axis if ax != first.axis else None
        if kind in ("LayerNormalization", "RMSNormalization"):
            return self._norm(name, split, seeds, out.shape)
        if kind == "Transpose":
            perm = list(op.attributes.get("perm", range(rank)[::-1]))
            return perm.index(first.axis)
        if kind in _REDUCE:
            return self._reduce(name, first.axis, len(shape_in))
        if kind in _REGROUP:
            return self._regrouped(name, split, seeds, shape_in, out.shape) if list(split) == [0] else None
        if kind in ("Slice", "Split", "Concat", "Gather"):
            return self._along(name, split, seeds, out.shape)
        if kind == "MatMul":
            return self._batched(name, split, seeds, out.shape)
        return None

    def _norm(
        self, name: str, split: Mapping[int, _Label], seeds: frozenset[str], out: Sequence[int]
    ) -> int | None:
        """A norm over axes after the split one, its scale and bias whole, only its result read."""
        op = self.g.op(name)
        first = next(iter(split.values()))
        ax = op.attributes.get("axis", -1) % len(out)
        if list(split) != [0] or first.axis >= ax:
            return None
        for k in range(1, len(op.inputs)):
            if op.inputs[k] and not self._whole(name, k, first.axis, out, seeds):
                return None
        return first.axis if len([o for o in op.outputs if o]) == 1 else None

    def _regrouped(
        self,
        name: str,
        split: Mapping[int, _Label],
        seeds: frozenset[str],
        shape_in: Sequence[int],
        out: Sequence[int],
    ) -> int | None:
        """A Reshape, Expand, … that keeps the split axis's pieces whole: the axis they land on (a
        Reshape's or Expand's shape input then split at that entry)."""
        op = self.g.op(name)
        found = _regroup(shape_in, out, next(iter(split.values())).axis, self.piece, self.t)
        if found is None:
            return None
        ax, self.out_piece = found
        if op.op_type in ("Reshape", "Expand"):  # the entry of the shape input giving that axis
            given = self.g.tensors[op.inputs[1]].shape
            entry = ax - (len(out) - given[0]) if given else -2
            if entry >= 0:
                self.shapes[name] = (entry, seeds)
            elif op.op_type == "Reshape" or entry == -2:
                return None
        return ax

    def _parts(self, name: str, axis: int, seeds: frozenset[str]) -> int | None:
        """A Split along the split axis into equal parts, each whole parts of the layout (a fused
        QKV projection's output into Q, K and V): each output holds pieces / parts."""
        g, op = self.g, self.g.op(name)
        parts = [g.tensors[o].shape for o in op.outputs if o]
        if any(p is None for p in parts) or len({p[axis] for p in parts}) != 1 or self.piece % len(parts):
            return None
        if len(op.inputs) > 1 and op.inputs[1]:  # the parts' sizes, given: the rank's
            self.shapes[name] = (-1, seeds)
        self.out_piece = self.piece // len(parts)
        return axis

    def _broadcast(
        self, name: str, split: Mapping[int, _Label], seeds: frozenset[str], out: tuple[int, ...]
    ) -> int | None:
        g, op = self.g, self.g.op(name)
        rank = len(out)
        axes = {lab.axis + rank - len(g.tensors[op.inputs[k]].shape) for k, lab in split.items()}
        if len(axes) != 1:
            return None
        axis = axes.pop()
        if not 0 <= axis < rank:
            return None
        if out[axis] % self.t:
            return None
        for k, i in enumerate(op.inputs):
            if i and k not in split and not self._whole(name, k, axis, out, seeds):
                return None
        return axis

    def _whole(self, name: str, k: int, axis: int, out: tuple[int, ...], seeds: frozenset[str]) -> bool:
        """A whole tensor read by a split node at input ``k``: broadcast along the split ``axis`` of
        the output (read through the copy), full along it (its own initializer: split; otherwise the
        rank's block cut at run time), or neither (refused)."""
        g = self.g
        tensor = g.op(name).inputs[k]
        info = g.tensors.get(tensor)
        if info is None or info.shape is None:
            return False
        own = axis - (len(out) - len(info.shape))
        size = info.shape[own] if own >= 0 else 1
        if size == 1:
            if info.floating and (tensor in self.differentiable or _trainable(g, tensor)):
                self.operands[(name, k)] = (None, seeds)
            return True
        if size != out[axis]:
            return False
        if tensor in g.initializers and g.consumers.get(tensor, ()) == (name,):
            self.weights[tensor] = ((own, self.piece), seeds)
            return True
        self.operands[(name, k)] = ((own, size // self.piece), seeds)  # a part's size: batch-free
        return True

    def _reduce(self, name: str, axis: int, rank: int) -> int | None:
        op = self.g.op(name)
        axes = op.attributes.get("axes")
        if axes is None and len(op.inputs) > 1 and op.inputs[1]:
            axes = _constant(self.g, op.inputs[1])
        if axes is None or len(axes) == 0:
            return None
        axes = {int(a) % rank for a in axes}
        if axis in axes:
            return None
        return axis if op.attributes.get("keepdims", 1) else axis - sum(a < axis for a in axes)

    def _along(
        self, name: str, split: Mapping[int, _Label], seeds: frozenset[str], out: tuple[int, ...]
    ) -> int | None:
        """Slice, Split, Concat and Gather along an axis other than the split one."""
        g, op = self.g, self.g.op(name)
        axis = next(iter(split.values())).axis
        rank = len(g.tensors[op.inputs[0]].shape or ())
        if op.op_type == "Slice":
            axes = _constant(g, op.inputs[3]) if len(op.inputs) > 3 and op.inputs[3] else list(range(rank))
            ok = list(split) == [0] and axes is not None and axis not in {int(a) % rank for a in axes}
            return axis if ok else None
        along = op.attributes.get("axis", 0) % max(rank, 1)
        if along == axis:
            return None
        if op.op_type == "Split":
            return axis if list(split) == [0] else None
        if op.op_type == "Gather":
            if list(split) != [0]:
                return None
            indices = g.tensors[op.inputs[1]].shape
            return axis if axis < along else axis - 1 + len(indices or ())
        if any(lab.axis != axis for lab in split.values()):
            return None
        for k in range(len(op.inputs)):
            if k not in split and not self._whole(name, k, axis, out, seeds):
                return None
        return axis

    def _batched(
        self, name: str, split: Mapping[int, _Label], seeds: frozenset[str], out: tuple[int, ...]
    ) -> int | None:
        """A product of two activations split along one of their batch axes (attention's heads)."""
        g, op = self.g, self.g.op(name)
        rank = len(out)
        if rank < 3:
            return None
        axes = set()
        for k, lab in split.items():
            r = len(g.tensors[op.inputs[k]].shape)
            if lab.axis >= r - 2:
                return None
            axes.add(lab.axis + rank - r)
        if len(axes) != 1:
            return None
        axis = axes.pop()
        for k in (0, 1):
            if k not in split and not self._whole(name, k, axis, out, seeds):
                return None
        return axis

    # -- regions -----------------------------------------------------------------------------

    def _regions(self) -> TpSplit:
        """The labelled nodes grouped into regions: seeds that meet (Q, K and V at the scores)
        are one region; a region without rows never closed and stays whole."""
        root = _roots([*self.node_seeds.values(), *self.rows.values()])
        found: dict[str, dict[str, dict]] = {}

        def add(seeds: frozenset[str], field: str, key: object, value: object) -> None:
            found.setdefault(root(min(seeds)), {}).setdefault(field, {})[key] = value

        for n, seeds in self.node_seeds.items():
            add(seeds, "nodes", n, None)
            if n not in self.rows and _weight(self.g, n) is not None:
                add(seeds, "columns", n, None)
        for n, seeds in self.rows.items():
            add(seeds, "rows", n, None)
        for field, table in (("weights", self.weights), ("operands", self.operands), ("shapes", self.shapes),
                             ("constants", self.constants)):  # fmt: skip
            for key, (value, seeds) in table.items():
                add(seeds, field, key, value)
        for tensor, lab in self.labels.items():
            add(lab.seeds, "split", tensor, lab.axis)
        regions = []
        for parts in found.values():
            if not parts.get("rows"):
                continue
            table = {
                f: dict(sorted(parts.get(f, {}).items()))
                for f in ("weights", "split", "operands", "shapes", "constants")
            }
            inputs = {self.g.op(n).inputs[k] for (n, k) in table["operands"]}
            regions.append(
                Region(
                    columns=frozenset(parts.get("columns", ())),
                    rows=frozenset(parts["rows"]),
                    nodes=frozenset(parts["nodes"]),
                    copied=frozenset(inputs & self.differentiable),
                    **table,
                )
            )
        order = {n: k for k, n in enumerate(self.g.order)}
        regions.sort(key=lambda r: min(order[n] for n in r.nodes))
        return TpSplit(self.t, tuple(regions))


def _roots(groups: Iterable[frozenset[str]]) -> Callable[[str], str]:
    """Union-find over names: the names of each group joined; the returned function finds a
    name's representative."""
    parent: dict[str, str] = {}

    def find(s: str) -> str:
        while parent.setdefault(s, s) != s:
            parent[s] = parent[parent[s]]
            s = parent[s]
        return s

    for group in groups:
        first, *rest = sorted(group)
        for s in rest:
            parent[find(s)] = find(first)
    return find


def shard(array: np.ndarray, axis: int, t: int, index: int, parts: int = 1) -> np.ndarray:
    """Rank ``index``'s block of ``array``: the ``index``-th of ``t`` blocks of each of ``parts``
    equal parts along ``axis``, concatenated."""
    return np.concatenate([np.array_split(p, t, axis)[index] for p in np.split(array, parts, axis)], axis)


def _pieces(graph: Graph, tensor: str) -> int:
    """How many equal parts a product's output is cut into along its last axis by a Split further on
    (a fused QKV projection: 3), following the single-consumer chain of ops that keep that axis."""
    axis_size = graph.tensors[tensor].shape[-1]
    while len(consumers := graph.consumers.get(tensor, ())) == 1:
        op = graph.op(consumers[0])
        shape = graph.tensors[tensor].shape
        if op.op_type == "Split":
            along = op.attributes.get("axis", 0) % len(shape)
            return len([o for o in op.outputs if o]) if along == len(shape) - 1 else 1
        nxt = graph.tensors.get(op.outputs[0])
        if op.op_type not in _UNARY | _BROADCAST | {"Reshape"} or nxt is None or nxt.shape is None:
            return 1
        if not nxt.shape or nxt.shape[-1] != axis_size:
            return 1
        tensor = op.outputs[0]
    return 1


def _trainable(graph: Graph, tensor: str) -> bool:
    info = graph.initializers.get(tensor)
    return info is not None and info.floating and info.shape not in (None, ())


def _constant(graph: Graph, tensor: str) -> list[int] | None:
    proto = graph.initializer_protos.get(tensor)
    if proto is not None:
        return [int(v) for v in np.asarray(numpy_helper.to_array(proto)).reshape(-1)]
    producer = graph.producer.get(tensor)
    if producer is not None and graph.op(producer).op_type == "Constant":
        value = graph.op(producer).attributes.get("value")
        if value is not None:
            return [int(v) for v in np.asarray(value).reshape(-1)]
    return None


def _ruled(op: OpNode, out: TensorInfo | None, shape_in: Sequence[int] | None) -> bool:
    """Shapes known, and an operator whose semantics the rules are for (the default domain's,
    and onnxruntime's Gelu)."""
    if out is None or out.shape is None or shape_in is None:
        return False
    return op.domain in ("", "ai.onnx") or (op.domain, op.op_type) == ("com.microsoft", "Gelu")


def _regroup(
    shape_in: tuple[int, ...], shape_out: tuple[int, ...], axis: int, pieces: int, t: int
) -> tuple[int, int] | None:
    """(output axis, its parts) carrying the split of input ``axis`` (``pieces`` parts, :func:`shard`)
    through a reshape, or None where the rank's blocks do not stay one axis's blocks. The flattened
    tensor is (outer × pieces) groups, each of t blocks; an output axis j carries them where the
    groups before it and within it multiply to the same count and the rest spans one group."""
    if math.prod(shape_out) != math.prod(shape_in):  # Expand: the axis keeps its size, right-aligned
        j = axis + len(shape_out) - len(shape_in)
        return (j, pieces) if j >= 0 and shape_out[j] == shape_in[axis] else None
    groups = math.prod(shape_in[:axis]) * pieces
    span = math.prod(shape_in[axis:]) // pieces
    for j in range(len(shape_out)):
        before = math.prod(shape_out[:j])
        if groups % before or shape_out[j] % (groups // before):
            continue
        parts = groups // before
        if (shape_out[j] // parts) % t == 0 and shape_out[j] // parts * math.prod(shape_out[j + 1 :]) == span:
            return j, parts
    return None
