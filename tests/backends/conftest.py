"""Shared helpers: tiny hand-built ONNX graphs, and the zoo models the backend tests run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessera.core.graph import Graph, load_graph

Node = (
    tuple[str, str, Sequence[str], Sequence[str]]
    | tuple[str, str, Sequence[str], Sequence[str], dict[str, Any]]
)


def hand_graph(
    nodes: Sequence[Node],
    inputs: dict[str, Sequence[int]],
    outputs: Sequence[str],
    weights: dict[str, Sequence[int]] | None = None,
) -> Graph:
    """A graph from ``(name, op_type, inputs, outputs[, attrs])`` tuples; fp32 everywhere."""
    rng = np.random.default_rng(0)
    protos = [
        helper.make_node(n[1], list(n[2]), list(n[3]), name=n[0], **(n[4] if len(n) > 4 else {}))
        for n in nodes
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
        for name, shape in (weights or {}).items()
    ]
    graph = helper.make_graph(
        protos,
        "hand",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v)) for k, v in inputs.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    inferred = onnx.shape_inference.infer_shapes(model)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return load_graph(model)


def intermediates(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], names: Sequence[str]
) -> dict[str, np.ndarray]:
    """onnxruntime's values of any tensors of the full model (exposed as extra outputs)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    known = {o.name for o in m.graph.output}
    inferred = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(m).graph.value_info}
    for n in names:
        if n not in known:
            m.graph.output.append(inferred.get(n) or helper.make_empty_tensor_value_info(n))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(names, sess.run(list(names), feeds), strict=True))


# The tiny zoo models the backend tests run (tests/conftest.py: ``zoo``, ``zoo_graph``).
@pytest.fixture(scope="session")
def gpt_model(zoo) -> onnx.ModelProto:
    return zoo("gpt")


@pytest.fixture(scope="session")
def gpt(zoo_graph) -> Graph:
    return zoo_graph("gpt")


@pytest.fixture(scope="session")
def resnext_model(zoo) -> onnx.ModelProto:
    return zoo("resnext")


@pytest.fixture(scope="session")
def resnext(zoo_graph) -> Graph:
    return zoo_graph("resnext")


@pytest.fixture(scope="session")
def make_graph():
    """``make_graph(nodes, inputs, outputs, weights)``: see :func:`hand_graph`."""
    return hand_graph


@pytest.fixture(scope="session")
def ort_values():
    """``ort_values(model, feeds, names)``: see :func:`intermediates`."""
    return intermediates
