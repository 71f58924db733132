"""Elementwise math and activations beyond the core set (ONNX opset 13+ semantics), differentiable
where the operator is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.backends.torch_ops import Inputs, op


@op("Sin")
def _sin(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.sin(x[0])


@op("Cos")
def _cos(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.cos(x[0])


@op("Tan")
def _tan(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.tan(x[0])


@op("HardSigmoid")
def _hard_sigmoid(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.clamp(a.get("alpha", 0.2) * x[0] + a.get("beta", 0.5), 0.0, 1.0)


@op("HardSwish")
def _hard_swish(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    # ONNX: x * max(0, min(1, x / 6 + 1/2)), torch's hardswish exactly.
    return F.hardswish(x[0])


@op("Softplus")
def _softplus(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.log1p(torch.exp(-x[0].abs())) + torch.relu(x[0])  # log(1 + e^x), stable


@op("Softsign")
def _softsign(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0] / (1 + x[0].abs())


@op("Mish")
def _mish(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return F.mish(x[0])


@op("Elu")
def _elu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return F.elu(x[0], alpha=a.get("alpha", 1.0))


@op("Selu")
def _selu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    alpha, gamma = a.get("alpha", 1.67326319217681884765625), a.get("gamma", 1.05070102214813232421875)
    return gamma * torch.where(x[0] > 0, x[0], alpha * torch.expm1(x[0]))


@op("Floor")
def _floor(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.floor(x[0])


@op("Ceil")
def _ceil(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.ceil(x[0])


@op("Round")
def _round(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.round(x[0])  # half to even, as ONNX


@op("Sign")
def _sign(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.sign(x[0])


@op("Clip")
def _clip(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    """Bounds as inputs (opset 11+; absent: unbounded) or attributes (older opsets)."""
    low = x[1] if len(x) > 1 and x[1] is not None else a.get("min")
    high = x[2] if len(x) > 2 and x[2] is not None else a.get("max")
    out = x[0]
    if low is not None:
        out = torch.maximum(out, torch.as_tensor(low, dtype=out.dtype))
    if high is not None:
        out = torch.minimum(out, torch.as_tensor(high, dtype=out.dtype))
    return out


@op("CastLike")
def _cast_like(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0].to(x[1].dtype)
