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


def tied_chain(layers: int = 6, width: int = 8, ties: int = 1) -> onnx.ModelProto:
    """A chain of MatMul + Tanh layers whose first and last MatMul read the same weight ``tied``
    (an exporter's tied embedding and LM head look the same to the executor); ``ties`` 2: the
    second and the last but one read ``tied2`` too."""
    rng = np.random.default_rng(0)
    tie = {0: "tied", layers - 1: "tied"} | ({1: "tied2", layers - 2: "tied2"} if ties > 1 else {})
    weights = {
        f"w{i}": rng.normal(0, 0.5, (width, width)).astype(np.float32) for i in range(layers) if i not in tie
    }
    for name in sorted(set(tie.values())):
        weights[name] = rng.normal(0, 0.5, (width, width)).astype(np.float32)
    nodes, x = [], "x"
    for i in range(layers):
        w = tie.get(i, f"w{i}")
        nodes.append(helper.make_node("MatMul", [x, w], [f"m{i}"], name=f"matmul{i}"))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i}"], name=f"tanh{i}"))
        x = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", width])],
        [numpy_helper.from_array(v, name) for name, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def shape_passing_chain(width: int = 8) -> onnx.ModelProto:
    """MatMul + Tanh, then a MatMul whose output is reshaped to the first Tanh's ``Shape`` (int64)
    and masked by its ``Greater`` than 0 (bool): cut after the first layer, three dtypes cross
    together, as an exporter's shape arithmetic crosses with the activations."""
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["m0"], name="matmul0"),
        helper.make_node("Tanh", ["m0"], ["h0"], name="tanh0"),
        helper.make_node("Shape", ["h0"], ["shape"], name="shape"),
        helper.make_node("Greater", ["h0", "zero"], ["mask"], name="greater"),
        helper.make_node("MatMul", ["h0", "w1"], ["m1"], name="matmul1"),
        helper.make_node("Reshape", ["m1", "shape"], ["r1"], name="reshape"),
        helper.make_node("Where", ["mask", "r1", "zero"], ["masked"], name="where"),
        helper.make_node("Tanh", ["masked"], ["y"], name="tanh1"),
    ]
    return _two_layer_model("shapes", nodes, width)


def _two_layer_model(name: str, nodes: list[onnx.NodeProto], width: int) -> onnx.ModelProto:
    """``nodes`` from ``x`` ``[batch, width]`` to ``y``, with two ``width × width`` weights ``w0``,
    ``w1`` (seeded) and a scalar ``zero``."""
    rng = np.random.default_rng(0)
    weights = {f"w{i}": rng.normal(0, 0.5, (width, width)).astype(np.float32) for i in range(2)}
    zero = numpy_helper.from_array(np.zeros((), np.float32), "zero")
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        [*(numpy_helper.from_array(v, n) for n, v in weights.items()), zero],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def routed_chain(width: int = 8) -> onnx.ModelProto:
    """MatMul + Tanh, then the sum of its positive entries (``NonZero``, ``GatherND``: tensors of a
    length the data chose, no shape inference can know) added back, and a second MatMul + Tanh:
    an unrolled routing of experts in miniature."""
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["m0"], name="matmul0"),
        helper.make_node("Tanh", ["m0"], ["h0"], name="tanh0"),
        helper.make_node("Greater", ["h0", "zero"], ["mask"], name="greater"),
        helper.make_node("NonZero", ["mask"], ["where"], name="nonzero"),
        helper.make_node("Transpose", ["where"], ["picks"], name="transpose", perm=[1, 0]),
        helper.make_node("GatherND", ["h0", "picks"], ["picked"], name="gathernd"),
        helper.make_node("ReduceSum", ["picked"], ["total"], name="reducesum", keepdims=1),
        helper.make_node("Add", ["h0", "total"], ["shifted"], name="add"),
        helper.make_node("MatMul", ["shifted", "w1"], ["m1"], name="matmul1"),
        helper.make_node("Tanh", ["m1"], ["y"], name="tanh1"),
    ]
    return _two_layer_model("routed", nodes, width)


def head_major_chain(width: int = 8, heads: int = 2) -> onnx.ModelProto:
    """MatMul, split into heads and moved head-major (``[heads, batch, width/heads]``, as Falcon's
    fused QKV is split), Tanh, then back and a MatMul: cut after the Tanh, the crossing tensor holds
    its samples on axis 1."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (width, width)).astype(np.float32), "w0"),
        numpy_helper.from_array(rng.normal(0, 0.5, (width, width)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.array([-1, heads, width // heads], np.int64), "split_heads"),
        numpy_helper.from_array(np.array([-1, width], np.int64), "merge_heads"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["m0"], name="matmul0"),
        helper.make_node("Reshape", ["m0", "split_heads"], ["bhd"], name="split"),
        helper.make_node("Transpose", ["bhd"], ["hbd"], perm=[1, 0, 2], name="head_major"),
        helper.make_node("Tanh", ["hbd"], ["heads"], name="tanh0"),
        helper.make_node("Transpose", ["heads"], ["back"], perm=[1, 0, 2], name="batch_major"),
        helper.make_node("Reshape", ["back", "merge_heads"], ["merged"], name="merge"),
        helper.make_node("MatMul", ["merged", "w1"], ["m1"], name="matmul1"),
        helper.make_node("Tanh", ["m1"], ["y"], name="tanh1"),
    ]
    graph = helper.make_graph(
        nodes,
        "head_major",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def mlp_pair(middle: str, width: int = 8, hidden: int = 16, *, tied: bool = False) -> onnx.ModelProto:
    """x → x·W1 (+ b1) → ``middle`` → ·W2 → y; ``tied``: W1 also read by a second product."""
    rng = np.random.default_rng(0)
    inits = {
        "w1": rng.standard_normal((width, hidden)),
        "b1": rng.standard_normal(hidden),
        "w2": rng.standard_normal((hidden, width)),
        "g": np.ones(hidden),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="up"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="bias"),
    ]
    if middle == "relu":
        nodes.append(helper.make_node("Relu", ["h1"], ["h2"], name="act"))
    else:  # a norm over the hidden axis: the split axis
        nodes.append(helper.make_node("LayerNormalization", ["h1", "g"], ["h2"], name="norm", axis=-1))
    nodes.append(helper.make_node("MatMul", ["h2", "w2"], ["y"], name="down"))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, width])]
    if tied:
        nodes.append(helper.make_node("MatMul", ["x", "w1"], ["z"], name="again"))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4, hidden]))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, width])],
        outputs,
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model
