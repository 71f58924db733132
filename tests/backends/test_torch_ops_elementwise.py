"""Elementwise arithmetic, math and activations of the torch operator table against onnxruntime
(forward) and finite differences (backward), at every schema version of opsets 13–23."""

from __future__ import annotations

import numpy as np
import pytest
from backends.torch_op_cases import Case, at_opsets, case, check_backward, check_forward, normal, with_grad

X = normal(3, 4)
ROW = normal(4)
POSITIVE = np.abs(normal(3, 4)) + 0.5
INTS = np.array([[7, -7, 5], [-5, 9, 0]], dtype=np.int64)
DIVISORS = np.array([[2, 2, -3], [3, -4, 7]], dtype=np.int64)
CUBE = normal(2, 3, 4)

ARITHMETIC: list[Case] = [
    case("Add", X, ROW, grad=[0, 1]),
    case("Add", INTS, DIVISORS),
    case("Sub", X, normal(3, 1), grad=[0, 1]),
    case("Mul", X, ROW, grad=[0, 1]),
    case("Div", X, POSITIVE, grad=[0, 1]),
    case("Div", INTS, DIVISORS),  # truncates toward zero
    case("Mod", INTS, DIVISORS),  # the divisor's sign
    case("Mod", INTS, DIVISORS, fmod=1),
    case("Mod", X * 5, POSITIVE, grad=[0], fmod=1),
    case("Pow", POSITIVE, ROW, grad=[0, 1]),
    case("Pow", X, np.array(3, np.int64), grad=[0]),
    case("Max", X, ROW, normal(3, 1), grad=[0, 1, 2]),
    case("Max", X, grad=[0]),
    case("Min", X, ROW, grad=[0, 1]),
    case("Min", INTS, DIVISORS),
    case("Sum", X, ROW, normal(1, 4), grad=[0, 1, 2]),
    case("Mean", X, ROW, normal(3, 1), grad=[0, 1, 2]),
    case("Clip", X * 8, np.float32(0), np.float32(6), grad=[0]),  # ReLU6
    case("Clip", X, np.float32(-0.5), grad=[0]),
    case("Clip", X, None, np.float32(0.3), grad=[0]),
    case("Clip", X, grad=[0]),
    case("Clip", INTS, np.int64(-5), np.int64(6)),
    case("Cast", X * 4, to=6),  # float → int32 truncates
    case("Cast", INTS, to=1),
    case("Cast", X, to=9),  # bool
    case("Cast", X, to=10, tol=(1e-3, 1e-3)),  # float16
    case("CastLike", X, np.array([1], np.int64)),
    case("CastLike", INTS, ROW),
]

UNARY: list[Case] = [
    case("Abs", X, grad=[0]),
    case("Neg", X, grad=[0]),
    case("Reciprocal", POSITIVE, grad=[0]),
    case("Sqrt", POSITIVE, grad=[0]),
    case("Exp", X, grad=[0]),
    case("Log", POSITIVE, grad=[0]),
    case("Erf", X, grad=[0]),
    case("Sin", X, grad=[0]),
    case("Cos", X, grad=[0]),
    case("Tan", X * 0.5, grad=[0]),
    case("Floor", X * 3),
    case("Ceil", X * 3),
    case("Round", np.array([0.5, 1.5, -2.5, 2.4, -0.6], np.float32)),  # half to even
    case("Sign", X),
    case("Sign", INTS),
]

ACTIVATIONS: list[Case] = [
    case("Relu", X, grad=[0]),
    case("LeakyRelu", X, grad=[0], alpha=0.2),
    case("PRelu", X, ROW, grad=[0, 1]),
    case("PRelu", CUBE, normal(3, 1), grad=[0, 1]),
    case("ThresholdedRelu", X, grad=[0], alpha=0.3),
    case("ThresholdedRelu", X * 2, grad=[0]),
    case("Sigmoid", X, grad=[0]),
    case("HardSigmoid", X * 4, grad=[0], alpha=0.3, beta=0.4),
    case("HardSigmoid", X * 4, grad=[0]),
    case("HardSwish", X * 4, grad=[0]),
    case("Tanh", X, grad=[0]),
    case("Softplus", X * 10, grad=[0]),
    case("Softsign", X, grad=[0]),
    case("Mish", X, grad=[0]),
    case("Elu", X, grad=[0], alpha=0.7),
    case("Selu", X, grad=[0]),
    case("Selu", X, grad=[0], alpha=1.5, gamma=0.9),
    case("Celu", X, grad=[0], alpha=0.5),
    case("Shrink", X, grad=[0], bias=0.2, lambd=0.4),
    case("Shrink", X, grad=[0]),
    case("Gelu", X * 2, grad=[0]),
    case("Gelu", X * 2, grad=[0], approximate="tanh"),
    case("Softmax", CUBE, grad=[0]),
    case("Softmax", CUBE, grad=[0], axis=1),
    case("Softmax", CUBE, grad=[0], axis=-3),
    case("LogSoftmax", CUBE, grad=[0]),
    case("LogSoftmax", CUBE, grad=[0], axis=0),
    case("Hardmax", CUBE),
    case("Hardmax", np.array([[1, 3, 3], [2, 2, 0]], np.float32), axis=1),  # ties: the first
]

CASES = ARITHMETIC + UNARY + ACTIVATIONS


@pytest.mark.parametrize(("c", "opset"), at_opsets(CASES))
def test_forward_matches_onnxruntime(c: Case, opset: int) -> None:
    check_forward(c, opset)


@pytest.mark.parametrize("c", with_grad(CASES))
def test_backward_matches_finite_differences(c: Case) -> None:
    check_backward(c)
