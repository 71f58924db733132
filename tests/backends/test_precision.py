"""``--precision bf16``: the products compute in bf16 and hand back fp32, so every tensor between
ONNX operators keeps the model's dtype and a stage cut anywhere computes what one program does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx_builders import mlp_pair

from tessera.backends.precision import in_precision, native_bf16
from tessera.backends.torch_fusion import steps_of
from tessera.backends.torch_module import to_torch
from tessera.backends.torch_ops import function_of
from tessera.core.graph import load_graph

RNG = np.random.default_rng(0)


def _x() -> torch.Tensor:
    return torch.from_numpy(RNG.standard_normal((2, 4, 8)).astype(np.float32))


def test_a_product_computes_in_bf16_and_returns_fp32() -> None:
    a, b = torch.randn(3, 8), torch.randn(8, 5)
    got = in_precision("MatMul", function_of("MatMul"), "bf16")((a, b), {})
    assert got.dtype == torch.float32
    assert torch.equal(got, (a.bfloat16() @ b.bfloat16()).float())
    assert not torch.equal(got, a @ b)  # it did round
    # A product of another dtype computes as the model says; fp32 and non-products are untouched.
    half = in_precision("MatMul", function_of("MatMul"), "bf16")((a.double(), b.double()), {})
    assert half.dtype == torch.float64 and torch.allclose(half, a.double() @ b.double())
    assert in_precision("Relu", function_of("Relu"), "bf16") is function_of("Relu")
    assert in_precision("MatMul", function_of("MatMul"), "fp32") is function_of("MatMul")


def test_gradients_flow_through_the_casts_into_fp32_weights() -> None:
    module = to_torch(mlp_pair("relu"), precision="bf16")
    x = _x()
    out = module.run({"x": x})["y"]
    assert out.dtype == torch.float32
    out.square().mean().backward()
    grads = dict(module.onnx_parameters())
    for name in ("w1", "b1", "w2"):  # ("g" is the norm variant's)
        p = grads[name]
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
    fp32 = to_torch(mlp_pair("relu"))
    assert not torch.equal(fp32.run({"x": x})["y"], out)


def test_the_fused_linear_adds_its_bias_as_the_unfused_add_does() -> None:
    """The program fuses MatMul + Add into one Linear step; the node interpreter runs them apart.
    In bf16 both add the bias in fp32 after the product: the same values, so a stage boundary
    between the two nodes changes nothing."""
    model = mlp_pair("relu")
    assert "Linear" in [s.op_type for s in steps_of(model)[0]]
    module = to_torch(model, precision="bf16")
    x = _x()
    fused = module.run({"x": x})["y"]
    unfused = module.run({"x": x}, interpret=True)["y"]
    assert torch.equal(fused, unfused)


def test_a_cut_between_two_products_changes_nothing(tmp_path) -> None:
    """Two halves of the MLP, each its own program, chained through their fp32 boundary tensor,
    compute the whole program's output exactly."""
    model = mlp_pair("relu")
    path = tmp_path / "mlp.onnx"
    path.write_bytes(model.SerializeToString())
    graph = load_graph(str(path))
    first, second = graph.order[:2], graph.order[2:]
    head = to_torch(graph.extract(first), precision="bf16")
    tail = to_torch(graph.extract(second), precision="bf16")
    x = _x()
    middle = head.run({"x": x})
    assert all(t.dtype == torch.float32 for t in middle.values())
    got = tail.run(middle)["y"]
    assert torch.equal(got, to_torch(model, precision="bf16").run({"x": x})["y"])


def test_a_bf16_model_stays_bf16() -> None:
    w = numpy_helper.from_array(RNG.standard_normal((8, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Cast", ["w"], ["wb"], to=TensorProto.BFLOAT16),
         helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
         helper.make_node("MatMul", ["xb", "wb"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 4])],
        initializer=[w],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out = to_torch(model, precision="bf16").run({"x": torch.randn(2, 8)})["y"]
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["cpu", "meta"])
def test_native_bf16_is_a_fact_of_the_device(kind: str) -> None:
    flags = open("/proc/cpuinfo").read() if kind == "cpu" else ""
    want = kind == "cpu" and ("avx512_bf16" in flags or "amx_bf16" in flags)
    assert native_bf16(torch.device(kind)) == want


def test_fp64_computes_every_operator_in_float64_through_the_graphs_own_casts() -> None:
    """The round-off arbiter (``train_reference(dtype=torch.float64)``): a bf16 export's casts to
    bf16 and back round nothing, and its bf16 weights enter as float64."""
    import ml_dtypes

    w = RNG.standard_normal((8, 5))
    nodes = [
        helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
        helper.make_node("MatMul", ["xb", "w"], ["yb"]),
        helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "cast",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
        [numpy_helper.from_array(w.astype(ml_dtypes.bfloat16), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = RNG.standard_normal((3, 8))
    module = to_torch(model, precision="fp64").to(torch.float64)
    y = module.run({"x": torch.from_numpy(x)})["y"]
    assert y.dtype == torch.float64
    want = x @ w.astype(ml_dtypes.bfloat16).astype(np.float64)  # the weights as stored, x unrounded
    np.testing.assert_allclose(y.detach().numpy(), want, rtol=1e-12)
    as_exported = to_torch(model).run({"x": torch.from_numpy(x.astype(np.float32))})["y"]
    assert not np.allclose(as_exported.detach().numpy(), want, rtol=1e-5)  # bf16 rounds x
