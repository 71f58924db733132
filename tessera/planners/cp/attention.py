"""Find the attention cores of an ONNX graph as exporters write them.

A core is ``Softmax`` between a Q·Kᵀ ``MatMul`` and a ``MatMul`` with V. Q, K and V are traced back to
their weight projections through whatever lies between: reshapes, casts, the SDPA export's scaling,
rotary embeddings (full or partial), KV heads repeated for grouped-query attention, the split of a
fused QKV projection. A Softmax that is not such a core gets a reason naming the node where the
walk stopped. Matching rules: docs/cp.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from tessera.core.graph import Graph, OpNode

__all__ = ["AttentionCore", "Matcher", "NotAttention"]

# Element-wise ops between Q·Kᵀ and Softmax (scale, additive or Where mask).
_SCORE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Cast", "Identity"})
# Ops between Softmax and ·V: casts, dropout, and the SDPA export's Where(IsNaN(p), 0, p) guard.
_PROBABILITY_OPS = frozenset({"Cast", "Identity", "Dropout", "Where"})
# Ops whose first input is the data and the rest shapes, indices or axes.
_DATA_FIRST = frozenset(
    {"Reshape", "Expand", "Tile", "Unsqueeze", "Squeeze", "Slice", "Transpose", "Cast", "CastLike",
     "Identity", "Flatten", "Split", "Gather", "Dropout"}
)  # fmt: skip
# Element-wise ops whose every non-constant input carries data (rotary: q·cos + rotate_half(q)·sin).
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Concat", "Where"})
_COMPARISONS = frozenset({"Less", "LessOrEqual", "Greater", "GreaterOrEqual"})
_NUMPY_TO_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp32"}
_MAX_WALK = 400  # nodes one trace may visit (a projection is a few dozen ops away)


class NotAttention(Exception):
    """Why a Softmax is not an attention core; ``node`` is where the match failed."""

    def __init__(self, node: str, why: str) -> None:
        super().__init__(f"at {node}: {why}")
        self.node, self.why = node, why


@dataclass(frozen=True)
class AttentionCore:
    """One matched attention: its nodes and the sizes read from its weights and shapes."""

    softmax: str
    qk_matmul: str
    av_matmul: str
    q_projection: str
    k_projection: str
    v_projection: str
    out_projection: str | None
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    self_attention: bool
    rotary_dim: int | None  # channels of each head the rotary embedding turns; None: no rotary
    dtype: str

    @property
    def projections(self) -> tuple[str, ...]:
        """The Q, K, V projection nodes, each once (one when fused)."""
        return tuple(dict.fromkeys((self.q_projection, self.k_projection, self.v_projection)))


@dataclass
class _Trace:
    projections: dict[str, int | None]  # projection node -> the width taken from it (None: all)
    rotary_dims: set[int]
    stop: tuple[str, str] | None  # (node, why) where a path ended before any projection


class Matcher:
    """Structural queries on one graph: weights, shapes, producers, and the attention cores."""

    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.position = {name: i for i, name in enumerate(graph.order)}
        self._arrays: dict[str, np.ndarray | None] = {}

    # -- helpers --------------------------------------------------------------------------------

    def producer(self, tensor: str) -> OpNode | None:
        name = self.g.producer.get(tensor)
        return None if name is None else self.g.op(name)

    def is_constant(self, tensor: str) -> bool:
        if tensor in self.g.initializers:
            return True
        name = self.g.producer.get(tensor)
        return name is not None and name in self.g.constant_nodes

    def shape(self, tensor: str) -> tuple[int, ...] | None:
        info = self.g.tensors.get(tensor) or self.g.initializers.get(tensor)
        if info is None or info.shape is None or not all(isinstance(d, int) for d in info.shape):
            return None
        return tuple(info.shape)

    def weight_of(self, op: OpNode) -> tuple[str, int, int] | None:
        """``(weight, in_dim, out_dim)`` when ``op`` is a MatMul/Gemm by a 2-D weight initializer."""
        if op.op_type not in ("MatMul", "Gemm") or len(op.inputs) < 2:
            return None
        weight, transposed = op.inputs[1], op.op_type == "Gemm" and bool(int(op.attributes.get("transB", 0)))
        source = self.producer(weight)
        if source is not None and source.op_type == "Transpose" and source.inputs[0] in self.g.initializers:
            weight, transposed = source.inputs[0], not transposed  # a tied head: the embedding transposed
        info = self.g.initializers.get(weight)
        if info is None or info.shape is None or len(info.shape) != 2:
            return None
        rows, cols = info.shape
        if transposed:
            rows, cols = cols, rows
        return weight, int(rows), int(cols)

    def array(self, tensor: str) -> np.ndarray | None:
        """The value of an initializer or a ``Constant`` node's output; None when not constant."""
        if tensor not in self._arrays:
            value = None
            if tensor in self.g.initializers:
                proto = self.g.initializer_protos.get(tensor)
                # Weights kept outside the model (lazy or external data) are not read here.
                inline = proto is not None and proto.data_location != onnx.TensorProto.EXTERNAL
                value = _to_array(proto) if inline else None
            elif (op := self.producer(tensor)) is not None and op.op_type == "Constant":
                value = _to_array(op.attributes.get("value"))
            self._arrays[tensor] = value
        return self._arrays[tensor]

    # -- the core -------------------------------------------------------------------------------

    def cores(self) -> tuple[list[AttentionCore], list[NotAttention]]:
        """Every Softmax matched as an attention core, and why each other one is not."""
        found: list[AttentionCore] = []
        failed: list[NotAttention] = []
        for op in self.g.ops():
            if op.op_type == "Softmax":
                try:
                    found.append(self.core(op))
                except NotAttention as why:
                    failed.append(why)
        return found, failed

    def core(self, softmax: OpNode) -> AttentionCore:
        qk, side = self._scores(softmax)
        av = self._probabilities(softmax)
        q = self._trace(qk.inputs[0], "Q")
        k = self._trace(qk.inputs[1], "K")
        v = self._trace(av.inputs[1], "V")
        q_proj, k_proj, v_proj = (self._projection(t, role, qk) for t, role in ((q, "Q"), (k, "K"), (v, "V")))
        q_shape = self.shape(qk.inputs[0])
        if q_shape is None or len(q_shape) < 2:
            raise NotAttention(qk.name, "the shape of Q is unknown (bind the inputs with --input-shape)")
        head_dim = q_shape[-1]
        q_width, k_width = self._width(q, q_proj), self._width(k, k_proj)
        if q_width % head_dim or k_width % head_dim:
            raise NotAttention(
                qk.name, f"Q width {q_width} and K width {k_width} do not split into heads of {head_dim}"
            )
        heads, kv_heads = q_width // head_dim, k_width // head_dim
        if kv_heads < 1 or heads % kv_heads:
            raise NotAttention(qk.name, f"{kv_heads} KV head(s) do not divide {heads} query heads")
        weight = self.weight_of(q_proj)
        assert weight is not None
        out = self._out_projection(av.outputs[0])
        rotary = q.rotary_dims | k.rotary_dims
        return AttentionCore(
            softmax=softmax.name,
            qk_matmul=qk.name,
            av_matmul=av.name,
            q_projection=q_proj.name,
            k_projection=k_proj.name,
            v_projection=v_proj.name,
            out_projection=None if out is None else out.name,
            hidden=weight[1],
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            causal=self._causal(side),
            self_attention=len({p.inputs[0] for p in (q_proj, k_proj, v_proj)}) == 1,
            rotary_dim=max(rotary) if rotary else None,
            dtype=_NUMPY_TO_DTYPE.get(self.g.initializers[weight[0]].dtype, "fp32"),
        )

    def _scores(self, softmax: OpNode) -> tuple[OpNode, list[str]]:
        """The Q·Kᵀ MatMul before ``softmax`` and the side operands (scale, mask) on the way."""
        tensor, side = softmax.inputs[0], []
        for _ in range(12):
            op = self.producer(tensor)
            if op is None:
                break
            if op.op_type == "MatMul" and self.weight_of(op) is None:
                return op, side
            if op.op_type not in _SCORE_OPS:
                raise NotAttention(op.name, f"a {op.op_type} before the Softmax, not a Q·Kᵀ MatMul")
            data = op.inputs[1:] if op.op_type == "Where" else op.inputs
            live = [t for t in data if t and not self.is_constant(t)]
            # Of two live operands (scores + mask) the scores are the one a MatMul is found behind.
            path = next((t for t in live if self.reaches_scores(t, None)), None)
            if path is None:
                raise NotAttention(op.name, "no Q·Kᵀ MatMul behind the Softmax's input")
            side += [t for t in op.inputs if t and t != path]
            tensor = path
        raise NotAttention(softmax.name, "no Q·Kᵀ MatMul within 12 element-wise ops before it")

    def reaches_scores(self, tensor: str, qk: str | None) -> bool:
        """Whether ``tensor`` is computed, through score ops, from a Q·Kᵀ MatMul (``qk``, or any)."""
        op = self.producer(tensor)
        if op is None or op.op_type not in _SCORE_OPS | {"MatMul"}:
            return False
        if op.op_type == "MatMul":
            return self.weight_of(op) is None and qk in (None, op.name)
        data = op.inputs[1:] if op.op_type == "Where" else op.inputs
        return any(self.reaches_scores(t, qk) for t in data if t and not self.is_constant(t))

    def _probabilities(self, softmax: OpNode) -> OpNode:
        """The MatMul that weighs V by ``softmax``'s output (through casts and the NaN guard)."""
        queue = deque([softmax.outputs[0]])
        for _ in range(16):
            if not queue:
                break
            tensor = queue.popleft()
            for name in self.g.consumers.get(tensor, ()):
                op = self.g.op(name)
                if op.op_type == "MatMul" and op.inputs[0] == tensor:
                    return op
                if op.op_type in _PROBABILITY_OPS and (op.op_type != "Where" or tensor in op.inputs[1:]):
                    queue.append(op.outputs[0])
        raise NotAttention(softmax.name, "no MatMul with V after the Softmax")

    def _trace(self, tensor: str, role: str) -> _Trace:
        """Walk back from Q, K or V to the weight projections it is computed from."""
        trace = _Trace({}, set(), None)
        # (tensor, the splits on the way: (width taken, width split) along the last axis)
        stack: list[tuple[str, tuple[tuple[int, int], ...]]] = [(tensor, ())]
        seen: set[str] = set()
        while stack and len(seen) < _MAX_WALK:
            t, splits = stack.pop()
            if t in seen or self.is_constant(t) or t in self.g.inputs:
                continue
            seen.add(t)
            op = self.producer(t)
            if op is None:
                continue
            if (weight := self.weight_of(op)) is not None:
                # A fused projection's share: the split of its own output width nearest to it.
                share = next((taken for taken, whole in reversed(splits) if whole == weight[2]), None)
                trace.projections.setdefault(op.name, share)
                continue
            if op.op_type in ("Sin", "Cos"):  # the rotary tables
                trace.rotary_dims.add(self._last_dim(t))
                continue
            stack += [(x, splits + self._split(op, t)) for x in self._data_inputs(op, trace, role)]
        trace.rotary_dims.discard(0)
        return trace

    def _data_inputs(self, op: OpNode, trace: _Trace, role: str) -> list[str]:
        """The inputs of ``op`` that Q, K or V flow through; records rotary and dead ends."""
        kind = op.op_type
        if kind == "Concat" and any((p := self.producer(x)) and p.op_type == "Neg" for x in op.inputs):
            trace.rotary_dims.add(self._last_dim(op.outputs[0]))  # rotate_half: [-x2, x1]
        if kind in _DATA_FIRST:
            return [op.inputs[0]]
        if kind in _ELEMENTWISE:
            return [x for x in (op.inputs[1:] if kind == "Where" else op.inputs) if x]
        if trace.stop is None:
            trace.stop = (op.name, f"{role} comes from a {kind}, not from a weight projection")
        return []

    def _split(self, op: OpNode, tensor: str) -> tuple[tuple[int, int], ...]:
        if op.op_type not in ("Split", "Slice", "Gather"):
            return ()
        shape, source = self.shape(tensor), self.shape(op.inputs[0])
        if shape is None or source is None or not shape or not source or shape[-1] == source[-1]:
            return ()
        return ((shape[-1], source[-1]),)

    def _last_dim(self, tensor: str) -> int:
        shape = self.shape(tensor)
        return shape[-1] if shape else 0

    def _projection(self, trace: _Trace, role: str, qk: OpNode) -> OpNode:
        if len(trace.projections) == 1:
            return self.g.op(next(iter(trace.projections)))
        if not trace.projections:
            node, why = trace.stop or (qk.name, f"{role} does not come from a weight projection")
            raise NotAttention(node, why)
        names = ", ".join(sorted(trace.projections))
        raise NotAttention(qk.name, f"{role} comes from several projections ({names})")

    def _width(self, trace: _Trace, projection: OpNode) -> int:
        weight = self.weight_of(projection)
        assert weight is not None
        share = trace.projections[projection.name]
        return share if share is not None else weight[2]

    def _out_projection(self, tensor: str) -> OpNode | None:
        """From the attention's output forward through layout ops to the output projection."""
        for _ in range(8):
            readers = [self.g.op(c) for c in self.g.consumers.get(tensor, ())]
            readers = [op for op in readers if op.op_type != "Shape"]
            if len(readers) != 1:
                return None
            op = readers[0]
            if self.weight_of(op) is not None:
                return op
            if op.op_type not in ("Reshape", "Transpose", "Identity", "Cast", "Flatten"):
                return None
            tensor = op.outputs[0]
        return None

    # -- the mask -------------------------------------------------------------------------------

    def _causal(self, side: list[str]) -> bool:
        """Whether a mask among ``side`` is causal: a ``Trilu``, a triangular constant, or positions
        compared with positions (``kv_index <= q_index``, both from a ``Range``)."""
        queue = deque((t, 0) for t in side)
        seen: set[str] = set()
        while queue:
            t, depth = queue.popleft()
            if t in seen or depth > 16 or len(seen) > _MAX_WALK:
                continue
            seen.add(t)
            if _is_triangular_mask(self.array(t)):
                return True
            op = self.producer(t)
            if op is None or op.op_type == "Constant":
                continue
            if op.op_type == "Trilu":
                return True
            if op.op_type in _COMPARISONS and self._compares_positions(op):
                return True
            queue.extend((x, depth + 1) for x in op.inputs if x)
        return False

    def _compares_positions(self, op: OpNode) -> bool:
        """``kv_index <= q_index`` and the like: positions (from a ``Range``) on both sides, or two
        constants whose comparison is a triangle (a legacy export with a fixed sequence length)."""
        a, b = (self.array(x) for x in op.inputs[:2])
        if a is None or b is None:
            return all(self._from_range(x) for x in op.inputs[:2])
        compare = {"Less": np.less, "LessOrEqual": np.less_equal, "Greater": np.greater}
        result = compare.get(op.op_type, np.greater_equal)(a, b)
        return _is_triangular_mask(result) or _is_triangular_mask(~result)

    def _from_range(self, tensor: str) -> bool:
        """Whether ``tensor`` is (a reshape or offset of) a ``Range``: token positions."""
        for _ in range(8):
            op = self.producer(tensor)
            if op is None:
                return False
            if op.op_type in ("Range", "CumSum"):
                return True
            live = [t for t in op.inputs if t and not self.is_constant(t)]
            if op.op_type not in _DATA_FIRST | {"Add", "Sub"} or not live:
                return False
            tensor = op.inputs[0] if op.op_type in _DATA_FIRST else live[0]
        return False


def _to_array(value: object) -> np.ndarray | None:
    if value is None or isinstance(value, np.ndarray):
        return value
    if isinstance(value, list | int | float | bool):  # a Constant's value as the graph keeps it
        return np.asarray(value)
    try:
        return numpy_helper.to_array(value)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - lazy/external data or not a tensor: not a mask we can read
        return None


def _is_triangular_mask(array: np.ndarray | None) -> bool:
    """A constant causal mask: strictly upper triangle masked (large negative or False), the rest open."""
    if array is None or array.ndim < 2 or array.shape[-1] != array.shape[-2] or array.shape[-1] < 2:
        return False
    square = array.reshape(-1, *array.shape[-2:])[0]
    upper = np.triu(np.ones(square.shape, dtype=bool), k=1)
    if square.dtype == bool:
        return bool(np.all(square[~upper]) and not np.any(square[upper]))
    values = square.astype(np.float64)
    return bool(np.all(values[upper] <= -1e4) and np.all(values[~upper] == 0))
