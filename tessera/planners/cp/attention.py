"""Find the attention cores of an ONNX graph as exporters write them.

A core is ``Softmax`` between a Q·Kᵀ ``MatMul`` and a ``MatMul`` with V. Q, K and V are traced back to
their weight projections through whatever lies between: reshapes, casts, the SDPA export's scaling,
rotary embeddings (full or partial), KV heads repeated for grouped-query attention, the split of a
fused QKV projection. A Softmax that is not such a core gets a reason naming the node where the
walk stopped. Matching rules: docs/cp.md.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

import numpy as np

from tessera.core.graph import Graph, OpNode
from tessera.planners.cp.scores import (
    GraphRun,
    OpScoreProbe,
    ScoreError,
    ScoreMod,
    ScoreProbe,
    bound_batch,
    constant_value,
)
from tessera.planners.cp.softmax_input import LseSink, lse_sink, softmax_scores

__all__ = ["AttentionCore", "Matcher", "NotAttention"]

# Ops whose output carries none of their input's values (a mask built to the scores' shape).
_NOT_DATA = frozenset({"Softmax", "Shape", "Size", "ConstantOfShape", "EyeLike"})
_SCORE_DEPTH = 16  # ops between Q·Kᵀ and the Softmax (scale, soft-cap, bias, mask, reshapes)
# Ops between Softmax and ·V: casts, dropout, and the SDPA export's Where(IsNaN(p), 0, p) guard.
_PROBABILITY_OPS = frozenset({"Cast", "Identity", "Dropout", "Where", "Reshape"})
# Ops whose first input is the data and the rest shapes, indices or axes.
_DATA_FIRST = frozenset(
    {"Reshape", "Expand", "Tile", "Unsqueeze", "Squeeze", "Slice", "Transpose", "Cast", "CastLike",
     "Identity", "Flatten", "Split", "Gather", "GatherND", "GatherElements", "Dropout",
     "Clip",  # OLMo's clip_qkv: each projection's output clamped
     # a norm of each head's Q or K (Persimmon's LayerNorm, OLMo 2's RMSNorm as one operator)
     "LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"}
)  # fmt: skip
# Element-wise ops whose every non-constant input carries data (rotary: q·cos + rotate_half(q)·sin).
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Concat", "Where"})
_NUMPY_TO_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp32"}
_MAX_WALK = 400  # nodes one trace may visit (a projection is a few dozen ops away)


class NotAttention(Exception):
    """Why a Softmax is not an attention core; ``node`` is where the match failed."""

    def __init__(self, node: str, why: str) -> None:
        super().__init__(f"at {node}: {why}")
        self.node, self.why = node, why
        self.softmax: str | None = None  # the Softmax whose scores a product of two activations makes


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
    scores: ScoreMod | None  # what the graph does to Q·Kᵀ before the Softmax, evaluated
    score_error: tuple[str, str] | None  # (node, why) when that cannot be reproduced
    self_attention: bool
    rotary_dim: int | None  # channels of each head the rotary embedding turns; None: no rotary
    dtype: str
    # the Mul scaling the output by sigmoid(logsumexp(s) − sink), and which input is the output: the
    # sink is then in the attention (scores.sinks), and the Mul passes that input on
    sink_scale: tuple[str, int] | None = None

    @property
    def causal(self) -> bool:
        return self.scores is not None and self.scores.causal

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
        self._reaches: dict[tuple[str, str | None, int], bool] = {}
        self.run: GraphRun | None = None  # the whole graph in onnxruntime, when it runs here
        self.values: dict[str, np.ndarray] = {}  # tensors read from one run of it
        self.batch = bound_batch(graph)

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
        """The value of an initializer or a ``Constant`` node's output (:func:`constant_value`)."""
        if tensor not in self._arrays:
            self._arrays[tensor] = constant_value(self.g, tensor)
        return self._arrays[tensor]

    # -- the core -------------------------------------------------------------------------------

    def cores(self) -> tuple[list[AttentionCore], list[NotAttention]]:
        """Every Softmax matched as an attention core, and why each other one is not."""
        found: list[AttentionCore] = []
        failed: list[NotAttention] = []
        self._read_values()
        for op in self.g.ops():
            try:
                if op.op_type == "Softmax":
                    found.append(self.core(op))
                elif op.op_type == "Attention" and op.domain in ("", "ai.onnx"):
                    found.append(self.op_core(op))
            except NotAttention as why:
                if op.op_type == "Softmax" and self.reaches_scores(op.inputs[0], None):
                    why.softmax = op.name  # attention, by what it computes: not to be left as it is
                failed.append(why)
        return found, failed

    def op_core(self, node: OpNode) -> AttentionCore:
        """An ``Attention`` operator (opset 23) as a core: Q, K and V are its inputs (``[B, H, S, D]``,
        or ``[B, S, H·D]`` with ``q_num_heads``/``kv_num_heads``); it repeats grouped KV heads itself;
        its scores come from its attributes and its mask input (:class:`OpScoreProbe`)."""
        q_in, k_in, v_in = node.inputs[:3]
        q, k, v = self._trace(q_in, "Q"), self._trace(k_in, "K"), self._trace(v_in, "V")
        q_proj, k_proj, v_proj = (
            self._projection(t, role, node) for t, role in ((q, "Q"), (k, "K"), (v, "V"))
        )
        q_shape, k_shape = self.shape(q_in), self.shape(k_in)
        if q_shape is None or k_shape is None or len(q_shape) not in (3, 4) or len(k_shape) != len(q_shape):
            raise NotAttention(
                node.name, "the shapes of Q and K are unknown (bind the inputs with --input-shape)"
            )
        if len(q_shape) == 4:  # K as handed over may repeat each KV head: count the distinct ones
            heads, head_dim = q_shape[1], q_shape[3]
            kv_heads = self._distinct_heads(k_in, 4) or k_shape[1]
        else:
            heads, kv_heads = (
                int(node.attributes.get("q_num_heads", 0)),
                int(node.attributes.get("kv_num_heads", 0)),
            )
            if not heads or not kv_heads:
                raise NotAttention(node.name, "3-D Q, K, V without q_num_heads and kv_num_heads")
            head_dim = q_shape[2] // heads
        if heads % kv_heads:
            raise NotAttention(node.name, f"{kv_heads} KV head(s) do not divide {heads} query heads")
        try:
            scores, error = OpScoreProbe(self.g, node.name, head_dim).classify(), None
        except ScoreError as why:
            scores, error = None, (why.node, why.why)
        weight = self.weight_of(q_proj)
        assert weight is not None
        out = self._out_projection(node.outputs[0])
        rotary = q.rotary_dims | k.rotary_dims
        return AttentionCore(
            softmax=node.name, qk_matmul=node.name, av_matmul=node.name, q_projection=q_proj.name,
            k_projection=k_proj.name, v_projection=v_proj.name, out_projection=None if out is None else out.name,
            hidden=weight[1], heads=heads, kv_heads=kv_heads, head_dim=head_dim, scores=scores, score_error=error,
            self_attention=len({p.inputs[0] for p in (q_proj, k_proj, v_proj)}) == 1,
            rotary_dim=max(rotary) if rotary else None,
            dtype=_NUMPY_TO_DTYPE.get(self.g.initializers[weight[0]].dtype, "fp32"),
        )  # fmt: skip

    def _read_values(self) -> None:
        """Run the graph once (when it can run here) and keep K at every candidate core."""
        keys = []
        for op in self.g.ops():
            if op.op_type == "Attention":
                keys.append(op.inputs[1])
            elif op.op_type == "Softmax":
                try:
                    keys.append(self._scores(op).inputs[1])
                except NotAttention:
                    continue
        self.run = GraphRun.of(self.g, keys) if keys else None
        if self.run is not None:
            self.batch = self.run.batch
            tokens = self.probe_tokens(self.run.batch, self.run.length())
            try:
                self.values = self.run.run(tokens)
            except Exception:  # noqa: BLE001 - not runnable at these shapes: sizes come from weights
                self.run, self.values = None, {}

    def probe_tokens(self, batch: int, length: int) -> np.ndarray:
        """Distinct token ids ``1, 2, …`` (0 is often the padding id, embedded as zeros), within the
        smallest table the token input indexes."""
        rows = [
            int(info.shape[0])
            for name in self.g.inputs
            for reader in self.g.consumers.get(name, ())
            if (op := self.g.op(reader)).op_type == "Gather"
            and (info := self.g.initializers.get(op.inputs[0])) is not None
            and info.shape
        ]
        vocab = min(rows, default=2)
        ids = 1 + np.arange(batch * length, dtype=np.int64) % max(1, vocab - 1)
        return ids.reshape(batch, length)

    def core(self, softmax: OpNode) -> AttentionCore:
        qk = self._scores(softmax)
        normalized = softmax_scores(self.g, softmax.name)
        av = self._probabilities(softmax, sink=normalized.sink is not None)
        after: LseSink | None = None  # a sink applied to the output: o·sigmoid(logsumexp(s) − sink)
        for name in self.g.consumers.get(normalized.scores, ()):
            reader = self.g.op(name)
            if reader.name in (softmax.name, *normalized.between) or reader.op_type in ("Shape", "Size"):
                continue
            if (
                after is None
                and normalized.sink is None
                and (after := lse_sink(self.g, reader, av.outputs[0]))
            ):
                continue
            raise NotAttention(
                reader.name,
                f"the scores are read by a {reader.op_type} besides the Softmax (not an attention sink's "
                "sigmoid(logsumexp(s) − sink) scaling the output): tessera does not decode this attention",
            )
        q = self._trace(qk.inputs[0], "Q")
        k = self._trace(qk.inputs[1], "K")
        v = self._trace(av.inputs[1], "V")
        q_proj, k_proj, v_proj = (self._projection(t, role, qk) for t, role in ((q, "Q"), (k, "K"), (v, "V")))
        heads, kv_heads, head_dim = self._heads(qk, k, k_proj, {q_proj.name, v_proj.name})
        weight = self.weight_of(q_proj)
        assert weight is not None
        out = self._out_projection(av.outputs[0])
        rotary = q.rotary_dims | k.rotary_dims
        scores, error = self._evaluate(qk, softmax)
        sink = normalized.sink or (after.sink if after else None)
        if scores is not None and sink is not None:
            scores = dataclasses.replace(scores, sinks=self._sink_logits(sink, heads))
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
            scores=scores,
            score_error=error,
            self_attention=len({p.inputs[0] for p in (q_proj, k_proj, v_proj)}) == 1,
            rotary_dim=max(rotary) if rotary else None,
            dtype=_NUMPY_TO_DTYPE.get(self.g.initializers[weight[0]].dtype, "fp32"),
            sink_scale=None if after is None else (after.mul, after.kept),
        )

    def _scores(self, softmax: OpNode) -> OpNode:
        """The Q·Kᵀ MatMul before ``softmax``: the one MatMul of two activations that the Softmax's
        input is computed from within a few ops, whatever those ops are (what they compute is
        evaluated: :meth:`_evaluate`)."""
        tensor = softmax_scores(self.g, softmax.name).scores
        for _ in range(_SCORE_DEPTH):
            op = self.producer(tensor)
            if op is None:
                break
            if self._is_qk(op):
                return op
            live = [t for t in op.inputs if t and not self.is_constant(t)]
            path = [t for t in live if self.reaches_scores(t, None)]
            if not path:
                raise NotAttention(op.name, "no Q·Kᵀ MatMul behind the Softmax's input")
            if len(set(path)) > 1:
                raise NotAttention(op.name, "the Softmax's input combines two products of activations")
            tensor = path[0]
        raise NotAttention(softmax.name, f"no Q·Kᵀ MatMul within {_SCORE_DEPTH} ops before it")

    def _is_qk(self, op: OpNode) -> bool:
        return (
            op.op_type == "MatMul"
            and self.weight_of(op) is None
            and all(t and not self.is_constant(t) for t in op.inputs[:2])
        )

    def reaches_scores(self, tensor: str, qk: str | None, depth: int = _SCORE_DEPTH) -> bool:
        """Whether ``tensor`` is computed, within ``depth`` ops, from a Q·Kᵀ MatMul (``qk``, or any)."""
        key = (tensor, qk, depth)
        if key not in self._reaches:
            op = self.producer(tensor)
            if op is None or depth == 0 or op.op_type in _NOT_DATA or self.weight_of(op) is not None:
                found = False
            elif self._is_qk(op):
                found = qk in (None, op.name)
            else:
                found = any(
                    self.reaches_scores(t, qk, depth - 1) for t in op.inputs if t and not self.is_constant(t)
                )
            self._reaches[key] = found
        return self._reaches[key]

    def _evaluate(self, qk: OpNode, softmax: OpNode) -> tuple[ScoreMod | None, tuple[str, str] | None]:
        try:
            return ScoreProbe(self.g, qk.name, softmax.name).classify(), None
        except ScoreError as why:
            return None, (why.node, why.why)

    def _probabilities(self, softmax: OpNode, *, sink: bool = False) -> OpNode:
        """The MatMul that weighs V by ``softmax``'s output (through casts and the NaN guard, and,
        after a ``sink`` column, the ``Slice`` that drops it); the only one: probabilities that weigh
        two products (DiffLlama's two halves of V) are not one core."""
        queue, products = deque([softmax.outputs[0]]), []
        for _ in range(16):
            if not queue:
                break
            tensor = queue.popleft()
            for name in self.g.consumers.get(tensor, ()):
                op = self.g.op(name)
                if op.op_type == "MatMul" and op.inputs[0] == tensor:
                    products.append(op)
                elif op.op_type in _PROBABILITY_OPS and (op.op_type != "Where" or tensor in op.inputs[1:]):
                    queue.append(op.outputs[0])
                elif sink and op.op_type == "Slice" and self._drops_last_column(op):
                    queue.append(op.outputs[0])
        if not products:
            raise NotAttention(softmax.name, "no MatMul with V after the Softmax")
        if len(products) > 1:
            raise NotAttention(
                products[1].name,
                f"the Softmax's probabilities weigh {len(products)} products ({products[0].name}, "
                f"{products[1].name}) where attention weighs one V: tessera does not decode this attention",
            )
        return products[0]

    def _drops_last_column(self, op: OpNode) -> bool:
        """Whether ``op`` (a Slice) keeps all but the last column of the last axis (``p[..., :-1]``)."""
        values = [None if len(op.inputs) <= i or not op.inputs[i] else constant_value(self.g, op.inputs[i])
                  for i in (1, 2, 3, 4)]  # fmt: skip
        starts, ends, axes, steps = (
            None if v is None else [int(x) for x in np.asarray(v).reshape(-1)] for v in values
        )
        rank = len(self.shape(op.inputs[0]) or ())
        return (
            starts == [0]
            and ends == [-1]
            and axes is not None
            and axes[0] in (-1, rank - 1)
            and steps in (None, [1])
        )

    def _sink_logits(self, tensor: str, heads: int) -> tuple[float, ...]:
        """Each head's sink logit: the constant a sink column broadcasts (through reshapes, expands
        and casts), one per head or one for all."""
        at = tensor
        for _ in range(8):
            value = constant_value(self.g, at)
            if value is not None:
                flat = np.asarray(value, dtype=np.float64).reshape(-1)
                if flat.size in (1, heads):
                    return tuple(float(x) for x in np.broadcast_to(flat, (heads,)))
                break
            op = self.producer(at)
            if op is None or op.op_type not in (
                "Expand",
                "Reshape",
                "Cast",
                "Unsqueeze",
                "Squeeze",
                "Identity",
            ):
                break
            at = op.inputs[0]
        node = self.producer(tensor)
        raise NotAttention(
            tensor if node is None else node.name,
            f"the column joined after the scores is no constant per head ({heads} heads): not an attention sink",
        )

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
        if kind == "Concat" and (turned := self._rotated_width(op)):
            trace.rotary_dims.add(turned)
        if kind == "RotaryEmbedding":  # opset 23: the turned width, or the whole head
            width = int(op.attributes.get("rotary_embedding_dim", 0) or 0)
            shape = self.shape(op.inputs[0])
            heads = int(op.attributes.get("num_heads", 0) or 0)
            if not width and shape:
                width = shape[-1] if len(shape) == 4 else shape[-1] // max(1, heads)
            trace.rotary_dims.add(width)
            return [op.inputs[0]]
        if kind in _DATA_FIRST:
            return [op.inputs[0]]
        if kind in _ELEMENTWISE:
            return [x for x in (op.inputs[1:] if kind == "Where" else op.inputs) if x]
        if trace.stop is None:
            trace.stop = (op.name, f"{role} comes from a {kind}, not from a weight projection")
        return []

    def _rotated_width(self, concat: OpNode) -> int:
        """The channels a rotation turns when ``concat`` joins a negated half with the other:
        ``[-x2, x1]`` (rotate_half: its width), or ``stack((-x2, x1), -1)`` (rotate-every-two, GPT-J:
        the stacked pairs, flattened after it), or the two rotated halves themselves,
        ``[x1·cos − x2·sin, x2·cos + x1·sin]`` (GPT-OSS: tables of half the width). 0 when it is no
        rotation."""
        made = [self.producer(x) for x in concat.inputs]
        if len(made) == 2 and all(made) and {p.op_type for p in made} == {"Sub", "Add"}:  # type: ignore[union-attr]
            products = [self.producer(t) for p in made for t in p.inputs]  # type: ignore[union-attr]
            if all(q is not None and q.op_type == "Mul" for q in products):
                return self._last_dim(concat.outputs[0])
        for x in concat.inputs:
            p = self.producer(x)
            if p is not None and p.op_type == "Neg":
                return self._last_dim(concat.outputs[0])
            if (
                p is not None
                and p.op_type == "Unsqueeze"
                and (n := self.producer(p.inputs[0]))
                and n.op_type == "Neg"
            ):
                shape = self.shape(concat.outputs[0])
                return shape[-1] * shape[-2] if shape and len(shape) >= 2 else 0
        return 0

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

    def _distinct_heads(self, key: str, rank: int) -> int | None:
        """How many different heads K has at the core (``[B, H, …]``, or ``[B·H, …]`` for rank 3), in
        the one run of the graph; None where it was not run (or K came out all zeros, or not finite)."""
        kt = self.values.get(key)
        if (
            kt is None
            or kt.ndim != rank
            or not np.any(kt)
            or kt.shape[0] % self.batch
            or not np.isfinite(kt).all()
        ):
            return None
        at_core = kt.shape[1] if kt.ndim == 4 else kt.shape[0] // self.batch  # < heads: broadcast
        distinct: list[np.ndarray] = []
        for row in kt.reshape(self.batch, at_core, -1)[0]:
            if not any(np.array_equal(row, seen) for seen in distinct):
                distinct.append(row)
        return len(distinct)

    def _heads(self, qk: OpNode, k: _Trace, k_proj: OpNode, others: set[str]) -> tuple[int, int, int]:
        """``(heads, kv_heads, head_dim)``: heads and head_dim from Q's shape at the core (``[B, H,
        S, D]``, or ``[B·H, S, D]``); KV heads from K's values there (grouped-query attention hands
        the core each KV head repeated: the distinct heads are the KV heads), else from the width
        the K projection gives K."""
        q_shape = self.shape(qk.inputs[0])
        if q_shape is None or len(q_shape) not in (3, 4):
            raise NotAttention(qk.name, "the shape of Q is unknown (bind the inputs with --input-shape)")
        head_dim = q_shape[-1]
        heads = q_shape[1] if len(q_shape) == 4 else q_shape[0] // self.batch
        kv_heads = self._distinct_heads(qk.inputs[1], len(q_shape))
        if kv_heads is None:
            weight = self.weight_of(k_proj)
            assert weight is not None
            share = k.projections[k_proj.name]  # a fused projection's share of its width
            width = share if share is not None and k_proj.name in others else weight[2]
            if width % head_dim:
                raise NotAttention(qk.name, f"K width {width} does not split into heads of {head_dim}")
            kv_heads = width // head_dim
        if kv_heads < 1 or heads % kv_heads:
            raise NotAttention(qk.name, f"{kv_heads} KV head(s) do not divide {heads} query heads")
        return heads, kv_heads, head_dim

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
