"""The executor's program (a torch.fx GraphModule with exporter patterns fused) computes what the node
interpreter computes, forward and backward, and fuses only what nobody else reads."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from tessera.backends.torch_fusion import steps_of
from tessera.backends.torch_module import OnnxModule

RNG = np.random.default_rng(0)


def _model(nodes, outputs=("y",), initializers=None, inputs=(("x", (2, 3, 8)),), opset=17) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _scalar_node(name: str, value: float) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.float32(value)))


def _erf_gelu(x: str = "x", out: str = "y", *, half_first: bool = False) -> list[onnx.NodeProto]:
    """torch.onnx's TorchScript exporter's GELU: x * (erf(x / √2) + 1) * 0.5."""
    return [
        _scalar_node("root2", 2**0.5),
        _scalar_node("one", 1.0),
        _scalar_node("half", 0.5),
        helper.make_node("Div", [x, "root2"], ["d"], name="div"),
        helper.make_node("Erf", ["d"], ["e"], name="erf"),
        helper.make_node("Add", ["one", "e"] if half_first else ["e", "one"], ["a"], name="add"),
        helper.make_node("Mul", [x, "a"], ["m"], name="mul"),
        helper.make_node("Mul", ["half", "m"] if half_first else ["m", "half"], [out], name="half"),
    ]


def _linear(x: str = "x", out: str = "y", *, bias_first: bool = False) -> tuple[list, dict]:
    weights = {
        "W": RNG.standard_normal((8, 5)).astype(np.float32),
        "b": RNG.standard_normal(5).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", [x, "W"], ["p"], name="matmul"),
        helper.make_node("Add", ["b", "p"] if bias_first else ["p", "b"], [out], name="bias"),
    ]
    return nodes, weights


def _layer_norm(out: str = "y", statistics: tuple[str, ...] = ()) -> tuple[list, dict]:
    weights = {"s": RNG.standard_normal(8).astype(np.float32), "c": RNG.standard_normal(8).astype(np.float32)}
    outputs = [out, *statistics] if statistics else [out]
    return [
        helper.make_node("LayerNormalization", ["x", "s", "c"], outputs, name="ln", epsilon=1e-5)
    ], weights


def _compare(model: onnx.ModelProto) -> None:
    """Program and interpreter agree on outputs and on every input's and parameter's gradient."""
    module = OnnxModule(model)
    sample = torch.from_numpy(RNG.standard_normal((2, 3, 8)).astype(np.float32))
    results = []
    for run_program in (True, False):
        x = sample.clone().requires_grad_(True)
        module.zero_grad()
        outs = module(x) if run_program else tuple(module.run({"x": x}, interpret=True).values())
        sum(o.square().sum() for o in outs).backward()
        results.append(
            ([o.detach() for o in outs], x.grad, [p.grad.clone() for _, p in module.onnx_parameters()])
        )
    (outs_p, gx_p, gw_p), (outs_i, gx_i, gw_i) = results
    for a, b in zip(outs_p, outs_i, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx_p, gx_i, rtol=1e-5, atol=1e-5)
    for a, b in zip(gw_p, gw_i, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _fused_types(model: onnx.ModelProto) -> list[str]:
    steps, _ = steps_of(model)
    return [s.op_type for s in steps if s.op_type != "Constant"]


@pytest.mark.parametrize("half_first", [False, True])
def test_the_exporters_erf_gelu_runs_as_one_gelu(half_first: bool) -> None:
    model = _model(_erf_gelu(half_first=half_first))
    assert _fused_types(model) == ["Gelu"]
    assert "onnx_Gelu" in OnnxModule(model).program.code
    _compare(model)


@pytest.mark.parametrize("bias_first", [False, True])
def test_matmul_by_a_weight_then_its_bias_runs_as_one_linear(bias_first: bool) -> None:
    nodes, weights = _linear(bias_first=bias_first)
    model = _model(nodes, initializers=weights)
    assert _fused_types(model) == ["Linear"]
    _compare(model)


def test_pow_by_a_constant_exponent_takes_a_python_exponent_and_by_a_tensor_does_not() -> None:
    # GPT-2's tanh GELU cubes with Pow(x, 3.0): a tensor exponent cost 3-4x torch's fast path.
    cube = [_scalar_node("three", 3.0), helper.make_node("Pow", ["x", "three"], ["y"], name="cube")]
    model = _model(cube)
    assert _fused_types(model) == ["PowScalar"]
    _compare(model)
    by_input = _model(
        [helper.make_node("Pow", ["x", "e"], ["y"], name="pow")], inputs=(("x", (2, 3, 8)), ("e", (1,)))
    )
    assert _fused_types(by_input) == ["Pow"]


def test_layer_norm_without_its_statistics_is_torchs_layer_norm_and_with_them_is_not() -> None:
    nodes, weights = _layer_norm()
    model = _model(nodes, initializers=weights)
    assert _fused_types(model) == ["LayerNorm"]
    _compare(model)
    nodes, weights = _layer_norm(statistics=("mean", "inv"))
    kept = _model(nodes, outputs=("y", "inv"), initializers=weights)
    assert _fused_types(kept) == ["LayerNormalization"]
    _compare(kept)


def test_an_intermediate_read_elsewhere_or_a_graph_output_is_not_fused_away() -> None:
    shared = _model(
        [*_erf_gelu(), helper.make_node("Add", ["y", "e"], ["z"], name="reads_erf")], outputs=("z",)
    )
    assert "Erf" in _fused_types(shared)
    _compare(shared)
    nodes, weights = _linear()
    as_output = _model(nodes, outputs=("y", "p"), initializers=weights)
    assert _fused_types(as_output) == ["MatMul", "Add"]
    _compare(as_output)
    activation_weight = _model(  # the right operand is an activation, not a weight: no Linear
        [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["y"])],
        inputs=(("x", (2, 3, 8)), ("w", (8, 5))),
        initializers={"b": np.zeros(5, np.float32)},
    )
    assert _fused_types(activation_weight) == ["MatMul", "Add"]


def test_identity_nodes_are_aliases_except_for_a_graph_output() -> None:
    nodes, weights = _linear(out="lin")
    model = _model(
        [
            helper.make_node("Identity", ["b"], ["b2"]),
            *[
                helper.make_node(n.op_type, [("b2" if i == "b" else i) for i in n.input], n.output)
                for n in nodes
            ],
            helper.make_node("Identity", ["lin"], ["y"]),
        ],
        initializers=weights,
    )
    assert _fused_types(model) == ["Linear", "Identity"]
    _compare(model)


def test_a_multi_output_node_with_only_a_later_output_read() -> None:
    model = _model([helper.make_node("Split", ["x"], ["", "y"], axis=2, name="split")], opset=13)
    module = OnnxModule(model)
    x = torch.arange(48, dtype=torch.float32).reshape(2, 3, 8)
    torch.testing.assert_close(module(x)[0], x[:, :, 4:])


def test_an_error_in_the_program_names_the_node() -> None:
    model = _model([helper.make_node("MatMul", ["x", "x"], ["y"], name="bad_matmul")])
    with pytest.raises(RuntimeError, match="node 'bad_matmul'"):
        OnnxModule(model, label="m.onnx")(torch.ones(2, 3, 8))


def test_tensor_names_that_read_alike_or_as_python_names_stay_apart() -> None:
    names = ("a/b", "a_b", "self", "class")  # one identifier for the first two; the generated forward's own
    model = _model(
        [helper.make_node("Sum", list(names), ["y"], name="sum")],
        inputs=tuple((n, (2,)) for n in names),
    )
    got = OnnxModule(model)(*(torch.full((2,), float(2**k)) for k in range(4)))
    torch.testing.assert_close(got[0], torch.full((2,), 15.0))


@pytest.mark.slow
def test_torch_compile_of_a_mask_made_by_constant_of_shape() -> None:
    # The exporters build attention masks with ConstantOfShape; TorchDynamo failed on its numpy
    # attribute (`launch --compile` of the corpus's BERT export failed), so it runs eagerly.
    one = numpy_helper.from_array(np.array([1], dtype=np.int64))
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("ConstantOfShape", ["s"], ["ones"], name="mask", value=one),
        helper.make_node("Cast", ["ones"], ["onesf"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "onesf"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "masked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])],
        [numpy_helper.from_array(np.eye(4, dtype=np.float32) * 2, "w")],
    )
    module = OnnxModule(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    module.compile_program()
    x = torch.randn(3, 4)
    torch.testing.assert_close(module(x)[0].detach(), 2 * x + 1)
