"""onnxruntime's fused operators, written back as standard ONNX at load.

onnxruntime's transformer optimizer (``onnxruntime.transformers.optimizer.optimize_model``) fuses a
model's layer norms, activations and attention into its own operators (``com.microsoft``
``SkipLayerNormalization``, ``FastGelu``, ``MultiHeadAttention``, …, and ``SimplifiedLayerNormalization``
in the default domain), which have no ONNX schema: shape inference, FLOP counting and tessera's executor
do not know them. Each is replaced by the standard operators it is defined as, keeping its output names,
so an optimized model loads like the model it was made from (attention: ``core/contrib_attention.py``).
A fused operator tessera does not know, or a form it does not lower, is left in place and refused by the
checker with its name. Definitions: docs/usage.md ("Loading models from the wild").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx

from tessera.core.cache_inputs import PAST_INPUTS
from tessera.core.contrib_attention import (
    ATTENTION_ATTRIBUTES,
    MHA_ATTRIBUTES,
    attention_lowerable,
    lower_attention,
    lower_multi_head_attention,
    multi_head_attention_lowerable,
)
from tessera.core.contrib_gqa import (
    GQA_ATTRIBUTES,
    group_query_attention_lowerable,
    lower_group_query_attention,
)
from tessera.core.node_writer import NodeWriter, attributes, padded_inputs

MS = "com.microsoft"


def _inputs(node: onnx.NodeProto) -> list[str]:
    return padded_inputs(node)[:6]


def _skip_sum(w: NodeWriter, x: str, skip: str, bias: str) -> str:
    """input + skip (+ bias), named as the fused node's fourth output where the graph reads it."""
    outs = list(w.node.output)
    named = outs[3] if len(outs) > 3 and outs[3] else None
    return w.add_all([t for t in (x, skip, bias) if t], named)


def _layer_norm(w: NodeWriter, x: str, gamma: str, beta: str, eps: float, out: str) -> None:
    if w.opset >= 17:
        w.op("LayerNormalization", [x, gamma, *([beta] if beta else [])], out, axis=-1, epsilon=eps)
        return
    centred = w.op("Sub", [x, w.mean_last(x)])
    _scale_by_rms(w, centred, gamma, eps, beta, out)


def _scale_by_rms(w: NodeWriter, x: str, gamma: str, eps: float, beta: str, out: str) -> None:
    """``x / sqrt(mean(x²) + eps) · gamma (+ beta)``."""
    var = w.mean_last(w.op("Mul", [x, x]))
    norm = w.op("Div", [x, w.op("Sqrt", [w.op("Add", [var, w.const(eps, x)])])])
    if beta:
        w.op("Add", [w.op("Mul", [norm, gamma]), beta], out)
    else:
        w.op("Mul", [norm, gamma], out)


def _skip_layer_norm(w: NodeWriter, attrs: dict) -> None:
    x, skip, gamma, beta, bias = _inputs(w.node)[:5]
    s = _skip_sum(w, x, skip, bias)
    _layer_norm(w, s, gamma, beta, float(attrs.get("epsilon", 1e-12)), w.node.output[0])


def _skip_rms_norm(w: NodeWriter, attrs: dict) -> None:
    x, skip, gamma, bias = _inputs(w.node)[:4]
    s = _skip_sum(w, x, skip, bias)
    _scale_by_rms(w, s, gamma, float(attrs.get("epsilon", 1e-12)), "", w.node.output[0])


def _rms_norm(w: NodeWriter, attrs: dict) -> None:
    x, gamma = _inputs(w.node)[:2]
    _scale_by_rms(w, x, gamma, float(attrs.get("epsilon", 1e-5)), "", w.node.output[0])


def _biased(w: NodeWriter) -> str:
    x, bias = _inputs(w.node)[:2]
    return w.op("Add", [x, bias]) if bias else x


def _gelu_erf(w: NodeWriter, _attrs: dict) -> None:
    """``0.5·x·(1 + erf(x/√2))`` of x (+ bias): Gelu, BiasGelu."""
    x = _biased(w)
    erf = w.op("Erf", [w.op("Mul", [x, w.const(1 / math.sqrt(2), x)])])
    half = w.op("Mul", [x, w.const(0.5, x)])
    w.op("Mul", [half, w.op("Add", [erf, w.const(1.0, x)])], w.node.output[0])


def _gelu_tanh(w: NodeWriter, _attrs: dict) -> None:
    """``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`` of x (+ bias): FastGelu."""
    x = _biased(w)
    cube = w.op("Mul", [w.op("Mul", [x, x]), x])
    inner = w.op("Add", [x, w.op("Mul", [cube, w.const(0.044715, x)])])
    tanh = w.op("Tanh", [w.op("Mul", [inner, w.const(math.sqrt(2 / math.pi), x)])])
    half = w.op("Mul", [x, w.const(0.5, x)])
    w.op("Mul", [half, w.op("Add", [tanh, w.const(1.0, x)])], w.node.output[0])


def _quick_gelu(w: NodeWriter, attrs: dict) -> None:
    """``x·sigmoid(alpha·x)``."""
    x = _inputs(w.node)[0]
    scaled = w.op("Mul", [x, w.const(float(attrs.get("alpha", 1.702)), x)])
    w.op("Mul", [x, w.op("Sigmoid", [scaled])], w.node.output[0])


def _bias_add(w: NodeWriter, _attrs: dict) -> None:
    x, bias, skip = _inputs(w.node)[:3]
    w.add_all([x, bias, skip], w.node.output[0])


# (domain, op type) → (writer, how many leading outputs it defines: the rest must go unread)
LOWERED: dict[tuple[str, str], tuple[Callable[[NodeWriter, dict], None], int]] = {
    (MS, "SkipLayerNormalization"): (_skip_layer_norm, 1),
    (MS, "SkipSimplifiedLayerNormalization"): (_skip_rms_norm, 1),
    ("", "SimplifiedLayerNormalization"): (_rms_norm, 1),
    (MS, "Gelu"): (_gelu_erf, 1),
    (MS, "BiasGelu"): (_gelu_erf, 1),
    (MS, "FastGelu"): (_gelu_tanh, 1),
    (MS, "QuickGelu"): (_quick_gelu, 1),
    (MS, "BiasAdd"): (_bias_add, 1),
    (MS, "MultiHeadAttention"): (lower_multi_head_attention, 1),
    (MS, "Attention"): (lower_attention, 1),
    (MS, "GroupQueryAttention"): (lower_group_query_attention, 1),
}
_SKIP_SUM = 3  # SkipLayerNormalization's input + skip + bias output, written by _skip_sum
# The fused operators that lower only in some forms (no KV cache input, shapes known).
_FORMS = {
    (MS, "MultiHeadAttention"): multi_head_attention_lowerable,
    (MS, "Attention"): attention_lowerable,
    (MS, "GroupQueryAttention"): group_query_attention_lowerable,
}
Shapes = dict[str, list[int | None]]
_FORM_ATTRIBUTES = {
    "MultiHeadAttention": MHA_ATTRIBUTES, "Attention": ATTENTION_ATTRIBUTES, "GroupQueryAttention": GQA_ATTRIBUTES,
}  # fmt: skip


# The attributes each norm and activation lowering reproduces (the attention ones: _FORMS).
_ATTRIBUTES = {
    "SkipLayerNormalization": {"epsilon"},
    "SkipSimplifiedLayerNormalization": {"epsilon"},
    "SimplifiedLayerNormalization": {"epsilon", "axis", "stash_type"},
    "QuickGelu": {"alpha"},
}


def _plain(node: onnx.NodeProto) -> bool:
    """No attribute the lowering would drop, and a norm over the last axis only."""
    attrs = attributes(node)
    return set(attrs) <= _ATTRIBUTES.get(node.op_type, set()) and attrs.get("axis", -1) == -1


def _lowerable(node: onnx.NodeProto, read: set[str], shapes: Shapes) -> bool:
    key = (_domain(node), node.op_type)
    if (found := LOWERED.get(key)) is None:
        return False
    if not (_FORMS[key](node, shapes) if key in _FORMS else _plain(node)):
        return False
    defined = {0, _SKIP_SUM} if node.op_type.startswith("Skip") else set(range(found[1]))
    return all(i in defined or not out or out not in read for i, out in enumerate(node.output))


def why_left(node: onnx.NodeProto) -> str | None:
    """Why a fused operator tessera lowers in other forms was left in place; None for other ops."""
    key = (_domain(node), node.op_type)
    if key not in LOWERED:
        return None
    inputs = padded_inputs(node)
    past = [inputs[i] for i in PAST_INPUTS.get(node.op_type, ()) if inputs[i]]
    if past:
        return (
            f"its KV cache input {past[0]!r} is not a graph input of free past length (tessera runs a "
            "graph's own cache only bound empty, and keeps its own)"
        )
    attrs = attributes(node)
    allowed = _ATTRIBUTES.get(node.op_type, set()) | _FORM_ATTRIBUTES.get(node.op_type, set())
    if extra := sorted(set(attrs) - allowed):
        return f"its attribute(s) {', '.join(extra)} are not reproduced by tessera's standard-ONNX form"
    if node.op_type not in _FORM_ATTRIBUTES:
        if attrs.get("axis", -1) != -1:
            return f"it normalizes over axis {attrs['axis']} (tessera writes back norms over the last axis)"
        return "an output besides its result is read (a norm's mean or inverse deviation)"
    return "its form (packed or head-major inputs, a 1-D mask index, unknown widths, extra inputs) is not lowered"


def _shapes(model: onnx.ModelProto) -> tuple[Shapes, dict[str, int]]:
    """Every tensor's dims and element type that ONNX inference finds before lowering (the fused
    operators' inputs)."""
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - too large or not inferable here: declared shapes only
        pass
    g = model.graph
    shapes: Shapes = {t.name: [int(d) for d in t.dims] for t in g.initializer}
    dtypes = {t.name: t.data_type for t in g.initializer}
    for vi in (*g.input, *g.value_info, *g.output):
        if not vi.type.HasField("tensor_type"):
            continue
        if vi.type.tensor_type.elem_type:
            dtypes[vi.name] = vi.type.tensor_type.elem_type
        if vi.type.tensor_type.HasField("shape"):
            dims = vi.type.tensor_type.shape.dim
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    return shapes, dtypes


def _domain(node: onnx.NodeProto) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def lower_contrib_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every onnxruntime fused operator of :data:`LOWERED` written as standard ONNX
    (the same object, unchanged, when it has none). In rounds: shapes behind a fused operator are
    known to ONNX inference only once it is lowered, and an attention lowering needs them."""
    graph = model.graph
    read = {t for n in graph.node for t in n.input} | {o.name for o in graph.output}
    if not any((_domain(n), n.op_type) in LOWERED for n in graph.node):
        return model
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    while _lower_round(model, read, opset):
        pass
    used = {n.domain for n in graph.node}
    kept = [o for o in model.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return model


def _lower_round(model: onnx.ModelProto, read: set[str], opset: int) -> bool:
    """Lower every fused operator lowerable with the shapes known now; False when none was."""
    graph = model.graph
    if not any((_domain(n), n.op_type) in LOWERED for n in graph.node):
        return False
    shapes, dtypes = _shapes(model)
    if not any(_lowerable(n, read, shapes) for n in graph.node):
        return False
    taken = {n.name for n in graph.node} | {t for n in graph.node for t in (*n.input, *n.output)}
    taken |= {t.name for t in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if not _lowerable(node, read, shapes):
            nodes.append(node)
            continue
        writer = NodeWriter(node, opset, taken, shapes, dtypes)
        LOWERED[(_domain(node), node.op_type)][0](writer, attributes(node))
        nodes.extend(writer.nodes)
        graph.initializer.extend(writer.initializers)
    del graph.node[:]
    graph.node.extend(nodes)
    return True
