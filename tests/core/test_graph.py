"""The graph IR: loading models from the wild, naming, IR lowering, costs, structure, extraction."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_builders import ONNX_LIGHT_MODELS, single_op_model

from tessera.core.errors import InputError
from tessera.core.graph import load_graph
from tessera.core.onnx_io import max_runtime_ir_version, parse_input_shapes
from tessera.core.structure import branch_structure
from tessera.models import ZOO, build, parameter_count

LIGHT = {p.stem.removeprefix("light_"): p for p in ONNX_LIGHT_MODELS}


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray], outputs: list[str] | None = None):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(outputs or [o.name for o in sess.get_outputs()], sess.run(outputs, feeds), strict=True))


def with_all_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also outputs the given intermediate tensors (types from inference)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    known = {vi.name: vi for vi in copy.graph.value_info}
    present = {o.name for o in copy.graph.output} | {i.name for i in copy.graph.input}
    copy.graph.output.extend(known[n] for n in names if n not in present)
    return copy


def random_feeds(graph) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for name, info in graph.inputs.items():
        if np.issubdtype(np.dtype(info.dtype), np.integer):
            feeds[name] = rng.integers(0, 8, size=info.shape).astype(info.dtype)
        else:
            feeds[name] = rng.normal(size=info.shape).astype(info.dtype)
    return feeds


# -- models in the wild: the ONNX test models shipped in the onnx wheel -------------------------


def test_onnx_wheel_models_are_present():
    assert {"resnet50", "vgg19", "inception_v1", "densenet121"} <= set(LIGHT)


@pytest.mark.parametrize("path", ONNX_LIGHT_MODELS, ids=lambda p: p.stem)
def test_light_models_load_with_parameters_counted_independently(path):
    graph = load_graph(path)
    raw = onnx.load(path)
    # "light" models generate most weights with ConstantOfShape from `<weight>__SHAPE` initializers
    # and store the rest as float initializers: the parameter count is what those hold.
    shapes = [numpy_helper.to_array(t).tolist() for t in raw.graph.initializer if t.name.endswith("__SHAPE")]
    used = {t for n in raw.graph.node for t in n.input}
    stored = [t.dims for t in raw.graph.initializer if t.data_type == TensorProto.FLOAT and t.name in used]
    expected = sum(math.prod(s) for s in shapes) + sum(math.prod(d) for d in stored)
    assert graph.num_params == expected
    assert graph.param_bytes == 4 * expected
    assert graph.num_nodes == len(raw.graph.node)
    assert raw.ir_version == 3 and graph.model.ir_version == 4  # initializers-as-inputs export, raised
    assert len(graph.inputs) == 1 and len(raw.graph.input) > 1  # weights are not inputs
    assert all(op.flops >= 0 for op in graph.ops())


@pytest.mark.parametrize(
    ("name", "gmacs", "params"),
    [
        # Published counts: torchvision's model docs (GMACs) and parameter counts (+BatchNorm statistics).
        ("vgg19", 19.63, 143_667_240),
        ("resnet50", 4.09, 25_557_032 + 53_120),
        ("bvlc_alexnet", 0.66, 60_965_224),
    ],
)
def test_flops_match_published_counts(name, gmacs, params):
    graph = load_graph(LIGHT[name])
    conv_gemm = sum(op.flops for op in graph.ops() if op.op_type in ("Conv", "Gemm"))
    assert conv_gemm / 2 / 1e9 == pytest.approx(gmacs, rel=0.02)
    assert graph.num_params == params


@pytest.mark.parametrize(("name", "branches"), [("inception_v1", 4), ("resnet50", 2), ("vgg19", 1)])
def test_branch_structure_of_classic_cnns(name, branches):
    assert branch_structure(load_graph(LIGHT[name])).max_branches == branches


def test_light_model_output_matches_reference_after_loading():
    path = LIGHT["squeezenet"]
    graph = load_graph(path)
    x = np.random.default_rng(0).normal(size=graph.inputs["data_0"].shape).astype(np.float32)
    ours = run_ort(graph.model, {"data_0": x})
    theirs = run_ort(onnx.load(path), {"data_0": x})
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-5, atol=1e-6)


# -- zoo models -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("size", ["tiny", "paper"])
def test_zoo_models_load_and_count_parameters(name, size):
    model = build(name, size)
    graph = load_graph(model)
    assert graph.num_params == parameter_count(model)
    assert graph.total_flops > 0
    assert len(set(graph.order)) == graph.num_nodes


@pytest.mark.parametrize(("name", "branches"), [("mmt", 2), ("dlrm", 14), ("candle_uno", 7)])
def test_multi_branch_zoo_models_show_their_branches(name, branches):
    # tiny mmt has 2 modality branches; DLRM 7 dense + 7 embedding; CANDLE-Uno 7.
    assert branch_structure(load_graph(build(name, "tiny"))).max_branches == branches


def test_gpt_paper_flops_hand_count():
    """GPT-2 small at seq 1024, batch 1: matmul FLOPs by hand (projections, scores, FFN, head)."""
    graph = load_graph(build("gpt", "paper"))
    layers, e, s, f, v = 12, 768, 1024, 3072, 50257
    per_layer = 2 * s * e * e * 4 + 2 * s * s * e * 2 + 2 * s * e * f * 2
    expected = layers * per_layer + 2 * s * e * v
    matmul = sum(op.flops for op in graph.ops() if op.op_type == "MatMul")
    assert matmul == expected


def test_input_shape_overrides_symbolic_batch():
    graph = load_graph(build("gpt", "tiny"), input_shapes={"input_ids": (4, 16)})
    assert graph.inputs["input_ids"].shape == (4, 16)
    assert graph.defaulted_dims == {}
    default = load_graph(build("gpt", "tiny"))
    assert default.defaulted_dims == {"input_ids:0 (batch)": 1}
    # FLOPs of every matmul scale with the batch.
    mm = lambda g: sum(op.flops for op in g.ops() if op.op_type == "MatMul")  # noqa: E731
    assert mm(graph) == 4 * mm(default)


def test_input_shape_errors_name_the_problem():
    with pytest.raises(InputError, match="not a graph input"):
        load_graph(build("gpt", "tiny"), input_shapes={"nope": (1, 16)})
    with pytest.raises(InputError, match="fixed to 16"):
        load_graph(build("gpt", "tiny"), input_shapes={"input_ids": (1, 32)})
    with pytest.raises(InputError, match="expected NAME="):
        parse_input_shapes(["input_ids:1x3"])
    with pytest.raises(InputError, match="positive"):
        parse_input_shapes(["x=1x0x3"])


@pytest.mark.parametrize("dims", ["99999999999999999999999x16x32", "1048576x1048576x2", "9" * 30])
def test_input_shape_too_large_is_bad_input(dims):
    # An int64-overflowing dim used to reach protobuf and fail as "ValueError: Value out of range".
    with pytest.raises(InputError, match="not a plausible input") as info:
        parse_input_shapes([f"modality0={dims}"])
    assert info.value.one_line().startswith("--input-shape: ")
    assert parse_input_shapes(["x=1024x1024x1024x1024"]) == {"x": (1024,) * 4}


# -- loading steps ---------------------------------------------------------------------------------


def two_node_model(names=("", ""), order=(0, 1)) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name=names[0]),
        helper.make_node("Neg", ["a"], ["y"], name=names[1]),
    ]
    graph = helper.make_graph(
        [nodes[i] for i in order],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_unnamed_nodes_get_stable_unique_names():
    graph = load_graph(two_node_model())
    assert graph.order == ("Relu_0", "Neg_1")
    assert load_graph(two_node_model()).order == graph.order


def test_duplicated_names_are_made_unique():
    assert load_graph(two_node_model(names=("n", "n"))).order == ("n", "n__1")


def test_out_of_order_nodes_are_sorted():
    graph = load_graph(two_node_model(names=("relu", "neg"), order=(1, 0)))
    assert graph.order == ("relu", "neg")
    assert list(graph.dag.edges) == [("relu", "neg")]


def test_edges_carry_tensor_shape_dtype_and_bytes():
    graph = load_graph(two_node_model(names=("relu", "neg")))
    edge = graph.dag.edges["relu", "neg"]
    (tensor,) = edge["tensors"]
    assert (tensor.name, tensor.shape, tensor.dtype) == ("a", (2, 3), "float32")
    assert edge["bytes"] == 24


def test_ir_version_above_runtime_is_lowered_when_safe():
    model = two_node_model()
    model.ir_version = onnx.IR_VERSION + 3
    graph = load_graph(model)
    assert graph.model.ir_version <= max_runtime_ir_version()
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(run_ort(graph.model, {"x": x})["y"], -x)


def test_ir_version_that_cannot_be_lowered_is_refused():
    from tessera.core.onnx_io import lower_ir_version

    model = two_node_model()
    model.ir_version = 20
    with pytest.raises(InputError, match="cannot be lowered"):
        lower_ir_version(model, label="m.onnx", limit=2)


def test_initializers_listed_as_inputs_are_weights():
    w = numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")
    graph_proto = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "old",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        initializer=[w],
    )
    model = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 3
    graph = load_graph(model)
    assert list(graph.inputs) == ["x"]
    assert graph.op("mm").params == 9


# -- extraction ---------------------------------------------------------------------------------


def layer_nodes(graph, prefix: str) -> list[str]:
    return [n for n in graph.order if n.startswith(prefix)]


@pytest.mark.parametrize(
    ("name", "prefix"), [("gpt", "layer1/"), ("resnext", "stage1/"), ("mmt", "branch1/")]
)
def test_extracted_subgraph_is_valid_and_computes_what_the_full_model_does(name, prefix):
    graph = load_graph(build(name, "tiny"))
    nodes = layer_nodes(graph, prefix)
    assert nodes, f"no node starts with {prefix}"
    sub = graph.extract(nodes)
    onnx.checker.check_model(sub, full_check=True)
    ins, outs = graph.boundary(nodes)
    assert [i.name for i in sub.graph.input] == ins
    assert [o.name for o in sub.graph.output] == outs
    feeds = random_feeds(graph)
    inner = [t for t in ins + outs if t not in graph.inputs]
    full = {**feeds, **run_ort(with_all_outputs(graph.model, inner), feeds, inner)}
    part = run_ort(sub, {t: full[t] for t in ins})
    for t in outs:
        np.testing.assert_allclose(part[t], full[t], rtol=1e-5, atol=1e-6)


def test_boundary_of_whole_graph_is_its_inputs_and_outputs():
    graph = load_graph(build("dlrm", "tiny"))
    ins, outs = graph.boundary(graph.order)
    assert set(ins) == set(graph.inputs)
    assert set(outs) == set(graph.outputs)


def test_boundary_rejects_unknown_nodes():
    graph = load_graph(two_node_model())
    with pytest.raises(KeyError, match="nope"):
        graph.boundary(["nope"])


def test_single_op_extraction_keeps_its_weights():
    w = np.random.default_rng(1).normal(size=(4, 3, 3, 3))
    graph = load_graph(single_op_model("Conv", [("x", (1, 3, 8, 8))], initializers={"w": w}))
    sub = graph.extract(graph.order)
    assert [t.name for t in sub.graph.initializer] == ["w"]
    onnx.checker.check_model(sub)
