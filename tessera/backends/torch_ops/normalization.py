"""Normalizations (ONNX opset 13+ semantics): BatchNormalization (inference: the running
statistics), LayerNormalization (with its Mean and InvStdDev outputs), RMSNormalization,
InstanceNormalization, GroupNormalization (21: scale and bias per channel; 18 is deprecated),
LpNormalization, LRN and MeanVarianceNormalization. Statistics are biased, as ONNX's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.backends.torch_ops import Inputs, axis_of, given, op


@op("BatchNormalization")
def _batch_norm(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    if a.get("training_mode", 0):
        raise NotImplementedError("BatchNormalization with training_mode=1 (inference semantics only)")
    return F.batch_norm(x[0], x[3], x[4], x[1], x[2], training=False, eps=a.get("epsilon", 1e-5))


def _stash(X: Tensor, a: Mapping[str, Any]) -> Tensor:
    """The input in the precision statistics are computed in: stash_type 1 (the default) is float32."""
    if a.get("stash_type", 1) == 1 and X.dtype in (torch.float16, torch.bfloat16):
        return X.float()
    return X


@op("LayerNormalization")
def _layer_norm(x: Inputs, a: Mapping[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
    """(Y, Mean, InvStdDev) over the axes from ``axis`` on; the bias is optional."""
    X = x[0]
    dims = tuple(range(axis_of(a.get("axis", -1), X.dim()), X.dim()))
    S = _stash(X, a)
    mean = S.mean(dim=dims, keepdim=True)
    inv_std = torch.rsqrt(((S - mean) ** 2).mean(dim=dims, keepdim=True) + a.get("epsilon", 1e-5))
    y = ((S - mean) * inv_std).to(X.dtype) * x[1]
    if (B := given(x, 2)) is not None:
        y = y + B
    return y, mean, inv_std


@op("RMSNormalization")
def _rms_norm(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    X = x[0]
    dims = tuple(range(axis_of(a.get("axis", -1), X.dim()), X.dim()))
    S = _stash(X, a)
    inv_rms = torch.rsqrt((S * S).mean(dim=dims, keepdim=True) + a.get("epsilon", 1e-5))
    return (S * inv_rms).to(X.dtype) * x[1]


def _channels(t: Tensor, rank: int) -> Tensor:
    """A per-channel vector shaped to broadcast over (N, C, ...)."""
    return t.reshape(1, -1, *[1] * (rank - 2))


@op("InstanceNormalization")
def _instance_norm(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return F.instance_norm(x[0], weight=x[1], bias=x[2], eps=a.get("epsilon", 1e-5))


@op("GroupNormalization")
def _group_norm(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    X, groups = x[0], a["num_groups"]
    S = _stash(X, a).reshape(X.shape[0], groups, -1)
    mean = S.mean(dim=-1, keepdim=True)
    inv_std = torch.rsqrt(((S - mean) ** 2).mean(dim=-1, keepdim=True) + a.get("epsilon", 1e-5))
    y = ((S - mean) * inv_std).reshape(X.shape).to(X.dtype)
    return y * _channels(x[1], X.dim()) + _channels(x[2], X.dim())


@op("LpNormalization")
def _lp_norm(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    X, axis, p = x[0], a.get("axis", -1), a.get("p", 2)
    if p == 1:
        norm = X.abs().sum(dim=axis, keepdim=True)
    elif p == 2:
        norm = torch.sqrt((X * X).sum(dim=axis, keepdim=True))
    else:
        raise ValueError(f"LpNormalization p={p} (ONNX allows 1 and 2)")
    return torch.where(norm == 0, torch.zeros_like(X), X / norm)  # a zero norm gives 0 (opset 22)


@op("LRN")
def _lrn(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    """Sums of squares over channels c - (size-1)/2 … c + (size-1)/2. An even size is refused: the
    spec's window then leans one way, onnxruntime refuses it and onnx's reference disagrees."""
    X, size = x[0], a["size"]
    if size % 2 == 0:
        raise NotImplementedError("LRN with an even size")
    front = (size - 1) // 2
    squares = (X * X).reshape(X.shape[0], 1, X.shape[1], -1)
    squares = F.pad(squares, (0, 0, front, size - 1 - front))
    sums = F.avg_pool2d(squares, (size, 1), stride=1, divisor_override=1).reshape(X.shape)
    return X / (a.get("bias", 1.0) + a.get("alpha", 1e-4) / size * sums) ** a.get("beta", 0.75)


@op("MeanVarianceNormalization")
def _mean_variance_norm(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    """(X - E[X]) / (sqrt(E[X²] - E[X]²) + 1e-9), the schema's function body."""
    X = x[0]
    dims = tuple(axis_of(d, X.dim()) for d in a.get("axes", [0, 2, 3]))
    mean = X.mean(dim=dims, keepdim=True)
    std = torch.sqrt((X * X).mean(dim=dims, keepdim=True) - mean * mean)
    return (X - mean) / (std + 1e-9)
