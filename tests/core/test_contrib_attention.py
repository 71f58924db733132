"""onnxruntime's fused attention operators (com.microsoft MultiHeadAttention and Attention) load as the
standard operators they compute: the lowered graph gives what onnxruntime's kernels give on the fused
one, causal, masked, biased or not; the forms with a KV cache input are refused, naming the node."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessera.core.contrib_ops import MS, lower_contrib_ops
from tessera.core.errors import InputError
from tessera.core.graph import load_graph

B, S, H, D = 2, 5, 4, 8
HID = H * D
rng = np.random.default_rng(1)


def _value(name: str, shape: list, elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _model(node: onnx.NodeProto, inputs: list, weights: dict[str, np.ndarray], opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node], "fused", inputs, [_value("y", [B, S, HID])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )  # fmt: skip
    ops = [helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=ops, ir_version=8)


def _mha(unidirectional: int, bias: bool, attention_bias: bool, mask: bool, opset: int) -> tuple:
    names = [
        "q",
        "k",
        "v",
        "bias" if bias else "",
        "mask" if mask else "",
        "attn_bias" if attention_bias else "",
    ]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(
        "MultiHeadAttention", names, ["y"], domain=MS, name="mha", num_heads=H, unidirectional=unidirectional
    )
    inputs = [_value(n, [B, S, HID]) for n in ("q", "k", "v")]
    feeds = {n: rng.normal(0, 1, (B, S, HID)).astype(np.float32) for n in ("q", "k", "v")}
    weights = {"bias": rng.normal(0, 0.5, 3 * HID).astype(np.float32)} if bias else {}
    if mask:
        inputs.append(_value("mask", [B, S], TensorProto.INT32))
        feeds["mask"] = np.array([[1] * S, [1] * (S - 2) + [0, 0]], np.int32)
    if attention_bias:
        inputs.append(_value("attn_bias", [1, H, S, S]))
        feeds["attn_bias"] = rng.normal(0, 1, (1, H, S, S)).astype(np.float32)
    return _model(node, inputs, weights, opset), feeds


def _attention(unidirectional: int, mask: bool, scale: float | None, opset: int) -> tuple:
    names = ["x", "w", "b", "mask" if mask else ""]
    attrs = {"num_heads": H, "unidirectional": unidirectional, **({"scale": scale} if scale else {})}
    node = helper.make_node(
        "Attention", [n for n in names if n] if not mask else names, ["y"], domain=MS, name="attn", **attrs
    )
    weights = {
        "w": rng.normal(0, 0.3, (HID, 3 * HID)).astype(np.float32),
        "b": rng.normal(0, 0.3, 3 * HID).astype(np.float32),
    }
    inputs = [_value("x", [B, S, HID])]
    feeds = {"x": rng.normal(0, 1, (B, S, HID)).astype(np.float32)}
    if mask:
        inputs.append(_value("mask", [B, S], TensorProto.INT32))
        feeds["mask"] = np.array([[1] * S, [1] * (S - 1) + [0]], np.int32)
    return _model(node, inputs, weights, opset), feeds


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]


def _check(model: onnx.ModelProto, feeds: dict) -> None:
    want = _run(model, feeds)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    lowered = lower_contrib_ops(copy)
    assert {n.domain for n in lowered.graph.node} == {""}, [n.op_type for n in lowered.graph.node if n.domain]
    onnx.checker.check_model(lowered, full_check=True)
    np.testing.assert_allclose(_run(lowered, feeds), want, rtol=1e-5, atol=1e-5)
    assert load_graph(model).tensors["y"].shape == (B, S, HID)


@pytest.mark.parametrize("opset", [14, 17])
@pytest.mark.parametrize("unidirectional", [0, 1])
@pytest.mark.parametrize(
    "bias,attention_bias,mask",
    [(False, False, False), (True, False, False), (True, True, False), (False, False, True)],
)
def test_multi_head_attention_lowers_to_what_onnxruntime_computes(
    unidirectional, bias, attention_bias, mask, opset
) -> None:
    _check(*_mha(unidirectional, bias, attention_bias, mask, opset))


@pytest.mark.parametrize("opset", [14, 17])
@pytest.mark.parametrize("unidirectional", [0, 1])
@pytest.mark.parametrize("mask,scale", [(False, None), (True, None), (False, 0.5)])
def test_packed_attention_lowers_to_what_onnxruntime_computes(unidirectional, mask, scale, opset) -> None:
    _check(*_attention(unidirectional, mask, scale, opset))


def test_attention_with_a_kv_cache_input_is_refused_naming_it() -> None:
    node = helper.make_node(
        "MultiHeadAttention",
        ["q", "k", "v", "", "", "", "pk", "pv"],
        ["y"],
        domain=MS,
        name="mha",
        num_heads=H,
    )
    inputs = [_value(n, [B, S, HID]) for n in ("q", "k", "v")] + [
        _value(n, [B, H, 3, D]) for n in ("pk", "pv")
    ]
    with pytest.raises(
        InputError, match=r"'mha' \(com.microsoft MultiHeadAttention\).*'pk'.*free past length"
    ):
        load_graph(_model(node, inputs, {}, 17))


def test_forms_the_lowering_would_get_wrong_are_refused_naming_the_node() -> None:
    """A rotary the fused Attention applies itself, or a head-major 4-D key: left in place."""
    rotary = helper.make_node(
        "Attention", ["x", "w", "b"], ["y"], domain=MS, name="attn", num_heads=H, do_rotary=1
    )
    weights = {"w": np.zeros((HID, 3 * HID), np.float32), "b": np.zeros(3 * HID, np.float32)}
    with pytest.raises(InputError, match=r"'attn' \(com.microsoft Attention\).*do_rotary"):
        load_graph(_model(rotary, [_value("x", [B, S, HID])], weights, 17))
    head_major = helper.make_node(
        "MultiHeadAttention", ["q", "k", "v"], ["y"], domain=MS, name="mha", num_heads=H
    )
    inputs = [_value("q", [B, S, HID]), _value("k", [B, H, S, D]), _value("v", [B, H, S, D])]
    with pytest.raises(InputError, match=r"'mha' \(com.microsoft MultiHeadAttention\).*head-major"):
        load_graph(_model(head_major, inputs, {}, 17))
