"""Graph rewrites a planner may ask for: named, exact-in-arithmetic substitutions (IR in, IR out).

``reduce-concat`` moves a reduction over other axes above a ``Concat``; ``concat-matmul`` splits a fully
connected layer over a ``Concat`` into one product per input and a ``Sum``. They are applied in the order
of :data:`REWRITES`. A plan made on a rewritten graph records their names (``model.rewrites``);
``validate`` and ``launch`` apply them to the model file, which is never changed.

References: TASO's substitutions, thesis-jia Table 2.2. Conditions and examples: docs/core.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tessera.core.errors import InputError
from tessera.core.onnx_io import infer_shapes
from tessera.core.weights import UNREAD_LOCATION, is_lazy_tensor, lazy_slice


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


class _Index:
    """What a rewrite looks up while it matches: shapes, producers, reader counts, graph outputs,
    initializers, and every name in use (new names must not collide)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.shapes = _static_shapes(model)
        self.producer = {out: node for node in g.node for out in node.output}
        self.readers: dict[str, int] = {}
        for node in g.node:
            for name in node.input:
                self.readers[name] = self.readers.get(name, 0) + 1
        self.outputs = {o.name for o in g.output}
        self.weights = {t.name: t for t in g.initializer}
        self.taken = {n.name for n in g.node} | {t for n in g.node for t in n.output} | set(self.weights)


def _slice_weight(weight: TensorProto, name: str, axis: int, start: int, stop: int) -> TensorProto:
    """Rows (``axis`` 0) or columns (``axis`` 1) ``start:stop`` of a 2-D initializer, named ``name``."""
    if is_lazy_tensor(weight):
        return lazy_slice(weight, name, axis, start, stop)
    if weight.data_location == TensorProto.EXTERNAL:  # left on disk (or missing): only its shape plans
        part = TensorProto()
        part.CopyFrom(weight)
        part.name = name
        part.dims[axis] = stop - start
        del part.external_data[:]
        part.external_data.add(key="location", value=UNREAD_LOCATION)
        return part
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
    ix = _Index(model)
    shapes, producer, readers, weights, taken = ix.shapes, ix.producer, ix.readers, ix.weights, ix.taken

    replaced: dict[str, list[onnx.NodeProto]] = {}  # layer name -> its parts and sum
    dropped: set[str] = set()  # concat nodes and weights that the parts replace
    new_weights: list[TensorProto] = []
    # A part is a Gemm without a bias: its C input is optional from opset 11.
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    for node in g.node:
        if node.op_type not in ("Gemm", "MatMul") or len(node.input) < 2:
            continue
        if node.op_type == "Gemm" and opset < 11:
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
        if readers.get(x) != 1 or readers.get(w) != 1 or x in ix.outputs or len(concat.input) < 2:
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

    return _replace(model, replaced, dropped, new_weights)


def _replace(
    model: onnx.ModelProto,
    replaced: dict[str, list[onnx.NodeProto]],
    dropped: set[str],
    new_weights: Sequence[TensorProto] = (),
) -> onnx.ModelProto:
    """``model`` with each node of ``replaced`` replaced by its list of nodes, in place, and the
    nodes and initializers named in ``dropped`` removed; ``new_weights`` appended."""
    if not replaced:
        return model  # the same object: nothing matched
    g = model.graph
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    for node in g.node:
        if node.name not in dropped:
            result.graph.node.extend(replaced.get(node.name, [node]))
    kept_weights = [t for t in g.initializer if t.name not in dropped]
    del result.graph.initializer[:]
    result.graph.initializer.extend([*kept_weights, *new_weights])
    # The removed nodes' outputs leave the value infos; shape inference adds the new ones'.
    gone = {x for n in g.node if n.name in dropped for x in n.output}
    del result.graph.value_info[:]
    result.graph.value_info.extend(vi for vi in g.value_info if vi.name not in gone)
    return result


_REDUCTIONS = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin")


def reduce_concat(model: onnx.ModelProto) -> onnx.ModelProto:
    """Move every reduction over axes other than its input ``Concat``'s above the ``Concat`` (see
    the module docstring). Each input gets a reduction ``{reduction}/part{i}`` with the same
    attributes (and axes input); ``{reduction}/concat`` concatenates them into the reduction's
    output tensor."""
    g = model.graph
    ix = _Index(model)
    shapes, producer, readers, weights, taken = ix.shapes, ix.producer, ix.readers, ix.weights, ix.taken

    replaced: dict[str, list[onnx.NodeProto]] = {}
    dropped: set[str] = set()
    for node in g.node:
        if node.op_type not in _REDUCTIONS or not node.input:
            continue
        x = node.input[0]
        concat = producer.get(x)
        shape = shapes.get(x)
        if concat is None or concat.op_type != "Concat" or shape is None:
            continue
        if readers.get(x) != 1 or x in ix.outputs:
            continue
        attrs = _attrs(node)
        if len(node.input) > 1 and node.input[1]:  # axes as an input (ReduceSum, opset 13+)
            axes_tensor = weights.get(node.input[1])
            if axes_tensor is None:
                continue
            axes = [int(a) for a in numpy_helper.to_array(axes_tensor).reshape(-1)]
        else:
            axes = [int(a) for a in attrs.get("axes", [])]  # type: ignore[union-attr]
        if not axes:  # every axis, the concatenated one too
            continue
        rank = len(shape)
        axes = sorted({a % rank for a in axes})
        axis = int(_attrs(concat)["axis"]) % rank  # type: ignore[call-overload]
        if axis in axes:
            continue
        kept_axis = axis if attrs.get("keepdims", 1) else axis - sum(a < axis for a in axes)
        names = [f"{node.name}/part{i}" for i in range(len(concat.input))]
        new = [*names, f"{node.name}/concat"]
        if any(n in taken for n in new):
            continue
        nodes = [
            helper.make_node(node.op_type, [part, *node.input[1:]], [name], name=name, **attrs)
            for part, name in zip(concat.input, names, strict=True)
        ]
        nodes.append(
            helper.make_node("Concat", names, [node.output[0]], name=f"{node.name}/concat", axis=kept_axis)
        )
        replaced[node.name] = nodes
        dropped.add(concat.name)
        taken |= set(new)
    return _replace(model, replaced, dropped)


REWRITES: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]] = {
    "reduce-concat": reduce_concat,
    "concat-matmul": concat_matmul,
}
"""Every rewrite a plan may name, in the order they are applied."""


def applicable(model: onnx.ModelProto, *, label: str) -> tuple[list[str], list[str]]:
    """The rewrites that change the prepared ``model``, each applied after the ones before it
    (``concat-matmul`` may match only once ``reduce-concat`` has run), and the operators of
    ``model`` they replace together."""
    names = []
    rewritten = model
    for name, rewrite in REWRITES.items():
        after = rewrite(rewritten)
        if after is not rewritten:
            names.append(name)
            rewritten = infer_shapes(after, label=label)
    kept = {n.name for n in rewritten.graph.node}
    return names, [n.name for n in model.graph.node if n.name not in kept]


def unknown_rewrite(names: Sequence[str]) -> str | None:
    """Why ``names`` cannot be applied (the first name that is no rewrite), or ``None``."""
    unknown = [n for n in names if n not in REWRITES]
    return f"unknown graph rewrite {unknown[0]!r} (known: {', '.join(REWRITES)})" if unknown else None


def apply_rewrites(model: onnx.ModelProto, names: Sequence[str], *, label: str) -> onnx.ModelProto:
    """``model`` with the rewrites ``names`` applied in :data:`REWRITES` order; an InputError names
    an unknown one."""
    why = unknown_rewrite(names)
    if why is not None:
        raise InputError(why, source=label)
    for name, rewrite in REWRITES.items():
        if name in names:
            model = infer_shapes(rewrite(model), label=label)  # the next rewrite matches on shapes
    return model
