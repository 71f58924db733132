"""Activations and the softmax family (ONNX opset 13+ semantics: Softmax, LogSoftmax and Hardmax act
on one axis, default -1), differentiable where the operator is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.backends.torch_ops import Inputs, op


@op("Relu")
def _relu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.relu(x[0])


@op("LeakyRelu")
def _leaky_relu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return F.leaky_relu(x[0], a.get("alpha", 0.01))


@op("PRelu")
def _prelu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.where(x[0] < 0, x[1] * x[0], x[0])  # the slope broadcasts to X


@op("ThresholdedRelu")
def _thresholded_relu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.where(x[0] > a.get("alpha", 1.0), x[0], torch.zeros_like(x[0]))


@op("Sigmoid")
def _sigmoid(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.sigmoid(x[0])


@op("HardSigmoid")
def _hard_sigmoid(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.clamp(a.get("alpha", 0.2) * x[0] + a.get("beta", 0.5), 0.0, 1.0)


@op("HardSwish")
def _hard_swish(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return F.hardswish(x[0])  # x * max(0, min(1, x / 6 + 1/2))


@op("Tanh")
def _tanh(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.tanh(x[0])


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


@op("Celu")
def _celu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return F.celu(x[0], alpha=a.get("alpha", 1.0))  # max(0, x) + min(0, alpha * (exp(x / alpha) - 1))


@op("Shrink")
def _shrink(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    X, bias, lambd = x[0], a.get("bias", 0.0), a.get("lambd", 0.5)
    zero = torch.zeros_like(X)
    return torch.where(X < -lambd, X + bias, torch.where(X > lambd, X - bias, zero))


@op("Gelu")
def _gelu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return F.gelu(x[0], approximate=a.get("approximate", "none"))  # "tanh": the same formula


@op("Softmax")
def _softmax(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.softmax(x[0], dim=a.get("axis", -1))


@op("LogSoftmax")
def _log_softmax(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.log_softmax(x[0], dim=a.get("axis", -1))


@op("Hardmax")
def _hardmax(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    axis = a.get("axis", -1)
    first = torch.argmax(x[0], dim=axis, keepdim=True)  # the first maximum, as ONNX
    return torch.zeros_like(x[0]).scatter(axis, first, 1.0)
