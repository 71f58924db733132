"""Small hand-built graphs for the GPP tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tessera.core.graph import Graph, load_graph


def _model(nodes, inputs, outputs, inits, width):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", width]) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", width]) for n in outputs],
        [numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def chain(layers: int = 8, width: int = 256) -> Graph:
    """x → (MatMul, Relu) × layers: a single-branch chain."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], {}, "x"
    for i in range(layers):
        w = f"w{i}"
        inits[w] = rng.standard_normal((width, width)).astype(np.float32)
        nodes.append(helper.make_node("MatMul", [x, w], [f"h{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}"))
        x = f"r{i}"
    return load_graph(_model(nodes, ["x"], [x], inits, width))


def n_shaped(width: int = 64) -> Graph:
    """Not series-parallel: a→c, a→d, b→d (plus weights so there is something to train)."""
    rng = np.random.default_rng(1)
    inits = {f"w{k}": rng.standard_normal((width, width)).astype(np.float32) for k in "abcd"}
    nodes = [
        helper.make_node("MatMul", ["x", "wa"], ["a"], name="a"),
        helper.make_node("MatMul", ["y", "wb"], ["b"], name="b"),
        helper.make_node("MatMul", ["a", "wc"], ["c"], name="c"),
        helper.make_node("Add", ["a", "b"], ["ab"], name="d_add"),
        helper.make_node("MatMul", ["ab", "wd"], ["d"], name="d"),
    ]
    return load_graph(_model(nodes, ["x", "y"], ["c", "d"], inits, width))


def as_model(graph: Graph) -> onnx.ModelProto:
    return graph.model
