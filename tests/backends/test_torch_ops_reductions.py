"""Reductions (axes as attribute or input, keepdims, noop_with_empty_axes), ArgMax/ArgMin and linear
algebra of the torch operator table against onnxruntime (forward) and finite differences
(backward), at every schema version of opsets 13–23."""

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
POSITIVE = np.abs(normal(2, 3, 4)) + 0.5
NO_AXES = np.zeros(0, np.int64)
BEFORE_18, SINCE_18 = range(13, 18), range(18, 24)

REDUCE = [
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp",
]  # fmt: skip


def _reduction_cases(op: str) -> list[Case]:
    """Every form: axes as attribute (ReduceSum: an input from 13, the others from 18) or input,
    negative axes, keepdims=0, all axes, and empty axes with noop_with_empty_axes."""
    inputs_since = range(13, 24) if op == "ReduceSum" else SINCE_18
    forms = [
        case(op, POSITIVE, grad=[0]),
        case(op, POSITIVE, i64(-1, 0), grad=[0], keepdims=0, opsets=inputs_since),
        case(op, POSITIVE, i64(1), grad=[0], opsets=inputs_since),
        case(op, POSITIVE, NO_AXES, noop_with_empty_axes=1, opsets=inputs_since),
        case(op, POSITIVE, NO_AXES, grad=[0], keepdims=0, opsets=inputs_since),
    ]
    if op != "ReduceSum":
        forms += [
            case(op, POSITIVE, grad=[0], axes=[1], opsets=BEFORE_18),
            case(op, POSITIVE, grad=[0], axes=[-1, 0], keepdims=0, opsets=BEFORE_18),
        ]
    return forms


REDUCTIONS: list[Case] = [c for op in REDUCE for c in _reduction_cases(op)] + [
    *(
        case(op, X, NO_AXES, noop_with_empty_axes=1, opsets=SINCE_18)
        for op in ("ReduceL1", "ReduceL2", "ReduceSumSquare")
    ),
    case("ReduceSum", np.array([[1, 2], [3, 4]], np.int32), i64(0)),  # stays int32
    case("ReduceMax", np.array([[1, 5], [3, 4]], np.int64), i64(1), keepdims=0, opsets=SINCE_18),
    case("ArgMax", X, axis=1),
    case("ArgMin", X, keepdims=0),
    case("ArgMax", np.array([[1, 3, 3], [2, 2, 0]], np.float32), axis=-1, select_last_index=1),
    case("ArgMin", np.array([[1, 0, 0], [2, 2, 0]], np.float32), axis=1, keepdims=0, select_last_index=1),
]

LINALG: list[Case] = [
    case("MatMul", X, normal(4, 5), grad=[0, 1]),
    case("MatMul", normal(2, 3, 4), normal(4, 2), grad=[0, 1]),
    case("MatMul", normal(4), normal(2, 4, 3), grad=[0, 1]),
    case("Gemm", X, normal(4, 5), normal(5), grad=[0, 1, 2]),
    case("Gemm", X, normal(5, 3), normal(4, 1), grad=[0, 1, 2], transA=1, transB=1, alpha=0.5, beta=2.0),
    case("Gemm", X, normal(4, 2), grad=[0, 1]),
    case("Einsum", X, normal(4, 5), grad=[0, 1], equation="ij,jk->ik"),
    case("Einsum", normal(2, 3, 4), normal(2, 4, 2), grad=[0, 1], equation="bij,bjk->bik"),
    case("Einsum", normal(2, 3, 4), grad=[0], equation="...ij->...ji"),
    case("Einsum", normal(3, 3), grad=[0], equation="ii->i"),
    case("Einsum", normal(3), normal(2), grad=[0, 1], equation="i,j->ij"),
    case("Det", normal(3, 3), grad=[0]),
    case("Det", normal(2, 3, 3), grad=[0]),
]

CASES = REDUCTIONS + LINALG


@pytest.mark.parametrize(("c", "opset"), at_opsets(CASES))
def test_forward_matches_onnxruntime(c: Case, opset: int) -> None:
    check_forward(c, opset)


@pytest.mark.parametrize("c", with_grad(CASES))
def test_backward_matches_finite_differences(c: Case) -> None:
    check_backward(c)
