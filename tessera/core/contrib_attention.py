"""onnxruntime's fused attention operators (``com.microsoft`` ``MultiHeadAttention`` and ``Attention``)
as the standard operators they compute: heads split by Reshape and Transpose, scale·Q·Kᵀ, the additive
masks and biases, a causal mask from position ranges when ``unidirectional``, Softmax, ·V. The cp
recognizer then reads the core as it reads any exporter's (by evaluating the score path). Forms with a
KV cache input (``past_*``), packed inputs or a 1-D ``mask_index`` are left in place and refused
by the checker, naming the node."""

from __future__ import annotations

import math

import onnx

from tessera.core.node_writer import NodeWriter, attributes, padded_inputs


def heads_first(w: NodeWriter, x: str, heads: int, perm: list[int]) -> str:
    """``[B, S, heads·D]`` → ``[B, heads, S, D]`` (perm [0, 2, 1, 3]) or ``[B, heads, D, S]``."""
    split = w.op("Reshape", [x, w.ints([0, 0, heads, -1], "heads")])
    return w.op("Transpose", [split], perm=perm)


def _as_float(w: NodeWriter, x: str, like: str) -> str:
    """``x`` cast to ``like``'s element type (known from inference: no edge from ``like``)."""
    if (elem := w.dtypes.get(like)) is not None:
        return w.op("Cast", [x], to=elem)
    return w.op("CastLike", [x, like]) if w.opset >= 15 else w.op("Cast", [x], to=onnx.TensorProto.FLOAT)


def _padding_bias(w: NodeWriter, mask: str, like: str, filter_value: float) -> str:
    """A raw 0/1 key mask ``[B, T]`` (or ``[B, S, T]``) as the additive bias onnxruntime makes of it:
    ``(1 − mask) · mask_filter_value``, broadcast over heads (and queries)."""
    dropped = w.op("Sub", [w.const(1.0, like), _as_float(w, mask, like)])
    bias = w.op("Mul", [dropped, w.const(filter_value, like)])
    return w.unsqueeze(bias, [1, 2]) if len(w.shapes[mask]) == 2 else w.unsqueeze(bias, [1])


def _mask_ok(shapes: dict[str, list[int | None]], mask: str) -> bool:
    """No mask, or a raw key mask of known rank 2 or 3 (a 1-D ``mask_index`` of end positions: no)."""
    return not mask or len(shapes.get(mask) or ()) in (2, 3)


def last_width(shapes: dict[str, list[int | None]], tensor: str) -> int | None:
    dims = shapes.get(tensor)
    return dims[-1] if dims and isinstance(dims[-1], int) else None


def _core(
    w: NodeWriter, q: str, k: str, v: str, a: dict, biases: list[str], mask: str, q_width: int | None
) -> None:
    """Attention of 3-D ``q``, ``k``, ``v`` (Q ``q_width`` wide, when known) into the node's first
    output."""
    heads = int(a["num_heads"])
    like = w.node.input[0]  # the query or the packed input: the data's element type
    q4 = heads_first(w, q, heads, [0, 2, 1, 3])
    k4 = heads_first(w, k, heads, [0, 2, 3, 1])
    v4 = heads_first(w, v, heads, [0, 2, 1, 3])
    scale = a.get("scale")
    if not scale and q_width:
        scale = 1 / math.sqrt(q_width // heads)  # the default, 1/√head_size
    if scale:
        factor = w.const(float(scale), like)
    else:  # the same, of the head size the graph computes
        factor = w.op("Div", [w.const(1.0, like), w.op("Sqrt", [_as_float(w, w.dim(q4, 3), like)])])
    scores = w.op("Mul", [w.op("MatMul", [q4, k4]), factor])
    for bias in biases:
        scores = w.op("Add", [scores, bias])
    if mask:
        scores = w.op(
            "Add", [scores, _padding_bias(w, mask, like, float(a.get("mask_filter_value", -10000.0)))]
        )
    if a.get("unidirectional", 0):
        s, t = w.dim(q, 1), w.dim(k, 1)
        zero, one = w.ints(0, "zero"), w.ints(1, "one")
        rows = w.op("Add", [w.unsqueeze(w.op("Range", [zero, s, one]), [1]), w.op("Sub", [t, s])])
        future = w.op("Greater", [w.op("Range", [zero, t, one]), rows])
        scores = w.op("Where", [future, w.const(-math.inf, like), scores])
    probs = w.op("Softmax", [scores], axis=-1)
    out = w.op("Transpose", [w.op("MatMul", [probs, v4])], perm=[0, 2, 1, 3])
    w.op("Reshape", [out, w.ints([0, 0, -1], "merge")], w.node.output[0])


# The attributes each lowering reproduces; a node with any other (rotary, a shared cache buffer, …)
# is left in place and refused, never lowered without it.
MHA_ATTRIBUTES = {"num_heads", "scale", "unidirectional", "mask_filter_value"}
ATTENTION_ATTRIBUTES = MHA_ATTRIBUTES | {"qkv_hidden_sizes"}


def three_d(shapes: dict[str, list[int | None]], *tensors: str) -> bool:
    return all(len(shapes.get(t) or ()) == 3 for t in tensors)


def multi_head_attention_lowerable(node: onnx.NodeProto, shapes: dict[str, list[int | None]]) -> bool:
    """3-D Q, K and V (not packed, not a head-major past), no past or cache indirection, a raw key
    mask, a bias whose three parts have known widths, and no attribute the lowering would drop."""
    q, k, v, bias, mask = padded_inputs(node)[:5]
    widths = [last_width(shapes, t) for t in (q, k, v)]
    known = not bias or all(widths)
    plain = set(attributes(node)) <= MHA_ATTRIBUTES and three_d(shapes, q, k, v)
    return plain and not any(padded_inputs(node)[6:]) and _mask_ok(shapes, mask) and known


def lower_multi_head_attention(w: NodeWriter, a: dict) -> None:
    """``MultiHeadAttention(query, key, value, bias?, key_padding_mask?, attention_bias?)``."""
    q, k, v, bias, mask, attention_bias = padded_inputs(w.node)[:6]
    q_width = last_width(w.shapes, q)
    if bias:
        sizes = [last_width(w.shapes, t) or 0 for t in (q, k, v)]
        bq, bk, bv = w.split_last(bias, sizes)
        q, k, v = (w.op("Add", [t, b]) for t, b in ((q, bq), (k, bk), (v, bv)))
    _core(w, q, k, v, a, [attention_bias] if attention_bias else [], mask, q_width)


def attention_lowerable(node: onnx.NodeProto, shapes: dict[str, list[int | None]]) -> bool:
    """No past (nor its length), a raw key mask, and packed weights of a known width."""
    x = padded_inputs(node)
    plain = set(attributes(node)) <= ATTENTION_ATTRIBUTES and three_d(shapes, x[0])
    return (
        plain
        and not x[4]
        and not any(x[6:])
        and _mask_ok(shapes, x[3])
        and last_width(shapes, x[1]) is not None
    )


def lower_attention(w: NodeWriter, a: dict) -> None:
    """``Attention(input, weights, bias?, mask_index?, past?, attention_bias?)``: one product with the
    packed Q|K|V weights, split by ``qkv_hidden_sizes`` (thirds by default)."""
    x, weights, bias, mask, _, attention_bias = padded_inputs(w.node)[:6]
    packed = w.op("MatMul", [x, weights])
    if bias:
        packed = w.op("Add", [packed, bias])
    sizes = list(a.get("qkv_hidden_sizes") or [(last_width(w.shapes, weights) or 0) // 3] * 3)
    q, k, v = w.split_last(packed, sizes)
    _core(w, q, k, v, a, [attention_bias] if attention_bias else [], mask, sizes[0])
