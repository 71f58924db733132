"""Comparison, logic and bitwise operators and Where (ONNX opset 13+ semantics, numpy broadcasting):
boolean or integer results, no gradient (Where passes its branches' gradients)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from tessera.backends.torch_ops import Inputs, co_located, op


def _binary(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Inputs, Mapping[str, Any]], Tensor]:
    def apply(x: Inputs, a: Mapping[str, Any]) -> Tensor:
        return fn(*co_located(x[0], x[1]))

    return apply


BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "And": torch.logical_and,
    "Or": torch.logical_or,
    "Xor": torch.logical_xor,
    "Equal": torch.eq,
    "Less": torch.lt,
    "LessOrEqual": torch.le,
    "Greater": torch.gt,
    "GreaterOrEqual": torch.ge,
    "BitwiseAnd": torch.bitwise_and,
    "BitwiseOr": torch.bitwise_or,
    "BitwiseXor": torch.bitwise_xor,
}
for _name, _fn in BINARY.items():
    op(_name)(_binary(_fn))


@op("Not")
def _not(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.logical_not(x[0])


@op("BitwiseNot")
def _bitwise_not(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.bitwise_not(x[0])


@op("BitShift")
def _bit_shift(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    if a["direction"] == "LEFT":
        return torch.bitwise_left_shift(x[0], x[1])
    return torch.bitwise_right_shift(x[0], x[1])


@op("IsNaN")
def _is_nan(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.isnan(x[0])


@op("IsInf")
def _is_inf(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    positive, negative = a.get("detect_positive", 1), a.get("detect_negative", 1)
    if positive and negative:
        return torch.isinf(x[0])
    if positive:
        return torch.isposinf(x[0])
    if negative:
        return torch.isneginf(x[0])
    return torch.zeros_like(x[0], dtype=torch.bool)


@op("Where")
def _where(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    condition, yes, no = co_located(x[0], x[1], x[2])
    return torch.where(condition.bool(), yes, no)
