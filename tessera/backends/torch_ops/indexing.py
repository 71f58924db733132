"""Indexing and sequence operators torch.onnx exports write for masks, positions and lookups
(ONNX opset 13+ semantics)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from tessera.backends.torch_ops import Inputs, op


@op("CumSum")
def _cumsum(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data, axis = x[0], int(x[1].reshape(-1)[0]) % x[0].dim()
    if a.get("reverse", 0):
        data = data.flip(axis)
    out = torch.cumsum(data, axis, dtype=data.dtype)
    if a.get("exclusive", 0):
        out = out - data
    return out.flip(axis) if a.get("reverse", 0) else out


@op("Range")
def _range(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    start, limit, delta = (t.reshape(()) for t in x[:3])
    return torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)


@op("GatherElements")
def _gather_elements(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data, idx = x[0], x[1].to(torch.int64)
    axis = a.get("axis", 0) % data.dim()
    idx = torch.where(idx < 0, idx + data.shape[axis], idx)
    return torch.gather(data, axis, idx)


@op("GatherND")
def _gather_nd(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data, idx = x[0], x[1].to(torch.int64)
    b, k = a.get("batch_dims", 0), x[1].shape[-1]
    flat = data.reshape(-1, *data.shape[b:])  # the batch dims as one: (B, ...)
    coords = idx.reshape(flat.shape[0], -1, k)  # (B, N, k)
    coords = torch.where(coords < 0, coords + torch.tensor(data.shape[b : b + k]), coords)
    rows = torch.arange(flat.shape[0]).unsqueeze(1).expand(coords.shape[:2])
    out = flat[(rows, *coords.unbind(-1))]  # (B, N, *rest)
    return out.reshape(*data.shape[:b], *idx.shape[b:-1], *data.shape[b + k :])


@op("ScatterND")
def _scatter_nd(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data, idx, updates = x[0], x[1].to(torch.int64), x[2]
    if a.get("reduction", "none") != "none":
        raise NotImplementedError("ScatterND with a reduction")
    k = idx.shape[-1]
    coords = idx.reshape(-1, k)
    out = data.clone()
    out[tuple(coords[:, j] for j in range(k))] = updates.reshape(-1, *data.shape[k:])
    return out


@op("Tile")
def _tile(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0].repeat(*[int(r) for r in x[1].reshape(-1).tolist()])


def _arg(fn: Any, x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data, axis = x[0], a.get("axis", 0)
    if a.get("select_last_index", 0):
        data, flipped = data.flip(axis), True
    else:
        flipped = False
    out = fn(data, dim=axis, keepdim=bool(a.get("keepdims", 1)))
    return (data.shape[axis] - 1 - out) if flipped else out


@op("ArgMax")
def _arg_max(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return _arg(torch.argmax, x, a)


@op("ArgMin")
def _arg_min(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return _arg(torch.argmin, x, a)
