"""onnxruntime's fused operators load as the standard ONNX they are defined as: each lowered graph
computes what onnxruntime's own kernel computes on the fused one."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessera.core.contrib_ops import MS, lower_contrib_ops
from tessera.core.errors import InputError
from tessera.core.graph import load_graph

W = 16
rng = np.random.default_rng(0)
WEIGHTS = {
    "gamma": rng.normal(1, 0.2, W).astype(np.float32),
    "beta": rng.normal(0, 0.2, W).astype(np.float32),
    "bias": rng.normal(0, 0.2, W).astype(np.float32),
}


def _model(
    op: str, domain: str, inputs: list[str], outputs: list[str], opset: int, **attrs
) -> onnx.ModelProto:
    feeds = [n for n in inputs if n in ("x", "skip")]
    node = helper.make_node(op, inputs, outputs, domain=domain, name="fused", **attrs)
    graph = helper.make_graph(
        [node],
        "fused",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, W]) for n in feeds],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [2, 3, W]) for o in outputs if o],
        [numpy_helper.from_array(WEIGHTS[n], n) for n in inputs if n in WEIGHTS],
    )
    ops = [helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=ops, ir_version=8)


CASES = {
    "SkipLayerNormalization": (
        MS,
        ["x", "skip", "gamma", "beta", "bias"],
        ["y", "", "", "sum"],
        {"epsilon": 1e-5},
    ),
    "SkipSimplifiedLayerNormalization": (MS, ["x", "skip", "gamma"], ["y", "", "", "sum"], {"epsilon": 1e-6}),
    "SimplifiedLayerNormalization": ("", ["x", "gamma"], ["y"], {"epsilon": 1e-6, "axis": -1}),
    "FastGelu": (MS, ["x", "bias"], ["y"], {}),
    "BiasGelu": (MS, ["x", "bias"], ["y"], {}),
    "Gelu": (MS, ["x"], ["y"], {}),
    "QuickGelu": (MS, ["x"], ["y"], {"alpha": 1.5}),
}


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )


@pytest.mark.parametrize("opset", [14, 17, 18])
@pytest.mark.parametrize("op", sorted(CASES))
def test_a_lowered_operator_computes_onnxruntimes_kernel(op: str, opset: int) -> None:
    domain, inputs, outputs, attrs = CASES[op]
    fused = _model(op, domain, inputs, outputs, opset, **attrs)
    feeds = {n: rng.normal(0, 2, (2, 3, W)).astype(np.float32) for n in ("x", "skip") if n in inputs}
    want = _run(fused, feeds)
    copy = onnx.ModelProto()
    copy.CopyFrom(fused)
    lowered = lower_contrib_ops(copy)
    assert {n.domain for n in lowered.graph.node} == {""}
    assert [o.domain for o in lowered.opset_import] == [""]
    onnx.checker.check_model(lowered, full_check=True)
    for got, expected in zip(_run(lowered, feeds), want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    graph = load_graph(fused)
    assert graph.tensors["y"].shape == (2, 3, W)


def test_a_fused_norm_whose_statistics_are_read_is_refused_naming_it() -> None:
    """SkipLayerNormalization's mean output has no lowering: left in place, the checker names it."""
    model = _model("SkipLayerNormalization", MS, ["x", "skip", "gamma", "beta"], ["y", "mean"], 17)
    with pytest.raises(
        InputError, match=r"'fused' \(com.microsoft SkipLayerNormalization\).*mean or inverse deviation"
    ):
        load_graph(model)


def test_a_norm_over_another_axis_is_refused_naming_it() -> None:
    model = _model("SimplifiedLayerNormalization", "", ["x", "gamma"], ["y"], 17, axis=1)
    with pytest.raises(InputError, match=r"'fused' \(ai.onnx SimplifiedLayerNormalization\).*over axis 1"):
        load_graph(model)
