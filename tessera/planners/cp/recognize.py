"""Recognize a decoder-only transformer in an ONNX graph and read its :class:`LlmConfig` off the weights.

By structure only: causal self-attention (a ``Softmax`` between the Q·Kᵀ and ·V ``MatMul``s, Q/K/V traced
through layout operators to projections of one tensor, a ``Trilu``-derived or triangular constant mask)
and an FFN between attentions. Sizes come from weight shapes; ``tessera.*`` metadata, when present, is
cross-checked.

References: thesis §4.4 (CP splits causal self-attention's KV cache). Matching rules: docs/cp.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from onnx import numpy_helper

from tessera.core.errors import InputError
from tessera.core.graph import Graph, OpNode
from tessera.planners.cp.llm import LlmConfig

__all__ = ["AttentionBlock", "position_limit", "recognize_llm"]

# Ops that only move or re-lay-out a projection's output on its way to Q·Kᵀ or ·V.
_LAYOUT_OPS = frozenset(
    {"Reshape", "Transpose", "Expand", "Squeeze", "Unsqueeze", "Identity", "Cast", "Add", "Mul", "Div"}
)
# Element-wise ops between Q·Kᵀ and Softmax (scale, mask).
_SCORE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Cast", "Identity"})
_NUMPY_TO_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp32"}


@dataclass(frozen=True)
class AttentionBlock:
    """One matched self-attention: its key nodes and the widths read from its weights."""

    softmax: str
    qk_matmul: str
    av_matmul: str
    projections: tuple[str, ...]  # the Q, K, V projection nodes (one if fused)
    out_projection: str | None
    hidden: int
    heads: int
    head_dim: int
    kv_dim: int
    causal: bool
    self_attention: bool
    dtype: str


class _Matcher:
    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.position = {name: i for i, name in enumerate(graph.order)}

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
        return None if info is None or info.shape is None else tuple(info.shape)

    def weight_of(self, op: OpNode) -> tuple[str, int, int] | None:
        """``(weight, in_dim, out_dim)`` when ``op`` is a MatMul/Gemm by a 2-D weight initializer."""
        if op.op_type not in ("MatMul", "Gemm") or len(op.inputs) < 2:
            return None
        weight = op.inputs[1]
        info = self.g.initializers.get(weight)
        if info is None or info.shape is None or len(info.shape) != 2:
            return None
        rows, cols = info.shape
        if op.op_type == "Gemm" and int(op.attributes.get("transB", 0)):
            rows, cols = cols, rows
        return weight, int(rows), int(cols)

    # -- attention ------------------------------------------------------------------------------

    def scores_source(self, tensor: str, depth: int = 0) -> tuple[OpNode | None, list[str]]:
        """Walk from Softmax's input back to the Q·Kᵀ MatMul; return it and the side operands seen."""
        op = self.producer(tensor)
        if op is None or depth > 8:
            return None, []
        if op.op_type == "MatMul" and self.weight_of(op) is None:
            return op, []
        if op.op_type not in _SCORE_OPS:
            return None, []
        operands = [t for t in (op.inputs[1:] if op.op_type == "Where" else op.inputs) if t]
        for t in operands:
            if self.is_constant(t):
                continue
            found, side = self.scores_source(t, depth + 1)
            if found is not None:
                return found, side + [x for x in op.inputs if x and x != t]
        return None, []

    def trace_projection(self, tensor: str) -> tuple[OpNode | None, int | None]:
        """From Q, K or V at the attention core back to its projection; also the projected width."""
        width: int | None = None
        for _ in range(16):
            op = self.producer(tensor)
            if op is None:
                return None, width
            if self.weight_of(op) is not None:
                shape = self.shape(op.outputs[0])
                return op, width if width is not None else (shape[-1] if shape else None)
            if op.op_type == "Split":
                shape = self.shape(tensor)
                width = shape[-1] if shape else None
                tensor = op.inputs[0]
                continue
            if op.op_type == "Concat":  # a KV cache: [past; new] along the sequence
                live = [t for t in op.inputs if t and t not in self.g.inputs and not self.is_constant(t)]
                if len(live) != 1:
                    return None, width
                tensor = live[0]
                continue
            if op.op_type not in _LAYOUT_OPS:
                return None, width
            live = [t for t in op.inputs if t and not self.is_constant(t)]
            if len(live) != 1:
                return None, width
            tensor = live[0]
        return None, width

    def is_causal_mask(self, tensor: str) -> bool:
        """True when ``tensor`` is (or derives, through constant ops, from) a causal mask."""
        queue: deque[tuple[str, int]] = deque([(tensor, 0)])
        seen: set[str] = set()
        while queue:
            t, depth = queue.popleft()
            if t in seen or depth > 6:
                continue
            seen.add(t)
            if t in self.g.initializers:
                if _is_triangular_mask(self._initializer_array(t)):
                    return True
                continue
            op = self.producer(t)
            if op is None:
                continue
            if op.op_type == "Trilu":
                return True
            if op.op_type == "Constant":
                value = op.attributes.get("value")
                array = _to_array(value)
                if array is not None and _is_triangular_mask(array):
                    return True
            queue.extend((x, depth + 1) for x in op.inputs if x)
        return False

    def _initializer_array(self, name: str) -> np.ndarray | None:
        for t in self.g.model.graph.initializer:
            if t.name == name:
                return _to_array(t)
        return None

    def out_projection(self, tensor: str) -> OpNode | None:
        """From the attention core's output forward through layout ops to the output projection."""
        for _ in range(8):
            consumers = self.g.consumers.get(tensor, ())
            if len(consumers) != 1:
                return None
            op = self.g.op(consumers[0])
            if self.weight_of(op) is not None:
                return op
            if op.op_type not in ("Reshape", "Transpose", "Identity", "Cast"):
                return None
            tensor = op.outputs[0]
        return None

    def attention_blocks(self) -> list[AttentionBlock]:
        blocks: list[AttentionBlock] = []
        for op in self.g.ops():
            if op.op_type != "Softmax":
                continue
            qk, side = self.scores_source(op.inputs[0])
            if qk is None:
                continue
            av = next(
                (
                    self.g.op(c)
                    for c in self.g.consumers.get(op.outputs[0], ())
                    if self.g.op(c).op_type == "MatMul" and self.g.op(c).inputs[0] == op.outputs[0]
                ),
                None,
            )
            if av is None:
                continue
            q_proj, q_width = self.trace_projection(qk.inputs[0])
            k_proj, kv_width = self.trace_projection(qk.inputs[1])
            v_proj, v_width = self.trace_projection(av.inputs[1])
            q_shape = self.shape(qk.inputs[0])
            if None in (q_proj, k_proj, v_proj) or not q_shape or not q_width or not kv_width:
                continue
            assert q_proj is not None and k_proj is not None and v_proj is not None
            q_weight = self.weight_of(q_proj)
            assert q_weight is not None
            head_dim = int(q_shape[-1])
            sources = {p.inputs[0] for p in (q_proj, k_proj, v_proj)}
            out = self.out_projection(av.outputs[0])
            blocks.append(
                AttentionBlock(
                    softmax=op.name,
                    qk_matmul=qk.name,
                    av_matmul=av.name,
                    projections=tuple(dict.fromkeys(p.name for p in (q_proj, k_proj, v_proj))),
                    out_projection=None if out is None else out.name,
                    hidden=q_weight[1],
                    heads=int(q_width) // head_dim if head_dim else 0,
                    head_dim=head_dim,
                    kv_dim=int(kv_width),
                    causal=any(self.is_causal_mask(t) for t in side if not _is_scalar(self, t)),
                    self_attention=len(sources) == 1,
                    dtype=_NUMPY_TO_DTYPE.get(self.g.initializers[q_weight[0]].dtype, "fp32"),
                )
            )
        return blocks

    # -- FFN and vocabulary ---------------------------------------------------------------------

    def ffn_after(self, block: AttentionBlock, stop: int) -> tuple[int, bool] | None:
        """``(F, gated)`` of the FFN between ``block``'s output projection and position ``stop``."""
        start = self.position[block.out_projection or block.av_matmul]
        hidden = block.hidden
        ups: dict[int, list[str]] = {}  # F -> the tensors E×F projections read
        downs: set[int] = set()
        for name in self.g.order[start + 1 : stop]:
            op = self.g.op(name)
            w = self.weight_of(op)
            if w is None:
                continue
            _, rows, cols = w
            if rows == hidden:
                ups.setdefault(cols, []).append(op.inputs[0])
            if cols == hidden:
                downs.add(rows)
        widths = sorted(f for f in ups if f in downs)
        if not widths:
            return None
        ffn = widths[-1]
        # Gated (SwiGLU): gate and up projections read the same tensor (an LM head reads another).
        readers = ups[ffn]
        return ffn, any(readers.count(t) >= 2 for t in readers)

    def vocab(self, hidden: int, after: int) -> tuple[int | None, bool]:
        """``(vocab, tied)``: from the token embedding Gather, else the LM head after ``after``."""
        embedding = None
        for op in self.g.ops():
            if op.op_type != "Gather" or len(op.inputs) < 2:
                continue
            info = self.g.initializers.get(op.inputs[0])
            if info is None or info.shape is None or len(info.shape) != 2 or info.shape[1] != hidden:
                continue
            if op.inputs[1] in self.g.inputs:
                embedding = (op.inputs[0], int(info.shape[0]))
                break
        head = None
        for name in self.g.order[after + 1 :]:
            w = self.weight_of(self.g.op(name))
            if w is not None and w[1] == hidden:
                head = w
        if head is not None:
            tied = embedding is not None and head[0] == embedding[0]
            return head[2], tied
        if embedding is not None:
            return embedding[1], True
        return None, False


def position_limit(graph: Graph, hidden: int) -> int | None:
    """Rows of the model's learned position table: the positions a request may hold (prompt and
    generated tokens fed back). The table is a ``Gather`` from an initializer ``[P, hidden]`` other
    than the token embedding (the one indexed by a graph input, as :meth:`_Matcher.vocab` finds
    it); None when there is none (rotary or sinusoidal positions have no table to run past)."""
    tables: list[tuple[str, int, bool]] = []  # (table, rows, indexed by a graph input)
    for op in graph.ops():
        if op.op_type != "Gather" or len(op.inputs) < 2:
            continue
        info = graph.initializers.get(op.inputs[0])
        if info is None or info.shape is None or len(info.shape) != 2 or info.shape[1] != hidden:
            continue
        tables.append((op.inputs[0], int(info.shape[0]), op.inputs[1] in graph.inputs))
    token = next((table for table, _, from_input in tables if from_input), None)
    rows = [n for table, n, _ in tables if table != token]
    return min(rows) if rows else None


def _is_scalar(m: _Matcher, tensor: str) -> bool:
    shape = m.shape(tensor)
    return shape is not None and int(np.prod(shape, dtype=np.int64)) <= 1


def _to_array(value: object) -> np.ndarray | None:
    try:
        return numpy_helper.to_array(value)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - lazy/external data or not a tensor: not a mask we can read
        return np.asarray(value) if isinstance(value, np.ndarray) else None


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


def recognize_llm(graph: Graph, *, name: str | None = None) -> LlmConfig:  # noqa: C901
    """The :class:`LlmConfig` of a decoder-only transformer ONNX model.

    Raises :class:`InputError` (exit 2) saying why when the graph is not one: no attention, no causal
    mask (an encoder such as BERT), cross-attention, no FFN, layers of different sizes, or metadata
    that contradicts the weights.
    """
    m = _Matcher(graph)
    softmaxes = sum(1 for op in graph.ops() if op.op_type == "Softmax")
    blocks = m.attention_blocks()
    label = graph.source
    if not blocks:
        why = (
            "no Softmax"
            if not softmaxes
            else f"{softmaxes} Softmax op(s), none between a Q·Kᵀ MatMul and a MatMul with V "
            "whose Q, K, V come from weight projections"
        )
        raise InputError(f"not a decoder-only transformer: no self-attention found ({why})", source=label)
    non_causal = [b for b in blocks if not b.causal]
    if len(non_causal) == len(blocks):
        raise InputError(
            f"not a decoder-only transformer: no causal self-attention found ({len(blocks)} attention "
            f"block(s), none with a causal mask; an encoder such as BERT?)",
            source=label,
        )
    if non_causal:
        raise InputError(
            f"not a decoder-only transformer: {len(non_causal)} of {len(blocks)} attention blocks have no "
            f"causal mask (first: {non_causal[0].softmax}; an encoder-decoder?)",
            source=label,
        )
    cross = [b for b in blocks if not b.self_attention]
    if cross:
        raise InputError(
            f"not a decoder-only transformer: attention {cross[0].softmax} takes Q and K/V from different "
            "tensors (cross-attention)",
            source=label,
        )
    ffns: list[tuple[int, bool]] = []
    for i, block in enumerate(blocks):
        stop = m.position[blocks[i + 1].projections[0]] if i + 1 < len(blocks) else len(graph.order)
        found = m.ffn_after(block, stop)
        if found is None:
            raise InputError(
                f"not a decoder-only transformer: attention {block.softmax} has no feed-forward block "
                f"after it (a MatMul {block.hidden}×F then F×{block.hidden})",
                source=label,
            )
        ffns.append(found)
    first = blocks[0]
    for i, (block, ffn) in enumerate(zip(blocks, ffns, strict=True)):
        shape = (block.hidden, block.heads, block.head_dim, block.kv_dim, *ffn)
        if shape != (first.hidden, first.heads, first.head_dim, first.kv_dim, *ffns[0]):
            raise InputError(
                f"layers differ in size: layer {i} ({block.softmax}) has hidden, heads, head_dim, kv width, "
                f"ffn, gated = {shape}, layer 0 has "
                f"{(first.hidden, first.heads, first.head_dim, first.kv_dim, *ffns[0])}",
                source=label,
            )
    if first.heads < 1 or first.kv_dim % first.head_dim or first.heads % (first.kv_dim // first.head_dim):
        raise InputError(
            f"attention widths do not split into heads: Q width {first.heads * first.head_dim}, "
            f"K width {first.kv_dim}, head_dim {first.head_dim}",
            source=label,
        )
    last_ffn = m.position[blocks[-1].out_projection or blocks[-1].av_matmul]
    vocab, tied = m.vocab(first.hidden, last_ffn)
    if vocab is None:
        raise InputError(
            "cannot read the vocabulary size: no token-embedding Gather and no LM head", source=label
        )
    meta = {p.key: p.value for p in graph.model.metadata_props}
    found = {
        "layers": len(blocks),
        "hidden": first.hidden,
        "heads": first.heads,
        "kv_heads": first.kv_dim // first.head_dim,
        "head_dim": first.head_dim,
        "ffn": ffns[0][0],
        "vocab": vocab,
    }
    for key, value in found.items():
        given = meta.get(f"tessera.{key}")
        if given is not None and given.strip().isdigit() and int(given) != value:
            raise InputError(
                f"metadata tessera.{key}={given} disagrees with the graph's structure, which gives {value}",
                source=label,
            )
    model_name = name or meta.get("tessera.model") or graph.model.graph.name or "onnx-model"
    return LlmConfig(
        name=model_name,
        dtype=first.dtype,  # type: ignore[arg-type]
        gated_ffn=ffns[0][1],
        tied_embeddings=tied,
        **found,
    )
