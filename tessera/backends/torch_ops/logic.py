"""Comparison and logic operators (ONNX opset 13+ semantics, numpy broadcasting): boolean results,
no gradient."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from tessera.backends.torch_ops import Inputs, op


@op("And")
def _and(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.logical_and(x[0], x[1])


@op("Or")
def _or(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.logical_or(x[0], x[1])


@op("Xor")
def _xor(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.logical_xor(x[0], x[1])


@op("LessOrEqual")
def _less_or_equal(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.le(x[0], x[1])


@op("GreaterOrEqual")
def _greater_or_equal(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.ge(x[0], x[1])


@op("IsNaN")
def _is_nan(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.isnan(x[0])


@op("IsInf")
def _is_inf(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    t = x[0]
    if a.get("detect_positive", 1) and a.get("detect_negative", 1):
        return torch.isinf(t)
    if a.get("detect_positive", 1):
        return torch.isposinf(t)
    if a.get("detect_negative", 1):
        return torch.isneginf(t)
    return torch.zeros_like(t, dtype=torch.bool)
