"""Graph rewrites (tessera.core.rewrite): exact against ONNX Runtime, lazy weights, what is left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessera.core.errors import InputError
from tessera.core.graph import load_graph
from tessera.core.onnx_io import prepare_model
from tessera.core.rewrite import applicable, apply_rewrites, concat_matmul
from tessera.models import build, materialize


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _feeds(graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, info in graph.inputs.items():
        shape = info.shape
        if info.dtype == "int64":
            feeds[name] = rng.integers(0, 8, size=shape, dtype=np.int64)
        else:
            feeds[name] = rng.standard_normal(shape, dtype=np.float32)
    return feeds


@pytest.mark.parametrize("name", ["candle_uno", "dlrm"])
def test_concat_matmul_splits_the_merge_layer_and_computes_the_same_outputs(name: str) -> None:
    model = build(name, "tiny")
    shapes = {n: (4, *i.shape[1:]) for n, i in load_graph(model).inputs.items()}
    before = load_graph(model, input_shapes=shapes)
    after = load_graph(model, input_shapes=shapes, rewrites=["concat-matmul"])
    concats = [n for n in after.order if after.op(n).op_type == "Concat"]
    sums = [n for n in after.order if after.op(n).op_type == "Sum"]
    assert concats == [] and len(sums) == 1
    parts = [n for n in after.order if "/part" in n]
    assert len(parts) == len(after.op(sums[0]).inputs) - 1  # the parts and the bias
    assert after.sha256 == before.sha256 and after.rewrites == ("concat-matmul",)
    # The same parameters, cut: no weight is lost or duplicated.
    assert after.num_params == before.num_params
    assert after.total_flops == pytest.approx(before.total_flops, rel=0.01)
    feeds = _feeds(before)
    want = _run(before.model, feeds)
    got = _run(after.model, feeds)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_concat_matmul_on_lazy_weights_materializes_to_the_eager_rewrite() -> None:
    lazy = build("candle_uno", "tiny", lazy=True)
    eager = build("candle_uno", "tiny", lazy=False)
    lazy_rewritten, _, _ = prepare_model(lazy.SerializeToString(deterministic=True))
    eager_rewritten, _, _ = prepare_model(eager.SerializeToString(deterministic=True))
    lazy_rewritten = concat_matmul(lazy_rewritten)
    eager_rewritten = concat_matmul(eager_rewritten)
    filled = {t.name: numpy_helper.to_array(t) for t in materialize(lazy_rewritten).graph.initializer}
    want = {t.name: numpy_helper.to_array(t) for t in eager_rewritten.graph.initializer}
    assert sorted(filled) == sorted(want)
    assert any("/part" in n for n in want)
    for name, values in want.items():
        np.testing.assert_array_equal(filled[name], values, err_msg=name)


def _fc_over_concat(
    *, shared_weight: bool = False, concat_read_twice: bool = False, axis: int = 1, opset: int = 17
):
    """x0 [2,3], x1 [2,5] -> Concat(axis 1) -> Gemm(W [4,8], transB=1, b) -> y; along axis 0,
    x1 is [2,3] and W [4,3]."""
    rng = np.random.default_rng(1)
    width = 8 if axis == 1 else 3
    w = numpy_helper.from_array(rng.standard_normal((4, width)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    nodes = [
        helper.make_node("Concat", ["x0", "x1"], ["cat"], name="cat", axis=axis),
        helper.make_node("Gemm", ["cat", "W", "b"], ["y"], name="fc", transB=1),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2 if axis == 1 else 4, 4])]
    if shared_weight:
        nodes.append(helper.make_node("Gemm", ["cat", "W"], ["z"], name="fc2", transB=1))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4]))
    if concat_read_twice:
        nodes.append(helper.make_node("Relu", ["cat"], ["r"], name="relu"))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 8]))
    graph = helper.make_graph(
        nodes,
        "fc",
        [
            helper.make_tensor_value_info("x0", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("x1", TensorProto.FLOAT, [2, 5 if axis == 1 else 3]),
        ],
        outputs,
        initializer=[w, b],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_concat_matmul_splits_by_the_concatenated_widths() -> None:
    graph = load_graph(_fc_over_concat(), rewrites=["concat-matmul"])
    assert list(graph.order) == ["fc/part0", "fc/part1", "fc/sum"]
    assert graph.initializers["W/part0"].shape == (4, 3)
    assert graph.initializers["W/part1"].shape == (4, 5)
    assert "W" not in graph.initializers
    feeds = {"x0": np.ones((2, 3), np.float32), "x1": np.arange(10, dtype=np.float32).reshape(2, 5)}
    np.testing.assert_allclose(_run(graph.model, feeds)[0], _run(_fc_over_concat(), feeds)[0], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [{"shared_weight": True}, {"concat_read_twice": True}, {"axis": 0}, {"opset": 9}],
    ids=["weight read twice", "concat read twice", "concat along the batch", "Gemm needs C before opset 11"],
)
def test_concat_matmul_leaves_layers_it_cannot_split_exactly(kwargs: dict) -> None:
    graph = load_graph(_fc_over_concat(**kwargs), rewrites=["concat-matmul"])
    assert "cat" in graph.order and "W" in graph.initializers


def test_an_unknown_rewrite_is_an_input_error_naming_the_known_ones() -> None:
    with pytest.raises(
        InputError, match=r"unknown graph rewrite 'fuse-all' \(known: reduce-concat, concat-matmul\)"
    ):
        apply_rewrites(build("candle_uno", "tiny"), ["fuse-all"], label="m.onnx")


def test_reduce_concat_pools_the_branches_before_they_merge_and_lets_concat_matmul_split_the_head() -> None:
    model = build("mmt", "tiny")
    shapes = {n: (3, *i.shape[1:]) for n, i in load_graph(model).inputs.items()}
    before = load_graph(model, input_shapes=shapes)
    pooled = load_graph(model, input_shapes=shapes, rewrites=["reduce-concat"])
    both = load_graph(model, input_shapes=shapes, rewrites=["concat-matmul", "reduce-concat"])
    assert both.rewrites == ("reduce-concat", "concat-matmul")  # applied in REWRITES order
    branches = len(before.op("merge/concat").inputs)
    assert [n for n in pooled.order if n.startswith("merge/")] == [
        *(f"merge/pool/part{i}" for i in range(branches)),
        "merge/pool/concat",
    ]
    assert pooled.tensors["merge/pool/part0"].shape == (
        3,
        before.tensors["merge/concat"].shape[-1] // branches,
    )
    assert "merge/pool/concat" not in both.order and "head/gemm/sum" in both.order
    assert applicable(before.model, label="mmt") == (
        ["reduce-concat", "concat-matmul"],
        ["merge/concat", "merge/pool", "head/gemm"],
    )
    feeds = _feeds(before)
    want = _run(before.model, feeds)
    np.testing.assert_array_equal(_run(pooled.model, feeds)[0], want[0])  # the same sums, per slice
    np.testing.assert_allclose(_run(both.model, feeds)[0], want[0], rtol=1e-5, atol=1e-6)


def test_reduce_concat_leaves_a_reduction_over_the_concatenated_axis() -> None:
    nodes = [
        helper.make_node("Concat", ["x0", "x1"], ["cat"], name="cat", axis=1),
        helper.make_node("ReduceMean", ["cat"], ["m"], name="mean", axes=[0, 1], keepdims=0),
        helper.make_node("ReduceMax", ["cat2"], ["n"], name="max", axes=[0], keepdims=1),
        helper.make_node("Concat", ["x0", "x1"], ["cat2"], name="cat2", axis=-1),
    ]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [nodes[0], nodes[1], nodes[3], nodes[2]],
        "r",
        [vi("x0", TensorProto.FLOAT, [2, 3]), vi("x1", TensorProto.FLOAT, [2, 5])],
        [vi("m", TensorProto.FLOAT, []), vi("n", TensorProto.FLOAT, [1, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    rewritten = load_graph(model, rewrites=["reduce-concat"])
    assert "cat" in rewritten.order and "mean" in rewritten.order  # over the concatenated axis: kept
    assert "cat2" not in rewritten.order and rewritten.op("max/concat").attributes["axis"] == 1
    feeds = {"x0": np.arange(6, dtype=np.float32).reshape(2, 3), "x1": -np.ones((2, 5), np.float32)}
    for got, want in zip(_run(rewritten.model, feeds), _run(model, feeds), strict=True):
        np.testing.assert_array_equal(got, want)


def test_concat_matmul_splits_a_matmul_by_rows_of_its_weight() -> None:
    """MatMul over a rank-3 concatenation along the last axis (the weight is [in, out]: rows)."""
    rng = np.random.default_rng(2)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "W")
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [
            helper.make_node("Concat", ["x0", "x1"], ["cat"], name="cat", axis=-1),
            helper.make_node("MatMul", ["cat", "W"], ["y"], name="mm"),
        ],
        "mm",
        [vi("x0", TensorProto.FLOAT, [2, 3, 6]), vi("x1", TensorProto.FLOAT, [2, 3, 2])],
        [vi("y", TensorProto.FLOAT, [2, 3, 4])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    rewritten = load_graph(model, rewrites=["concat-matmul"])
    assert list(rewritten.order) == ["mm/part0", "mm/part1", "mm/sum"]
    assert rewritten.initializers["W/part0"].shape == (6, 4) and rewritten.initializers["W/part1"].shape == (
        2,
        4,
    )
    feeds = {
        "x0": rng.standard_normal((2, 3, 6)).astype(np.float32),
        "x1": rng.standard_normal((2, 3, 2)).astype(np.float32),
    }
    np.testing.assert_allclose(_run(rewritten.model, feeds)[0], _run(model, feeds)[0], rtol=1e-5, atol=1e-6)
