"""Attention and RotaryEmbedding (opset 23) of the torch operator table against onnxruntime (forward)
and finite differences (backward): grouped KV heads, 3-D inputs, causal, boolean and additive masks,
scale and soft-cap; half-split, interleaved and partial rotary, caches indexed by position ids."""

from __future__ import annotations

import numpy as np
import pytest
from backends.torch_op_cases import Case, at_opsets, case, check_backward, check_forward, normal, with_grad

OPSET_23 = range(23, 24)
Q, K, V = normal(2, 4, 5, 8), normal(2, 2, 5, 8), normal(2, 2, 5, 8)
CLOSE = (1e-4, 1e-5)
KEEP = np.tril(np.ones((5, 5), dtype=bool), k=0) | np.eye(5, k=1, dtype=bool)
ADD = (normal(2, 1, 5, 5) * 2).astype(np.float32)
POSITIONS = np.array([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]], dtype=np.int64)

ATTENTION: list[Case] = [
    case("Attention", Q, K, V, grad=[0, 1, 2], opsets=OPSET_23, tol=CLOSE),
    case("Attention", Q, K, V, grad=[0, 1, 2], is_causal=1, opsets=OPSET_23, tol=CLOSE),
    case("Attention", Q, K, V, KEEP, grad=[0, 1], opsets=OPSET_23, tol=CLOSE),
    case("Attention", Q, K, V, ADD, grad=[0, 2, 3], opsets=OPSET_23, tol=CLOSE),
    case("Attention", Q, K, V, grad=[0, 1], scale=0.2, softcap=3.0, opsets=OPSET_23, tol=CLOSE),
    case(
        "Attention",
        normal(2, 5, 32),
        normal(2, 5, 16),
        normal(2, 5, 16),
        grad=[0, 1, 2],
        q_num_heads=4,
        kv_num_heads=2,
        is_causal=1,
        opsets=OPSET_23,
        tol=CLOSE,
    ),  # fmt: skip
]
ROTARY: list[Case] = [
    case("RotaryEmbedding", normal(2, 4, 5, 8), normal(2, 5, 4), normal(2, 5, 4), grad=[0], opsets=OPSET_23),
    case(
        "RotaryEmbedding",
        normal(2, 4, 5, 8),
        normal(8, 4),
        normal(8, 4),
        POSITIONS,
        grad=[0],
        interleaved=1,
        opsets=OPSET_23,
    ),  # fmt: skip
    case(
        "RotaryEmbedding",
        normal(2, 5, 16),
        normal(8, 2),
        normal(8, 2),
        POSITIONS,
        grad=[0],
        num_heads=2,
        rotary_embedding_dim=4,
        opsets=OPSET_23,
    ),  # fmt: skip
]
CASES = ATTENTION + ROTARY


@pytest.mark.parametrize(("c", "opset"), at_opsets(CASES))
def test_forward_matches_onnxruntime(c: Case, opset: int) -> None:
    check_forward(c, opset)


@pytest.mark.parametrize("c", with_grad(CASES))
def test_backward_matches_finite_differences(c: Case) -> None:
    check_backward(c)
