"""Indexing operators (ONNX opset 13+ semantics; negative indices count from the end): gathers and
scatters (differentiable in the data and the updates), OneHot, TopK, NonZero, Compress, CumSum,
ReverseSequence and Trilu."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from tessera.backends.torch_ops import Inputs, axis_of, co_located, given, ints, op, scalar


def _wrap(idx: Tensor, size: int | Tensor) -> Tensor:
    idx = idx.to(torch.int64)
    return torch.where(idx < 0, idx + size, idx)


@op("Gather")
def _gather(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data, idx = co_located(x[0], x[1])
    axis = axis_of(a.get("axis", 0), data.dim())
    idx = _wrap(idx, data.shape[axis])
    flat = data.index_select(axis, idx.reshape(-1))
    # A tuple, not varargs: a scalar index on a 1-D tensor (Shape → Gather(0)) gives shape ().
    return flat.reshape((*data.shape[:axis], *idx.shape, *data.shape[axis + 1 :]))


@op("GatherElements")
def _gather_elements(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data, idx = co_located(x[0], x[1])
    axis = axis_of(a.get("axis", 0), data.dim())
    return torch.gather(data, axis, _wrap(idx, data.shape[axis]))


@op("GatherND")
def _gather_nd(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data, idx = x[0], x[1].to(torch.int64)
    b, k = a.get("batch_dims", 0), x[1].shape[-1]
    flat = data.reshape(-1, *data.shape[b:])  # the batch dims as one: (B, ...)
    coords = _wrap(idx.reshape(flat.shape[0], -1, k), torch.tensor(data.shape[b : b + k]))  # (B, N, k)
    rows = torch.arange(flat.shape[0]).unsqueeze(1).expand(coords.shape[:2])
    out = flat[(rows, *coords.unbind(-1))]  # (B, N, *rest)
    return out.reshape(*data.shape[:b], *idx.shape[b:-1], *data.shape[b + k :])


# ONNX's scatter reductions as torch's.
_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


@op("ScatterND")
def _scatter_nd(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    """Reductions none, add, mul (16+), max and min (18+)."""
    data, idx, updates = x[0], x[1], x[2]
    k = idx.shape[-1]
    lead = data.shape[:k]
    coords = _wrap(idx.reshape(-1, k), torch.tensor(lead))
    strides = torch.tensor([math.prod(lead[j + 1 :]) for j in range(k)])
    rows = (coords * strides).sum(-1)  # row-major positions in data's first k dims
    flat = data.reshape(-1, *data.shape[k:])
    source = updates.reshape(-1, *data.shape[k:])
    reduction = a.get("reduction", "none")
    if reduction == "none":
        out = flat.index_put((rows,), source)
    elif reduction == "add":
        out = flat.index_add(0, rows, source)
    else:
        spread = rows.reshape(-1, *[1] * (source.dim() - 1)).expand_as(source)
        out = flat.scatter_reduce(0, spread, source, _REDUCE[reduction])
    return out.reshape(data.shape)


@op("ScatterElements")
def _scatter_elements(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    """Reductions none, add, mul (16+), max and min (18+)."""
    data, idx = co_located(x[0], x[1])
    axis = axis_of(a.get("axis", 0), data.dim())
    idx = _wrap(idx, data.shape[axis])
    reduction = a.get("reduction", "none")
    if reduction == "none":
        return torch.scatter(data, axis, idx, x[2])
    return torch.scatter_reduce(data, axis, idx, x[2], _REDUCE[reduction])


@op("OneHot")
def _one_hot(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    depth = int(scalar(x[1]))
    idx = _wrap(x[0], depth)  # out of [-depth, depth): every position off
    rank = x[0].dim() + 1
    axis = axis_of(a.get("axis", -1), rank)
    positions = torch.arange(depth).reshape([depth if d == axis else 1 for d in range(rank)])
    off, on = x[2].reshape(-1)
    return torch.where(idx.unsqueeze(axis) == positions, on, off)


@op("TopK")
def _top_k(x: Inputs, a: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
    """Values and indices, ties to the lower index (a stable sort); sorted=0 leaves the order open
    in ONNX, so the sorted order is as good as any."""
    X, k, axis = x[0], int(scalar(x[1])), a.get("axis", -1)
    values, indices = torch.sort(X, dim=axis, descending=bool(a.get("largest", 1)), stable=True)
    return values.narrow(axis, 0, k), indices.narrow(axis, 0, k)


@op("NonZero")
def _non_zero(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.nonzero(x[0]).t().contiguous()  # (rank, count), row-major order


@op("Compress")
def _compress(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data, kept = x[0], torch.nonzero(x[1].reshape(-1)).reshape(-1)
    if "axis" not in a:
        return data.reshape(-1).index_select(0, kept)
    return data.index_select(axis_of(a["axis"], data.dim()), kept)


@op("CumSum")
def _cumsum(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data = x[0]
    axis = axis_of(int(scalar(x[1])), data.dim())
    reverse = bool(a.get("reverse", 0))
    if reverse:
        data = data.flip(axis)
    out = torch.cumsum(data, axis, dtype=data.dtype)
    if a.get("exclusive", 0) and data.shape[axis]:  # shift by one: the first sum is 0
        zero = torch.zeros_like(data.narrow(axis, 0, 1))
        out = torch.cat([zero, out.narrow(axis, 0, data.shape[axis] - 1)], dim=axis)
    return out.flip(axis) if reverse else out


@op("ReverseSequence")
def _reverse_sequence(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    """Each batch entry's first ``sequence_lens[b]`` steps reversed, the rest kept."""
    X, lengths = x[0], x[1].to(torch.int64).unsqueeze(1)  # (B, 1)
    batch_axis, time_axis = a.get("batch_axis", 1), a.get("time_axis", 0)
    steps = torch.arange(X.shape[time_axis]).unsqueeze(0)  # (1, T)
    source = torch.where(steps < lengths, lengths - 1 - steps, steps)  # (B, T)
    if time_axis < batch_axis:
        source = source.t()
    source = source.reshape(*source.shape, *[1] * (X.dim() - 2)).expand_as(X)
    return torch.gather(X, time_axis, source)


@op("Trilu")
def _trilu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    k = ints(given(x, 1))[0] if given(x, 1) is not None else 0
    return torch.triu(x[0], k) if a.get("upper", 1) else torch.tril(x[0], k)
