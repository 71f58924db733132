"""Writes the standard ONNX nodes that replace one node (``core/contrib_ops.py``): fresh names,
scalar constants cast like the data, the small shape arithmetic a lowering needs."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def attributes(node: onnx.NodeProto) -> dict[str, object]:
    """``node``'s attributes by name, as Python values."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def padded_inputs(node: onnx.NodeProto, count: int = 12) -> list[str]:
    """``node``'s inputs, "" for each optional one it leaves out, ``count`` at least."""
    return list(node.input) + [""] * max(0, count - len(node.input))


class NodeWriter:
    """Emits the standard nodes that replace one fused node: fresh names, scalar constants cast like
    the data (``CastLike`` from opset 15; fp32 constants before it)."""

    def __init__(
        self,
        node: onnx.NodeProto,
        opset: int,
        taken: set[str],
        shapes: dict[str, list[int | None]] | None = None,
        dtypes: dict[str, int] | None = None,
    ) -> None:
        self.node, self.opset, self.taken = node, opset, taken
        self.shapes = shapes or {}  # tensor → dims (None: unknown), as inferred before lowering
        self.dtypes = dtypes or {}  # tensor → ONNX element type, as inferred before lowering
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
        """A scalar of ``like``'s element type: a constant of it where inference knew it (no edge
        from ``like``: a score path stays one product), else fp32 cast like it."""
        name = self.name("const")
        if (elem := self.dtypes.get(like)) is not None:
            dtype = helper.tensor_dtype_to_np_dtype(elem)
            self.initializers.append(numpy_helper.from_array(np.array(value, dtype), name))
            return name
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

    def ints(self, values: list[int] | int, what: str = "ints") -> str:
        """An int64 initializer (a scalar for an int)."""
        name = self.name(what)
        self.initializers.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    def dim(self, x: str, axis: int) -> str:
        """The size of ``x``'s ``axis`` as an int64 scalar."""
        return self.op("Gather", [self.op("Shape", [x]), self.ints(axis, "axis")], axis=0)

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", [x, self.ints(axes, "axes")])
        return self.op("Unsqueeze", [x], axes=axes)

    def split_last(self, x: str, sizes: list[int]) -> list[str]:
        """``x`` split along its last axis into pieces of ``sizes``."""
        outs = [self.name("split") for _ in sizes]
        name = self.name("Split")
        if self.opset >= 13:
            node = helper.make_node("Split", [x, self.ints(sizes, "sizes")], outs, name=name, axis=-1)
        else:
            node = helper.make_node("Split", [x], outs, name=name, axis=-1, split=sizes)
        self.nodes.append(node)
        return outs
