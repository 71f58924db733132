"""``onnxruntime-int8``: groups quantized by ONNX Runtime's static quantizer on the values their inputs
take on the calibration inputs (issue #30: precision as a placement choice)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from backends.conftest import hand_graph

from tessera.backends.composite import CompositeModel, random_feeds, reference_outputs, relative_error
from tessera.backends.onnxruntime_int8 import RECIPE, OnnxRuntimeInt8Backend, TensorValues
from tessera.backends.registry import builtin_registry


def cnn():
    """Conv-Relu-Conv-Relu-pool-Gemm whose second Conv reads its bias through an Identity, as the
    legacy exporter writes a bias it de-duplicated (shared by two Convs)."""
    return hand_graph(
        [
            ("shared", "Identity", ["b1"], ["b2"]),
            ("conv1", "Conv", ["x", "w1", "b1"], ["c1"], {"pads": [1, 1, 1, 1]}),
            ("relu1", "Relu", ["c1"], ["r1"]),
            ("conv2", "Conv", ["r1", "w2", "b2"], ["c2"], {"pads": [1, 1, 1, 1]}),
            ("relu2", "Relu", ["c2"], ["r2"]),
            ("pool", "GlobalAveragePool", ["r2"], ["p"]),
            ("flat", "Flatten", ["p"], ["f"]),
            ("fc", "Gemm", ["f", "w3"], ["y"], {"transB": 1}),
        ],
        {"x": [2, 3, 16, 16]},
        ["y"],
        {"w1": [8, 3, 3, 3], "b1": [8], "w2": [8, 8, 3, 3], "w3": [10, 8]},
    )


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_a_group_runs_quantized_within_a_few_percent_of_fp32() -> None:
    graph = cnn()
    feeds = random_feeds(graph, 0)
    backend = OnnxRuntimeInt8Backend()
    backend.calibrate(TensorValues(graph, feeds))
    out = backend.compile(graph.extract(graph.order)).run(feeds)
    error = relative_error(out, reference_outputs(graph, feeds))
    assert 1e-5 < error < 0.05  # int8 really ran (fp32 would be ~1e-7), and close


def test_the_quantized_model_has_int8_weights_and_folds_the_shared_bias() -> None:
    graph = cnn()
    values = TensorValues(graph, random_feeds(graph, 0))
    tail = [n for n in graph.order if n not in ("shared", "conv1", "relu1")]  # conv2 onward
    sub = graph.extract(tail)
    assert {i.name for i in sub.graph.input} >= {"r1", "b2"}  # the bias arrives as an activation
    weights = values.constants(sub)
    b1 = onnx.numpy_helper.to_array(graph.initializer_protos["b1"])
    assert set(weights) == {"b2"} and np.array_equal(weights["b2"], b1)
    backend = OnnxRuntimeInt8Backend()
    backend.calibrate(values)
    runnable = backend.compile(sub)
    assert runnable.input_names == ("r1",)  # b2 became a weight
    quantized = backend.prepared(sub)
    assert "QuantizeLinear" in _ops(quantized) and "DequantizeLinear" in _ops(quantized)
    int8 = {t.name for t in quantized.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    int32 = {t.name for t in quantized.graph.initializer if t.data_type == onnx.TensorProto.INT32}
    assert any(n.startswith("w2") for n in int8)  # per-channel int8 weights
    assert any(n.startswith("b2") for n in int32)  # the folded bias is quantized, not left fp32


def test_it_runs_only_groups_with_something_to_quantize() -> None:
    graph = cnn()
    backend = OnnxRuntimeInt8Backend()
    assert backend.supports(graph, ["conv2", "relu2"])
    assert not backend.supports(graph, ["relu2", "pool", "flat"])
    assert not backend.exact and backend.version.endswith("+" + RECIPE)


def test_a_probe_without_calibration_values_is_calibrated_on_seeded_inputs() -> None:
    graph = cnn()
    backend = OnnxRuntimeInt8Backend()  # never calibrated: a timing probe's sub-model
    x = np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)
    first = backend.compile(graph.extract(graph.order)).run({"x": x})["y"]
    again = backend.compile(graph.extract(graph.order)).run({"x": x})["y"]
    assert np.array_equal(first, again)  # deterministic


def test_a_composite_of_int8_and_fp32_groups_stays_within_the_budget() -> None:
    graph = cnn()
    feeds = random_feeds(graph, 0)
    registry = builtin_registry()
    registry.backend("onnxruntime-int8").calibrate(TensorValues(graph, feeds))
    head = ["shared", "conv1", "relu1", "conv2", "relu2"]
    groups = [("onnxruntime-int8", head), ("onnxruntime", [n for n in graph.order if n not in head])]
    out = CompositeModel(graph, groups, registry=registry).run(feeds)
    assert relative_error(out, reference_outputs(graph, feeds)) == pytest.approx(0.0, abs=0.05)
