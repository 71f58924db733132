"""Property-based tests of the graph IR: random DAGs load, cut and extract correctly; the loaders
never crash on arbitrary bytes with anything but the documented InputError."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from tessera.core.errors import InputError
from tessera.core.graph import load_graph
from tessera.core.structure import branch_structure
from tessera.models import build

BINARY = ("Add", "Mul", "Sub")
UNARY = ("Relu", "Neg", "Tanh", "Sigmoid")


@st.composite
def random_dags(draw) -> onnx.ModelProto:
    """A random DAG of elementwise ops over [2, 4] tensors: each node reads one or two earlier tensors."""
    n = draw(st.integers(1, 14))
    tensors = ["x0", "x1"]
    nodes = []
    for i in range(n):
        if draw(st.booleans()):
            a, b = draw(st.sampled_from(tensors)), draw(st.sampled_from(tensors))
            nodes.append(helper.make_node(draw(st.sampled_from(BINARY)), [a, b], [f"t{i}"], name=f"n{i}"))
        else:
            a = draw(st.sampled_from(tensors))
            nodes.append(helper.make_node(draw(st.sampled_from(UNARY)), [a], [f"t{i}"], name=f"n{i}"))
        tensors.append(f"t{i}")
    consumed = {t for node in nodes for t in node.input}
    outputs = [t for t in tensors[2:] if t not in consumed] or [tensors[-1]]
    vi = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4])  # noqa: E731
    used_inputs = [t for t in ("x0", "x1") if t in consumed] or ["x0"]
    graph = helper.make_graph(nodes, "random", [vi(t) for t in used_inputs], [vi(t) for t in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def run(model: onnx.ModelProto, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(
        zip(names, sess.run(None, {k: feeds[k] for k in (i.name for i in sess.get_inputs())}), strict=True)
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=random_dags(), data=st.data())
def test_any_node_subset_extracts_to_a_model_computing_the_same_values(model, data):
    graph = load_graph(model)
    assert graph.num_nodes == len(model.graph.node)
    subset = data.draw(st.sets(st.sampled_from(graph.order), min_size=1))
    sub = graph.extract(subset)
    onnx.checker.check_model(sub, full_check=True)
    ins, outs = graph.boundary(subset)
    # Every boundary input comes from outside the subset, every output is read outside or is a graph output.
    assert all(graph.producer.get(t) not in subset for t in ins)
    assert all(t in graph.outputs or any(c not in subset for c in graph.consumers.get(t, ())) for t in outs)
    rng = np.random.default_rng(0)
    feeds = {name: rng.normal(size=(2, 4)).astype(np.float32) for name in graph.inputs}
    everything = helper.make_graph(
        graph.model.graph.node,
        "all",
        graph.model.graph.input,
        [helper.make_tensor_value_info(t, TensorProto.FLOAT, [2, 4]) for t in graph.producer],
    )
    full_model = helper.make_model(everything, opset_imports=graph.model.opset_import)
    full_model.ir_version = 8
    values = {**feeds, **run(full_model, feeds)}
    got = run(sub, values)
    for t in outs:
        np.testing.assert_allclose(got[t], values[t], rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(model=random_dags())
def test_branch_segments_partition_the_activation_operators(model):
    graph = load_graph(model)
    structure = branch_structure(graph)
    inside = sum(s.nodes for s in structure.segments)
    assert inside + len(structure.cuts) == graph.num_nodes - len(graph.constant_nodes)
    assert structure.max_branches >= 1


@settings(max_examples=300, deadline=None)
@given(blob=st.binary(max_size=2048))
def test_loader_on_arbitrary_bytes_raises_only_input_errors(blob):
    try:
        load_graph(blob)
    except InputError as exc:
        assert "\n" not in str(exc)


SEED_MODEL = build("mmt", "tiny").SerializeToString()


@settings(max_examples=150, deadline=None)
@given(cut=st.integers(0, len(SEED_MODEL)), flips=st.lists(st.integers(0, len(SEED_MODEL) - 1), max_size=8))
def test_loader_on_damaged_real_models_raises_only_input_errors(cut, flips):
    """Truncated and bit-flipped copies of a real model: load or fail with an InputError, never crash."""
    data = bytearray(SEED_MODEL[:cut] if cut else SEED_MODEL)
    for pos in flips:
        if pos < len(data):
            data[pos] ^= 0x5A
    try:
        load_graph(bytes(data))
    except InputError as exc:
        assert "\n" not in str(exc)
