"""Linear algebra (ONNX opset 13+ semantics): MatMul (numpy's batched matmul), Gemm, Einsum and
Det."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from tessera.backends.torch_ops import Inputs, given, op


@op("MatMul")
def _matmul(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.matmul(x[0], x[1])


@op("Gemm")
def _gemm(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    A = x[0].t() if a.get("transA", 0) else x[0]
    B = x[1].t() if a.get("transB", 0) else x[1]
    alpha, beta = a.get("alpha", 1.0), a.get("beta", 1.0)
    if (C := given(x, 2)) is not None:
        # one addmm (forward and backward), not a product, two scalings and an add
        return torch.addmm(C, A, B, beta=beta, alpha=alpha)
    return A @ B if alpha == 1.0 else alpha * (A @ B)


@op("Einsum")
def _einsum(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.einsum(a["equation"], *x)  # the same equation language, ellipsis included


@op("Det")
def _det(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.linalg.det(x[0])
