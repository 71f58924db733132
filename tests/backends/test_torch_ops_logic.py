"""Comparison, logic and bitwise operators and Where against onnxruntime, at every schema version of
opsets 13–23 (Where's branches also against finite differences)."""

from __future__ import annotations

import numpy as np
import pytest
from backends.torch_op_cases import Case, at_opsets, case, check_backward, check_forward, normal, with_grad

X = normal(3, 4)
ROW = normal(4)
INTS = np.array([[1, 2, 3], [3, 2, 1]], dtype=np.int64)
BYTES = np.array([[0b1010, 0b0110, 255], [1, 128, 7]], dtype=np.uint8)
SHIFTS = np.array([1, 2, 3], dtype=np.uint8)
SPECIAL = np.array([1.0, np.nan, np.inf, -np.inf, 0.0], np.float32)

CASES: list[Case] = [
    case("And", X > 0, X < 0.5),
    case("Or", X > 0, ROW < -0.5),
    case("Xor", X > 0, X < 0.5),
    case("Not", X > 0),
    case("Equal", INTS, np.int64(2)),
    case("Equal", X, X.T[:1].T),
    case("Equal", X > 0, ROW > 0),
    case("Less", X, ROW),
    case("LessOrEqual", X, np.float32(0.1)),
    case("LessOrEqual", INTS, INTS[:1]),
    case("Greater", X, ROW),
    case("GreaterOrEqual", X, X.T[:1].T),
    case("GreaterOrEqual", INTS, np.int64(2)),
    case("IsNaN", SPECIAL),
    case("IsInf", SPECIAL),
    case("IsInf", SPECIAL, detect_negative=0),
    case("IsInf", SPECIAL, detect_positive=0),
    case("BitwiseAnd", BYTES, BYTES[::-1]),
    case("BitwiseOr", INTS, np.int64(4)),
    case("BitwiseXor", BYTES, np.uint8(0xF0)),
    case("BitwiseNot", BYTES),
    case("BitwiseNot", INTS),
    case("BitShift", BYTES, SHIFTS, direction="LEFT"),
    case("BitShift", BYTES, SHIFTS, direction="RIGHT"),
    case("Where", X > 0, X, np.float32(0), grad=[1]),
    case("Where", ROW > 0, X, normal(3, 1), grad=[1, 2]),
    case("Where", X > 0, INTS[:1, :1], np.int64(-1)),
]


@pytest.mark.parametrize(("c", "opset"), at_opsets(CASES))
def test_forward_matches_onnxruntime(c: Case, opset: int) -> None:
    check_forward(c, opset)


@pytest.mark.parametrize("c", with_grad(CASES))
def test_backward_matches_finite_differences(c: Case) -> None:
    check_backward(c)
