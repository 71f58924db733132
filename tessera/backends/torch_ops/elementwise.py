"""Elementwise arithmetic and math (ONNX opset 13+ semantics, numpy broadcasting): the binary and
variadic operators, unary math, rounding, Clip and the casts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from tessera.backends.torch_ops import Inputs, co_located, given, op, torch_dtype


@op("Add")
def _add(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    lhs, rhs = co_located(x[0], x[1])
    return lhs + rhs


@op("Sub")
def _sub(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    lhs, rhs = co_located(x[0], x[1])
    return lhs - rhs


@op("Mul")
def _mul(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    lhs, rhs = co_located(x[0], x[1])
    return lhs * rhs


@op("Div")
def _div(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    n, d = co_located(x[0], x[1])
    if n.is_floating_point():
        return n / d
    return torch.div(n, d, rounding_mode="trunc")  # ONNX integer Div truncates


@op("Mod")
def _mod(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    """fmod=0: the remainder takes the divisor's sign (integers only); fmod=1: the dividend's (C)."""
    if a.get("fmod", 0):
        return torch.fmod(x[0], x[1])
    if x[0].is_floating_point():
        raise ValueError("Mod of floating-point tensors needs fmod=1 (the ONNX spec)")
    return torch.remainder(x[0], x[1])


@op("Pow")
def _pow(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    base, exponent = co_located(x[0], x[1])
    return torch.pow(base, exponent).to(base.dtype)  # the result has the base's type


def _unary(fn: Callable[[Tensor], Tensor]) -> Callable[[Inputs, Mapping[str, Any]], Tensor]:
    def apply(x: Inputs, a: Mapping[str, Any]) -> Tensor:
        return fn(x[0])

    return apply


# Unary math: the torch function computes the ONNX definition exactly.
UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "Abs": torch.abs,
    "Neg": torch.neg,
    "Reciprocal": torch.reciprocal,
    "Sqrt": torch.sqrt,
    "Exp": torch.exp,
    "Log": torch.log,
    "Erf": torch.erf,
    "Sin": torch.sin,
    "Cos": torch.cos,
    "Tan": torch.tan,
    "Floor": torch.floor,
    "Ceil": torch.ceil,
    "Round": torch.round,  # half to even, as ONNX
    "Sign": torch.sign,
}
for _name, _fn in UNARY.items():
    op(_name)(_unary(_fn))


def _fold(fn: Callable[[Tensor, Tensor], Tensor], x: Inputs) -> Tensor:
    out = x[0]
    for y in x[1:]:
        out = fn(out, y)
    return out


@op("Max")
def _max(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return _fold(torch.maximum, x)


@op("Min")
def _min(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return _fold(torch.minimum, x)


@op("Sum")
def _sum(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return _fold(torch.add, x)


@op("Mean")
def _mean(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return _fold(torch.add, x) / len(x)


@op("Clip")
def _clip(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    """Bounds as inputs (opset 11+; absent: unbounded) or attributes (older opsets)."""
    low = given(x, 1) if given(x, 1) is not None else a.get("min")
    high = given(x, 2) if given(x, 2) is not None else a.get("max")
    out = x[0]
    if low is not None:
        out = torch.maximum(out, torch.as_tensor(low, dtype=out.dtype))
    if high is not None:
        out = torch.minimum(out, torch.as_tensor(high, dtype=out.dtype))
    return out


@op("Cast")
def _cast(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0].to(torch_dtype(a["to"]))


@op("CastLike")
def _cast_like(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0].to(x[1].dtype)
