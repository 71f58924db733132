"""The operators torch.onnx exports write for masks, positions, rotary embeddings and activations:
each against onnxruntime on a one-node model (forward) and, where differentiable, against finite
differences (backward)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper

from tessera.backends.torch_ops import OPS

RNG = np.random.default_rng(0)
F32 = RNG.normal(size=(3, 4)).astype(np.float32)
I64 = np.array([[0, 2], [1, 0]], dtype=np.int64)

# op, inputs (numpy; ints given as constants), attributes, differentiable input positions
CASES = [
    ("And", [F32 > 0, F32 < 0.5], {}, []),
    ("Or", [F32 > 0, F32 < -0.5], {}, []),
    ("Xor", [F32 > 0, F32 < 0.5], {}, []),
    ("LessOrEqual", [F32, np.float32(0.1)], {}, []),
    ("GreaterOrEqual", [F32, F32.T[:1].T], {}, []),
    ("IsNaN", [np.array([1.0, np.nan, np.inf], np.float32)], {}, []),
    ("IsInf", [np.array([1.0, np.nan, np.inf, -np.inf], np.float32)], {}, []),
    ("IsInf", [np.array([1.0, np.inf, -np.inf], np.float32)], {"detect_negative": 0}, []),
    ("Sin", [F32], {}, [0]),
    ("Cos", [F32], {}, [0]),
    ("Tan", [F32 * 0.5], {}, [0]),
    ("HardSigmoid", [F32 * 4], {"alpha": 0.3, "beta": 0.4}, [0]),
    ("HardSwish", [F32 * 4], {}, [0]),
    ("Softplus", [F32 * 10], {}, [0]),
    ("Softsign", [F32], {}, [0]),
    ("Mish", [F32], {}, [0]),
    ("Elu", [F32], {"alpha": 0.7}, [0]),
    ("Selu", [F32], {}, [0]),
    ("Floor", [F32 * 3], {}, []),
    ("Ceil", [F32 * 3], {}, []),
    ("Round", [np.array([0.5, 1.5, -2.5, 2.4], np.float32)], {}, []),
    ("Sign", [F32], {}, []),
    ("CumSum", [F32, np.array(1, np.int64)], {}, [0]),
    ("CumSum", [F32, np.array(0, np.int64)], {"exclusive": 1, "reverse": 1}, [0]),
    ("Range", [np.array(0, np.int64), np.array(7, np.int64), np.array(2, np.int64)], {}, []),
    ("Range", [np.array(1.0, np.float32), np.array(2.0, np.float32), np.array(0.25, np.float32)], {}, []),
    ("GatherElements", [F32, np.array([[0, 3, 1], [2, 2, 0]], np.int64)], {"axis": 1}, [0]),
    ("GatherND", [F32, I64], {}, [0]),
    (
        "GatherND",
        [RNG.normal(size=(2, 3, 4)).astype(np.float32), np.array([[1], [2]], np.int64)],
        {"batch_dims": 1},
        [0],
    ),
    ("ScatterND", [F32, np.array([[1], [2]], np.int64), np.ones((2, 4), np.float32)], {}, []),
    ("Tile", [F32, np.array([2, 1], np.int64)], {}, [0]),
    ("Gather", [np.array([5, 7, 9], np.int64), np.array(0, np.int64)], {"axis": 0}, []),  # Shape → Gather(0)
    ("Gather", [F32, np.array(-1, np.int64)], {"axis": 1}, [0]),
    ("Where", [F32 > 0, F32, np.float32(0)], {}, [1]),
    ("Clip", [F32 * 8, np.float32(0), np.float32(6)], {}, [0]),  # ReLU6
    ("Clip", [F32, np.float32(-0.5)], {}, [0]),
    ("CastLike", [F32, np.array([1], np.int64)], {}, []),
    ("ArgMax", [F32], {"axis": 1}, []),
    ("ArgMin", [F32], {"axis": 0, "keepdims": 0}, []),
    ("ArgMax", [np.array([[1, 3, 3], [2, 2, 0]], np.float32)], {"axis": 1, "select_last_index": 1}, []),
]


def _ids(case) -> str:
    op, _, attrs, _ = case
    return op + ("-" + "-".join(f"{k}{v}" for k, v in attrs.items()) if attrs else "")


def _onnxruntime(op: str, inputs: list[np.ndarray], attrs: dict, out: np.dtype) -> list[np.ndarray]:
    names = [f"i{k}" for k in range(len(inputs))]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], **attrs)],
        "g",
        [],
        [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(out), None)],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in zip(names, inputs, strict=True)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])  # Mish is opset 18
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {})


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_forward_matches_onnxruntime(case) -> None:
    op, inputs, attrs, _ = case
    got = OPS[op]([torch.from_numpy(np.array(v)) for v in inputs], attrs)
    (want,) = _onnxruntime(op, inputs, attrs, got.numpy().dtype)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [c for c in CASES if c[3]], ids=[_ids(c) for c in CASES if c[3]])
def test_backward_matches_finite_differences(case) -> None:
    op, inputs, attrs, wrt = case
    tensors = [torch.from_numpy(np.array(v)) for v in inputs]
    free = [tensors[i].double().requires_grad_() for i in wrt]

    def fn(*args: torch.Tensor) -> torch.Tensor:
        given = list(tensors)
        for i, t in zip(wrt, args, strict=True):
            given[i] = t
        return OPS[op](given, attrs)

    assert torch.autograd.gradcheck(fn, free, eps=1e-6, atol=1e-5)


def test_the_coverage_page_is_current() -> None:
    """docs/operators.md is what the generator writes for the installed onnx and today's table."""
    from pathlib import Path

    from tessera.backends.torch_ops.coverage import coverage_table

    page = Path(__file__).parents[2] / "docs" / "operators.md"
    assert page.read_text() == coverage_table(), "run: python -m tessera.backends.torch_ops.coverage"
