"""onnxruntime's ``GroupQueryAttention`` (``com.microsoft``; what onnxruntime-genai's model builder
writes) as the standard operators it computes, once its past is empty (``core/cache_inputs.py``):
heads split, rotary from the cos/sin caches at positions 0..S-1 (halves or interleaved pairs, the
whole head or a leading part), KV heads repeated to the query heads, scale·Q·Kᵀ, soft-capping, the
causal mask with its local window and the keys past ``seqlens_k`` hidden, Softmax, ·V. Forms it does
not reproduce (a past, ``smooth_softmax``, position ids, an attention bias, a head sink) stay in
place and are refused by the checker, naming the node."""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx

from tessera.core.cache_inputs import PAST_INPUTS
from tessera.core.contrib_attention import heads_first, last_width, three_d
from tessera.core.node_writer import NodeWriter, attributes, padded_inputs

GQA_ATTRIBUTES = {
    "num_heads", "kv_num_heads", "scale", "softcap", "local_window_size", "do_rotary", "rotary_interleaved",
}  # fmt: skip
_EXTRAS = 9  # position_ids, attention_bias, head_sink onwards


def group_query_attention_lowerable(node: onnx.NodeProto, shapes: dict[str, list[int | None]]) -> bool:
    """No past, 3-D Q (and K, V unless packed) of known width, the rotary caches' widths known when
    ``do_rotary``, and no input or attribute the lowering would drop."""
    x, a = padded_inputs(node), attributes(node)
    if (
        not set(a) <= GQA_ATTRIBUTES
        or any(x[i] for i in PAST_INPUTS[node.op_type])
        or any(x[_EXTRAS:])
        or not x[5]
    ):
        return False
    rotary = not a.get("do_rotary") or (bool(x[7] and x[8]) and last_width(shapes, x[7]) is not None)
    separate = bool(x[1]) and bool(x[2])
    return (
        rotary
        and (separate or not (x[1] or x[2]))
        and three_d(shapes, *(t for t in x[:3] if t))
        and last_width(shapes, x[0]) is not None
    )


def lower_group_query_attention(w: NodeWriter, a: dict) -> None:
    """``GroupQueryAttention(query, key?, value?, past_key?, past_value?, seqlens_k,
    total_sequence_length, cos_cache?, sin_cache?)`` with no past."""
    q, k, v, _, _, seqlens, _, cos, sin = padded_inputs(w.node)[:9]
    heads, kv_heads = int(a["num_heads"]), int(a["kv_num_heads"])
    width = last_width(w.shapes, q) or 0
    if k:
        head = width // heads
    else:  # one packed input: Q | K | V
        head = width // (heads + 2 * kv_heads)
        q, k, v = w.split_last(q, [heads * head, kv_heads * head, kv_heads * head])
    q4 = heads_first(w, q, heads, [0, 2, 1, 3])
    k4 = heads_first(w, k, kv_heads, [0, 2, 1, 3])
    v4 = heads_first(w, v, kv_heads, [0, 2, 1, 3])
    if a.get("do_rotary"):
        positions = w.op("Range", [w.ints(0, "zero"), w.dim(q, 1), w.ints(1, "one")])
        half = last_width(w.shapes, cos) or 0
        turn = _Rotary(w, w.op("Gather", [cos, positions]), w.op("Gather", [sin, positions]), half, head)
        rotate = turn.pairs if a.get("rotary_interleaved") else turn.halves
        q4, k4 = rotate(q4), rotate(k4)
    if heads != kv_heads:
        k4, v4 = (_repeated(w, t, heads // kv_heads, heads) for t in (k4, v4))
    like = w.node.input[0]
    scale = float(a.get("scale") or 1 / math.sqrt(head))
    scores = w.op(
        "Mul", [w.op("MatMul", [q4, w.op("Transpose", [k4], perm=[0, 1, 3, 2])]), w.const(scale, like)]
    )
    if cap := float(a.get("softcap") or 0.0):
        capped = w.op("Tanh", [w.op("Div", [scores, w.const(cap, like)])])
        scores = w.op("Mul", [capped, w.const(cap, like)])
    hidden = _hidden(w, q, seqlens, int(a.get("local_window_size", -1)))
    scores = w.op("Where", [hidden, w.const(-math.inf, like), scores])
    probs = w.op("Softmax", [scores], axis=-1)
    probs = w.op("Where", [w.op("IsNaN", [probs]), w.const(0.0, like), probs])  # no key seen: zeros
    out = w.op("MatMul", [probs, v4])
    merged = w.op("Transpose", [out], perm=[0, 2, 1, 3])
    w.op("Reshape", [merged, w.ints([0, 0, -1], "merge")], w.node.output[0])


class _Rotary:
    """Rotary embedding of ``[B, H, S, D]`` by ``cos``/``sin`` ``[S, half]`` gathered at the
    positions, written as transformers writes it (x·cos + rotate(x)·sin, the rotation a Concat with
    the negated part): the first ``2·half`` of each head turned, the rest passed through."""

    def __init__(self, w: NodeWriter, cos: str, sin: str, half: int, head: int) -> None:
        self.w, self.cos, self.sin, self.half, self.head = w, cos, sin, half, head

    def _turned(self, x: str, rotated: str, cos: str, sin: str) -> str:
        w = self.w
        return w.op("Add", [w.op("Mul", [x, cos]), w.op("Mul", [rotated, sin])])

    def _apply(self, x: str, turn: Callable[[str], str]) -> str:
        if 2 * self.half == self.head:
            return turn(x)
        turned, kept = self.w.split_last(x, [2 * self.half, self.head - 2 * self.half])
        return self.w.op("Concat", [turn(turned), kept], axis=-1)

    def halves(self, x: str) -> str:
        """GPT-NeoX's form: ``[-x2, x1]`` of the halves x1, x2, by the tables repeated twice."""

        def turn(part: str) -> str:
            w = self.w
            x1, x2 = w.split_last(part, [self.half, self.half])
            rotated = w.op("Concat", [w.op("Neg", [x2]), x1], axis=-1)
            cos, sin = (w.op("Concat", [t, t], axis=-1) for t in (self.cos, self.sin))
            return self._turned(part, rotated, cos, sin)

        return self._apply(x, turn)

    def pairs(self, x: str) -> str:
        """GPT-J's form: each even element x1 against the odd one x2 after it, ``(-x2, x1)`` stacked,
        by the tables repeated element by element."""

        def turn(part: str) -> str:
            w = self.w
            ends, axis, step = w.ints([2 * self.half], "end"), w.ints([-1], "axis"), w.ints([2], "step")
            x1 = w.op("Slice", [part, w.ints([0], "even"), ends, axis, step])
            x2 = w.op("Slice", [part, w.ints([1], "odd"), ends, axis, step])
            stacked = w.op("Concat", [w.unsqueeze(w.op("Neg", [x2]), [-1]), w.unsqueeze(x1, [-1])], axis=-1)
            rotated = w.op("Reshape", [stacked, w.ints([0, 0, 0, -1], "unpair")])
            cos, sin = (self._twice_each(t) for t in (self.cos, self.sin))
            return self._turned(part, rotated, cos, sin)

        return self._apply(x, turn)

    def _twice_each(self, table: str) -> str:
        """``[S, half]`` → ``[S, 2·half]``, each element repeated in place."""
        w = self.w
        column = w.unsqueeze(table, [-1])
        return w.op("Reshape", [w.op("Concat", [column, column], axis=-1), w.ints([0, -1], "flat")])


def _repeated(w: NodeWriter, x: str, times: int, heads: int) -> str:
    """``[B, kv, T, D]`` → ``[B, kv·times, T, D]``, query head h reading KV head h // times."""
    shape = w.op("Shape", [x])
    batch, rest = (
        w.op("Gather", [shape, w.ints([0], "batch")]),
        w.op("Gather", [shape, w.ints([2, 3], "rest")]),
    )
    grown = w.op("Concat", [batch, w.ints([heads // times, times], "groups"), rest], axis=0)
    expanded = w.op("Expand", [w.unsqueeze(x, [2]), grown])
    return w.op("Reshape", [expanded, w.op("Concat", [batch, w.ints([heads], "heads"), rest], axis=0)])


def _hidden(w: NodeWriter, q: str, seqlens: str, window: int) -> str:
    """The scores hidden from each query i: keys after i, keys up to ``i − window`` (a local window of
    ``window`` keys, i's own included), keys past ``seqlens_k`` (the last real one)."""
    zero, one = w.ints(0, "zero"), w.ints(1, "one")
    length = w.dim(q, 1)
    rows = w.unsqueeze(w.op("Range", [zero, length, one]), [1])
    keys = w.op("Range", [zero, length, one])
    hidden = w.op("Greater", [keys, rows])
    if window > 0:
        hidden = w.op("Or", [hidden, w.op("Less", [keys, w.op("Sub", [rows, w.ints(window - 1, "window")])])])
    last = w.unsqueeze(w.op("Cast", [seqlens], to=onnx.TensorProto.INT64), [1, 2, 3])
    return w.op("Or", [hidden, w.op("Greater", [keys, last])])
