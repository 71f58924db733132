"""Shapes from a graph's shape computations folded to constants: ``Shape`` of a tensor whose shape
inference knows, and the small ops over such values (``Squeeze``, ``Range``, ``ConstantOfShape``, …)
evaluated by ``onnx.reference``, so that ONNX's inference resolves what follows them (a ``Range`` over
the input's length, which it leaves ``unk__N``). The model itself is not changed: only its value infos.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["folded_shapes"]

# Ops a shape computation is made of, evaluated (onnx.reference) where every input is known.
_FOLDABLE = frozenset(
    {"Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Min", "Max", "Floor", "Ceil", "Sqrt", "Cast", "Identity",
     "Gather", "Squeeze", "Unsqueeze", "Concat", "Slice", "Reshape", "Range", "Size", "ConstantOfShape",
     "Expand", "Equal", "Less", "Greater", "Not", "Where", "ReduceProd", "ReduceSum", "Constant"}
)  # fmt: skip
_FOLD_ELEMENTS = 1 << 16  # values folded at most: shape vectors, scalars, position ranges (never weights)
_FOLD_ROUNDS = 8  # a folded Shape can give the next Shape a concrete input: a few rounds reach them all


def folded_shapes(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` (as inferred) with the value infos ONNX's inference finds once the shape computations
    are constants: a ``Shape`` of a concretely shaped tensor and the small ops over such values (a
    ``Range`` over the input's length) are evaluated, on a copy whose weights are inputs of their
    shape, until nothing more folds. The model's nodes stay as they are; None where inference fails."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        return None
    skeleton, values = _weightless(model)
    inferred = skeleton
    for _ in range(_FOLD_ROUNDS):
        try:
            inferred = onnx.shape_inference.infer_shapes(skeleton, data_prop=True)
        except Exception:  # noqa: BLE001 - folding is a second try; the first inference stands
            return None
        new = _fold(skeleton, inferred, values, opset)
        if not new:
            break
        kept = [n for n in skeleton.graph.node if not all(o in values for o in n.output if o)]
        del skeleton.graph.node[:]
        skeleton.graph.node.extend(kept)
        skeleton.graph.initializer.extend(numpy_helper.from_array(values[name], name) for name in new)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    known = {*(vi.name for vi in model.graph.input), *(t.name for t in model.graph.initializer)}
    infos = [vi for vi in inferred.graph.value_info if vi.name not in known]
    produced = {o for n in model.graph.node for o in n.output} - {vi.name for vi in model.graph.output}
    infos += [
        onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
        for name, v in values.items()
        if name in produced
    ]
    del result.graph.value_info[:]
    result.graph.value_info.extend(infos)
    shaped = {vi.name: vi for vi in inferred.graph.output if _dims(vi) is not None}
    for vi in result.graph.output:
        if vi.name in shaped:
            vi.CopyFrom(shaped[vi.name])
    return result


def _weightless(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``model``'s graph without value infos (inference keeps a symbolic dim it finds stated), its
    large or external initializers as inputs of their shape; and the values of the small ones."""
    skeleton = onnx.ModelProto(ir_version=model.ir_version)
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    g = skeleton.graph
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    g.sparse_initializer.extend(model.graph.sparse_initializer)
    for vi in g.output:
        vi.type.tensor_type.ClearField("shape")
    values: dict[str, np.ndarray] = {}
    declared = {vi.name for vi in g.input}
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL and math.prod(t.dims) <= _FOLD_ELEMENTS:
            g.initializer.append(t)
            values[t.name] = numpy_helper.to_array(t)
        elif t.name not in declared:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return skeleton, values


def _dims(vi: onnx.ValueInfoProto) -> list[int] | None:
    """A tensor's concrete shape; None when it has a symbolic or missing dim, or no shape."""
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not tt.HasField("shape"):
        return None
    if not all(d.HasField("dim_value") for d in tt.shape.dim):
        return None
    return [d.dim_value for d in tt.shape.dim]


def _fold(
    skeleton: onnx.ModelProto, inferred: onnx.ModelProto, values: dict[str, np.ndarray], opset: int
) -> list[str]:
    """Evaluate the nodes of ``skeleton`` whose inputs are all known (``Shape``: its input's shape
    as ``inferred`` gives it), adding their outputs to ``values``; the names added."""
    from onnx.reference import ReferenceEvaluator

    infos = (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output)
    shapes = {vi.name: dims for vi in infos if (dims := _dims(vi)) is not None}
    new: list[str] = []
    for node in skeleton.graph.node:
        if (
            node.domain not in ("", "ai.onnx")
            or not node.output
            or all(o in values for o in node.output if o)
        ):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        try:
            if node.op_type == "Shape" and node.input[0] in shapes:
                dims = shapes[node.input[0]][attrs.get("start", 0) : attrs.get("end")]
                outs = [np.array(dims, dtype=np.int64)]
            elif node.op_type in _FOLDABLE and all(not i or i in values for i in node.input):
                feeds = {i: values[i] for i in node.input if i}
                outs = ReferenceEvaluator(node, opsets={"": opset}).run(None, feeds)
            else:
                continue
        except Exception:  # noqa: BLE001, S112 - a node the reference cannot evaluate stays as it is
            continue
        if len(outs) != len(node.output) or any(np.asarray(v).size > _FOLD_ELEMENTS for v in outs):
            continue
        for name, value in zip(node.output, outs, strict=True):
            if name:
                values[name] = np.asarray(value)
                new.append(name)
    return new
