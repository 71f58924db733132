"""Indexing operators of the torch operator table (gathers, scatters with their reductions, OneHot,
TopK, NonZero, Compress, CumSum) against onnxruntime (forward) and finite differences (backward,
data and updates), at every schema version of opsets 13–23."""

from __future__ import annotations

import numpy as np
import pytest
from backends.torch_op_cases import (
    Case,
    at_opsets,
    case,
    check_backward,
    check_forward,
    i64,
    normal,
    with_grad,
)

X = normal(3, 4)
CUBE = normal(2, 3, 4)
SINCE_16, SINCE_18 = range(16, 24), range(18, 24)

GATHERS: list[Case] = [
    case("Gather", i64(5, 7, 9), np.int64(0)),  # Shape → Gather(0): a scalar
    case("Gather", X, np.int64(-1), grad=[0], axis=1),
    case("Gather", X, i64(2, 0, 2, -3).reshape(2, 2), grad=[0]),
    case("Gather", CUBE, np.array([[1], [0]], np.int32), grad=[0], axis=-2),
    case("GatherElements", X, np.array([[0, 3, 1], [2, -1, 0]], np.int64), grad=[0], axis=1),
    case("GatherElements", X, np.array([[2, 1, 0, 2]], np.int32), grad=[0]),
    case("GatherND", X, np.array([[0, 2], [1, -1]], np.int64), grad=[0]),
    case("GatherND", CUBE, np.array([[1], [0]], np.int64), grad=[0]),
    case("GatherND", CUBE, np.array([[1], [2]], np.int64), grad=[0], batch_dims=1),
    case("GatherND", CUBE, np.array([[[0, 1], [2, 3]], [[1, 0], [0, 0]]], np.int64), batch_dims=1),
]

SCATTERS: list[Case] = [
    case("ScatterND", X, np.array([[1], [2]], np.int64), normal(2, 4), grad=[0, 2]),
    case("ScatterND", X, np.array([[0, 1], [-1, 3]], np.int64), normal(2), grad=[0, 2]),
    case(
        "ScatterND",
        X,
        np.array([[1], [1]], np.int64),
        normal(2, 4),
        grad=[0, 2],
        reduction="add",
        opsets=SINCE_16,
    ),
    case("ScatterND", X, np.array([[1], [1]], np.int64), normal(2, 4), reduction="mul", opsets=SINCE_16),
    case("ScatterND", X, np.array([[0, 1], [0, 1]], np.int64), normal(2), reduction="max", opsets=SINCE_18),
    case("ScatterND", X, np.array([[2], [2]], np.int64), normal(2, 4), reduction="min", opsets=SINCE_18),
    case(
        "ScatterElements", X, np.array([[1, 0, 3], [2, -1, 0]], np.int64), normal(2, 3), grad=[0, 2], axis=1
    ),
    case("ScatterElements", X, np.array([[2, 1, 0, 1]], np.int64), normal(1, 4), grad=[0, 2]),
    case(
        "ScatterElements",
        X,
        np.array([[1, 1], [0, 0]], np.int64),
        normal(2, 2),
        grad=[0, 2],
        axis=1,
        reduction="add",
        opsets=SINCE_16,
    ),  # fmt: skip
    case("ScatterElements", X, np.array([[1, 1]], np.int64), normal(1, 2), reduction="mul", opsets=SINCE_16),
    case("ScatterElements", X, np.array([[1, 1]], np.int64), normal(1, 2), reduction="max", opsets=SINCE_18),
    case("ScatterElements", X, np.array([[0, 0]], np.int64), normal(1, 2), reduction="min", opsets=SINCE_18),
]

OTHERS: list[Case] = [
    case("OneHot", i64(0, 2, -1, 5), np.int64(4), np.array([0.0, 1.0], np.float32)),  # 5: all off
    case("OneHot", np.array([[1, 0], [2, -1]], np.int32), np.float32(3), np.float32([-2, 3]), axis=0),
    case("OneHot", np.array([1.0, 2.0], np.float32), np.int64(3), i64(0, 1), axis=-2),
    case("TopK", CUBE, i64(2), grad=[0], outputs=2),
    case("TopK", CUBE, i64(1), grad=[0], outputs=2, axis=0, largest=0),
    case("TopK", np.array([[3, 1, 3, 2, 1]], np.float32), i64(3), outputs=2),  # ties: the lower index
    case("TopK", np.array([[3, 1, 3, 2, 1]], np.float32), i64(3), outputs=2, largest=0),
    case("NonZero", np.where(X > 0, X, 0)),
    case("NonZero", CUBE > 0.5),
    case("Compress", X, np.array([True, False, True]), grad=[0], axis=0),
    case("Compress", X, np.array([False, True, True]), axis=-1),  # shorter than the axis
    case("Compress", X, np.array([True, False, False, True, True])),  # flattened
    case("CumSum", X, np.array(1, np.int64), grad=[0]),
    case("CumSum", X, np.array(0, np.int32), grad=[0], exclusive=1, reverse=1),
    case("CumSum", CUBE, np.array(-1, np.int64), grad=[0], exclusive=1),
    case("CumSum", np.array([[1, 2, 3], [4, 5, 6]], np.int64), np.array(0, np.int64), reverse=1),
    case("ReverseSequence", normal(4, 3, 2), i64(4, 1, 3), grad=[0]),  # (time, batch, ...)
    case("ReverseSequence", normal(3, 4), i64(2, 4, 0), grad=[0], batch_axis=0, time_axis=1),
]

CASES = GATHERS + SCATTERS + OTHERS


@pytest.mark.parametrize(("c", "opset"), at_opsets(CASES))
def test_forward_matches_onnxruntime(c: Case, opset: int) -> None:
    check_forward(c, opset)


@pytest.mark.parametrize("c", with_grad(CASES))
def test_backward_matches_finite_differences(c: Case) -> None:
    check_backward(c)
