"""Graph rewrites a planner may ask for: named, exact-in-arithmetic substitutions (IR in, IR out).

A plan that was made on a rewritten graph records the rewrites' names (``model.rewrites``), and
``validate`` and ``launch`` apply the same rewrites to the model file before they read the plan:
the file on disk is never changed, and the rewrite is a pure, deterministic function of it.

``concat-matmul``
    TASO's substitution of a matrix product over a concatenation (thesis-jia-taso-flexflow.txt,
    Ch. 2; ``matmul(concat(x1, x2), W) = matmul(x1, W1) + matmul(x2, W2)``): a fully connected
    layer (``Gemm``, or ``MatMul`` by a 2-D weight) whose input is a ``Concat`` along the
    contracted axis becomes one product per concatenated input, by the matching rows of the
    weight, and a ``Sum`` of the products and the bias. The multi-branch models' merge layer
    (CANDLE-Uno: 7·4096 → 4096, 18 % of its FLOPs, in one operator after the branches) then
    splits into per-branch parts that a graph pipeline runs inside the branches. Exact up to
    floating-point summation order. Applies only where the concatenation feeds nothing else and
    the weight is an initializer that nothing else reads (slicing a shared weight would untie it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tessera.core.errors import InputError
from tessera.models.weights import is_lazy_tensor, lazy_slice


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...] | None]:
    """The shape of every tensor with a known type; None where a dimension is not a number."""
    shapes: dict[str, tuple[int, ...] | None] = {}
    g = model.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        dims = vi.type.tensor_type.shape.dim
        shapes[vi.name] = (
            tuple(d.dim_value for d in dims) if all(d.HasField("dim_value") for d in dims) else None
        )
    for t in g.initializer:
        shapes[t.name] = tuple(int(d) for d in t.dims)
    return shapes


def _slice_weight(weight: TensorProto, name: str, axis: int, start: int, stop: int) -> TensorProto:
    """Rows (``axis`` 0) or columns (``axis`` 1) ``start:stop`` of a 2-D initializer, named ``name``."""
    if is_lazy_tensor(weight):
        return lazy_slice(weight, name, axis, start, stop)
    values = numpy_helper.to_array(weight)
    part = values[start:stop] if axis == 0 else values[:, start:stop]
    return numpy_helper.from_array(np.ascontiguousarray(part), name)


def concat_matmul(model: onnx.ModelProto) -> onnx.ModelProto:
    """Split every fully connected layer over the ``Concat`` feeding it (see the module docstring).

    ``model`` is a prepared model (named, shape-inferred; :func:`tessera.core.onnx_io.prepare_model`).
    The parts are named after the layer: node and output ``{layer}/part{i}``, weight
    ``{weight}/part{i}``, and the ``Sum`` node ``{layer}/sum``, which writes the layer's output
    tensor, so every consumer reads the same tensor as before.
    """
    g = model.graph
    shapes = _static_shapes(model)
    producer = {out: node for node in g.node for out in node.output}
    readers: dict[str, int] = {}
    for node in g.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in g.output}
    weights = {t.name: t for t in g.initializer}
    taken = {n.name for n in g.node} | {t for n in g.node for t in n.output} | set(weights)

    replaced: dict[str, list[onnx.NodeProto]] = {}  # layer name -> its parts and sum
    dropped: set[str] = set()  # concat nodes and weights that the parts replace
    new_weights: list[TensorProto] = []
    for node in g.node:
        if node.op_type not in ("Gemm", "MatMul") or len(node.input) < 2:
            continue
        attrs = _attrs(node)
        if node.op_type == "Gemm" and (
            attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0
        ):
            continue
        x, w = node.input[0], node.input[1]
        concat = producer.get(x)
        weight = weights.get(w)
        if concat is None or concat.op_type != "Concat" or weight is None or len(weight.dims) != 2:
            continue
        if readers.get(x) != 1 or readers.get(w) != 1 or x in outputs or len(concat.input) < 2:
            continue
        x_shape = shapes.get(x)
        parts_shapes = [shapes.get(p) for p in concat.input]
        if x_shape is None or any(s is None for s in parts_shapes):
            continue
        axis = int(_attrs(concat)["axis"])  # type: ignore[call-overload]
        if axis % len(x_shape) != len(x_shape) - 1:  # only along the contracted (last) axis
            continue
        widths = [s[-1] for s in parts_shapes]  # type: ignore[index]
        trans_b = bool(attrs.get("transB", 0)) if node.op_type == "Gemm" else False
        contracted = 1 if trans_b else 0
        names = [f"{node.name}/part{i}" for i in range(len(widths))]
        new = [*names, f"{node.name}/sum", *(f"{w}/part{i}" for i in range(len(widths)))]
        if sum(widths) != weight.dims[contracted] or any(n in taken for n in new):
            continue
        nodes = []
        start = 0
        for i, (part_input, width) in enumerate(zip(concat.input, widths, strict=True)):
            part_weight = _slice_weight(weight, f"{w}/part{i}", contracted, start, start + width)
            new_weights.append(part_weight)
            start += width
            extra = {"transB": 1} if trans_b else {}
            nodes.append(
                helper.make_node(
                    node.op_type, [part_input, part_weight.name], [names[i]], name=names[i], **extra
                )
            )
        bias = [node.input[2]] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else []
        nodes.append(helper.make_node("Sum", [*names, *bias], [node.output[0]], name=f"{node.name}/sum"))
        replaced[node.name] = nodes
        dropped |= {concat.name, w}
        taken |= set(new)

    if not replaced:
        return model
    result = onnx.ModelProto()
    result.CopyFrom(model)
    kept = [n for n in g.node if n.name not in dropped]
    del result.graph.node[:]
    for node in kept:
        result.graph.node.extend(replaced.get(node.name, [node]))
    kept_weights = [t for t in g.initializer if t.name not in dropped]
    del result.graph.initializer[:]
    result.graph.initializer.extend([*kept_weights, *new_weights])
    # The removed concatenations' outputs leave the value infos; shape inference adds the parts'.
    gone = {x for n in g.node if n.name in dropped for x in n.output}
    infos = [vi for vi in g.value_info if vi.name not in gone]
    del result.graph.value_info[:]
    result.graph.value_info.extend(infos)
    return result


REWRITES: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]] = {"concat-matmul": concat_matmul}
"""Every rewrite a plan may name, by name."""


def applicable(model: onnx.ModelProto) -> dict[str, list[str]]:
    """The operators of the prepared ``model`` each rewrite would replace (rewrites that change it)."""
    changed = {}
    for name, rewrite in REWRITES.items():
        kept = {n.name for n in rewrite(model).graph.node}
        replaced = [n.name for n in model.graph.node if n.name not in kept]
        if replaced:
            changed[name] = replaced
    return changed


def apply_rewrites(model: onnx.ModelProto, names: Sequence[str], *, label: str) -> onnx.ModelProto:
    """``model`` with the rewrites ``names`` applied in order; an InputError names an unknown one."""
    for name in names:
        rewrite = REWRITES.get(name)
        if rewrite is None:
            known = ", ".join(sorted(REWRITES))
            raise InputError(f"unknown graph rewrite {name!r} (known: {known})", source=label)
        model = rewrite(model)
    return model
