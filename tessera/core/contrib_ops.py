"""onnxruntime's fused operators, written back as standard ONNX at load.

onnxruntime's transformer optimizer (``onnxruntime.transformers.optimizer.optimize_model``) fuses a
model's layer norms and activations into its own operators (``com.microsoft`` ``SkipLayerNormalization``,
``FastGelu``, …, and ``SimplifiedLayerNormalization`` in the default domain), which have no ONNX schema:
shape inference, FLOP counting and tessera's executor do not know them. Each is replaced by the standard
operators it is defined as, keeping its output names, so a user's optimized model loads like the model it
was made from. A fused operator tessera does not know, or one whose statistics outputs are read, is left
in place and refused by the checker with its name. Definitions: docs/usage.md ("Loading models from the wild").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS = "com.microsoft"


class _Writer:
    """Emits the standard nodes that replace one fused node: fresh names, scalar constants cast like
    the data (``CastLike`` from opset 15; fp32 constants before it)."""

    def __init__(self, node: onnx.NodeProto, opset: int, taken: set[str]) -> None:
        self.node, self.opset, self.taken = node, opset, taken
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def name(self, what: str) -> str:
        base = f"{self.node.name or self.node.op_type}/{what}"
        name, i = base, 0
        while name in self.taken:
            i += 1
            name = f"{base}_{i}"
        self.taken.add(name)
        return name

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: object) -> str:
        out = out or self.name(op_type)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.name(op_type), **attrs))
        return out

    def const(self, value: float, like: str) -> str:
        name = self.name("const")
        self.initializers.append(numpy_helper.from_array(np.array(value, np.float32), name))
        return self.op("CastLike", [name, like]) if self.opset >= 15 else name

    def mean_last(self, x: str) -> str:
        """The mean over the last axis, kept (ReduceMean's axes moved to an input at opset 18)."""
        if self.opset >= 18:
            axes = self.name("axes")
            self.initializers.append(numpy_helper.from_array(np.array([-1], np.int64), axes))
            return self.op("ReduceMean", [x, axes], keepdims=1)
        return self.op("ReduceMean", [x], axes=[-1], keepdims=1)

    def add_all(self, names: list[str], out: str | None = None) -> str:
        total = names[0]
        for i, other in enumerate(names[1:], 1):
            total = self.op("Add", [total, other], out if i == len(names) - 1 else None)
        return total


def _inputs(node: onnx.NodeProto) -> list[str]:
    return list(node.input) + [""] * 6


def _skip_sum(w: _Writer, x: str, skip: str, bias: str) -> str:
    """input + skip (+ bias), named as the fused node's fourth output where the graph reads it."""
    outs = list(w.node.output)
    named = outs[3] if len(outs) > 3 and outs[3] else None
    return w.add_all([t for t in (x, skip, bias) if t], named)


def _layer_norm(w: _Writer, x: str, gamma: str, beta: str, eps: float, out: str) -> None:
    if w.opset >= 17:
        w.op("LayerNormalization", [x, gamma, *([beta] if beta else [])], out, axis=-1, epsilon=eps)
        return
    centred = w.op("Sub", [x, w.mean_last(x)])
    _scale_by_rms(w, centred, gamma, eps, beta, out)


def _scale_by_rms(w: _Writer, x: str, gamma: str, eps: float, beta: str, out: str) -> None:
    """``x / sqrt(mean(x²) + eps) · gamma (+ beta)``."""
    var = w.mean_last(w.op("Mul", [x, x]))
    norm = w.op("Div", [x, w.op("Sqrt", [w.op("Add", [var, w.const(eps, x)])])])
    if beta:
        w.op("Add", [w.op("Mul", [norm, gamma]), beta], out)
    else:
        w.op("Mul", [norm, gamma], out)


def _skip_layer_norm(w: _Writer, attrs: dict) -> None:
    x, skip, gamma, beta, bias = _inputs(w.node)[:5]
    s = _skip_sum(w, x, skip, bias)
    _layer_norm(w, s, gamma, beta, float(attrs.get("epsilon", 1e-12)), w.node.output[0])


def _skip_rms_norm(w: _Writer, attrs: dict) -> None:
    x, skip, gamma, bias = _inputs(w.node)[:4]
    s = _skip_sum(w, x, skip, bias)
    _scale_by_rms(w, s, gamma, float(attrs.get("epsilon", 1e-12)), "", w.node.output[0])


def _rms_norm(w: _Writer, attrs: dict) -> None:
    x, gamma = _inputs(w.node)[:2]
    _scale_by_rms(w, x, gamma, float(attrs.get("epsilon", 1e-5)), "", w.node.output[0])


def _biased(w: _Writer) -> str:
    x, bias = _inputs(w.node)[:2]
    return w.op("Add", [x, bias]) if bias else x


def _gelu_erf(w: _Writer, _attrs: dict) -> None:
    """``0.5·x·(1 + erf(x/√2))`` of x (+ bias): Gelu, BiasGelu."""
    x = _biased(w)
    erf = w.op("Erf", [w.op("Mul", [x, w.const(1 / math.sqrt(2), x)])])
    half = w.op("Mul", [x, w.const(0.5, x)])
    w.op("Mul", [half, w.op("Add", [erf, w.const(1.0, x)])], w.node.output[0])


def _gelu_tanh(w: _Writer, _attrs: dict) -> None:
    """``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`` of x (+ bias): FastGelu."""
    x = _biased(w)
    cube = w.op("Mul", [w.op("Mul", [x, x]), x])
    inner = w.op("Add", [x, w.op("Mul", [cube, w.const(0.044715, x)])])
    tanh = w.op("Tanh", [w.op("Mul", [inner, w.const(math.sqrt(2 / math.pi), x)])])
    half = w.op("Mul", [x, w.const(0.5, x)])
    w.op("Mul", [half, w.op("Add", [tanh, w.const(1.0, x)])], w.node.output[0])


def _quick_gelu(w: _Writer, attrs: dict) -> None:
    """``x·sigmoid(alpha·x)``."""
    x = _inputs(w.node)[0]
    scaled = w.op("Mul", [x, w.const(float(attrs.get("alpha", 1.702)), x)])
    w.op("Mul", [x, w.op("Sigmoid", [scaled])], w.node.output[0])


def _bias_add(w: _Writer, _attrs: dict) -> None:
    x, bias, skip = _inputs(w.node)[:3]
    w.add_all([x, bias, skip], w.node.output[0])


# (domain, op type) → (writer, how many leading outputs it defines: the rest must go unread)
LOWERED: dict[tuple[str, str], tuple[Callable[[_Writer, dict], None], int]] = {
    (MS, "SkipLayerNormalization"): (_skip_layer_norm, 1),
    (MS, "SkipSimplifiedLayerNormalization"): (_skip_rms_norm, 1),
    ("", "SimplifiedLayerNormalization"): (_rms_norm, 1),
    (MS, "Gelu"): (_gelu_erf, 1),
    (MS, "BiasGelu"): (_gelu_erf, 1),
    (MS, "FastGelu"): (_gelu_tanh, 1),
    (MS, "QuickGelu"): (_quick_gelu, 1),
    (MS, "BiasAdd"): (_bias_add, 1),
}
_SKIP_SUM = 3  # SkipLayerNormalization's input + skip + bias output, written by _skip_sum


def _lowerable(node: onnx.NodeProto, read: set[str]) -> bool:
    found = LOWERED.get((_domain(node), node.op_type))
    if found is None:
        return False
    defined = {0, _SKIP_SUM} if node.op_type.startswith("Skip") else set(range(found[1]))
    return all(i in defined or not out or out not in read for i, out in enumerate(node.output))


def _domain(node: onnx.NodeProto) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def lower_contrib_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every onnxruntime fused operator of :data:`LOWERED` written as standard ONNX
    (the same object, unchanged, when it has none)."""
    graph = model.graph
    read = {t for n in graph.node for t in n.input} | {o.name for o in graph.output}
    if not any(_lowerable(n, read) for n in graph.node):
        return model
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    taken = {n.name for n in graph.node} | {t for n in graph.node for t in (*n.input, *n.output)}
    taken |= {t.name for t in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if not _lowerable(node, read):
            nodes.append(node)
            continue
        writer = _Writer(node, opset, taken)
        LOWERED[(_domain(node), node.op_type)][0](
            writer, {a.name: helper.get_attribute_value(a) for a in node.attribute}
        )
        nodes.extend(writer.nodes)
        graph.initializer.extend(writer.initializers)
    del graph.node[:]
    graph.node.extend(nodes)
    used = {n.domain for n in graph.node}
    kept = [o for o in model.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return model
