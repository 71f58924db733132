"""ONNX models built by hand for tests (never downloaded)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ONNX_LIGHT_MODELS = sorted((Path(onnx.__file__).parent / "backend/test/data/light").glob("*.onnx"))


def single_op_model(
    op_type: str,
    inputs: Sequence[tuple[str, Sequence[int]]],
    output_shape: Sequence[int] | None = None,
    *,
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = 17,
    **attrs: object,
) -> onnx.ModelProto:
    """A one-node model: activation inputs by (name, shape), weights as initializers."""
    initializers = initializers or {}
    names = [n for n, _ in inputs] + list(initializers)
    node = helper.make_node(op_type, names, ["y"], name="op", **attrs)
    graph = helper.make_graph(
        [node],
        "single",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(output_shape) if output_shape else None)],
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in initializers.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    if output_shape is None:  # declare the output's shape as ONNX infers it (the checker wants one)
        inferred = onnx.shape_inference.infer_shapes(model)
        for vi in [*inferred.graph.output, *inferred.graph.value_info]:
            if vi.name == "y" and vi.type.tensor_type.HasField("shape"):
                model.graph.output[0].CopyFrom(vi)
    return model
