"""Shape and layout operators (ONNX opset 13+ semantics; axes, sizes and pads as inputs where the
newer opsets moved them there, as attributes where the older ones keep them), and the pass-throughs
Identity and Dropout (inference: the identity, as ONNX Runtime runs it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.backends.torch_ops import Inputs, axes_of, axis_of, co_located, given, ints, op, scalar


@op("Identity")
def _identity(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0]


@op("Dropout")
def _dropout(x: Inputs, a: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
    training = given(x, 2)
    if training is not None and bool(scalar(training)):
        raise NotImplementedError("Dropout with training_mode=true is random (a step must be reproducible)")
    return x[0], torch.ones_like(x[0], dtype=torch.bool)  # (output, mask)


@op("Reshape")
def _reshape(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    shape = ints(x[1])
    if not a.get("allowzero", 0):  # 0 copies the input's dimension
        shape = [x[0].shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return x[0].reshape(shape)


@op("Flatten")
def _flatten(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    rank = x[0].dim()
    axis = a.get("axis", 1)
    axis = axis + rank if axis < 0 else axis  # in [-rank, rank]
    lead = int(np.prod(x[0].shape[:axis], dtype=np.int64))
    return x[0].reshape(lead, -1)


@op("Transpose")
def _transpose(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    perm = a.get("perm") or list(reversed(range(x[0].dim())))
    return x[0].permute(*perm)


@op("Concat")
def _concat(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.cat(co_located(*(t for t in x if t is not None)), dim=a["axis"])


@op("Split")
def _split(x: Inputs, a: Mapping[str, Any]) -> tuple[Tensor, ...]:
    """Sizes as input (13+) or attribute (< 13), or ``num_outputs`` parts (18+; 13: as many as the node
    has outputs), the last one smaller when the axis does not divide."""
    X, axis = x[0], a.get("axis", 0)
    sizes = ints(given(x, 1)) if given(x, 1) is not None else a.get("split")
    if not sizes:
        parts, length = a["num_outputs"], X.shape[axis]
        chunk = -(-length // parts)
        sizes = [chunk] * (parts - 1) + [length - chunk * (parts - 1)]
        if sizes[-1] < 0:
            raise ValueError(f"Split: {length} elements cannot make {parts} parts")
    return tuple(torch.split(X, list(sizes), dim=axis))


@op("Squeeze")
def _squeeze(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    axes = axes_of(x, a, 1)
    if axes is None:
        return x[0].squeeze()
    dims = tuple(axis_of(d, x[0].dim()) for d in axes)
    if any(x[0].shape[d] != 1 for d in dims):
        raise ValueError(f"Squeeze: axes {axes} of shape {tuple(x[0].shape)} are not all 1")
    return x[0].squeeze(dims)


@op("Unsqueeze")
def _unsqueeze(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    axes = axes_of(x, a, 1) or []
    rank = x[0].dim() + len(axes)
    y = x[0]
    for ax in sorted(axis_of(d, rank) for d in axes):
        y = y.unsqueeze(ax)
    return y


@op("Expand")
def _expand(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    shape = torch.broadcast_shapes(tuple(x[0].shape), tuple(ints(x[1])))
    return x[0].expand(shape)


@op("Tile")
def _tile(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0].repeat(*ints(x[1]))


@op("Shape")
def _shape(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    dims = list(x[0].shape)
    start, end = a.get("start", 0), a.get("end", len(dims))
    return torch.tensor(dims[start:end], dtype=torch.int64)  # Python's slice clamps as ONNX does


@op("Size")
def _size(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.tensor(x[0].numel(), dtype=torch.int64)


@op("Slice")
def _slice(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    X = x[0]
    starts, ends = ints(x[1]), ints(x[2])
    axes = ints(given(x, 3)) if given(x, 3) is not None else list(range(len(starts)))
    steps = ints(given(x, 4)) if given(x, 4) is not None else [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis = axis_of(axis, X.dim())
        idx = range(X.shape[axis])[slice(start, end, step)]  # Python's clamping is ONNX's
        if step == 1:
            X = X.narrow(axis, idx.start, len(idx))
        else:
            X = X.index_select(axis, torch.tensor(list(idx), dtype=torch.int64))
    return X


@op("Pad")
def _pad(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    """Modes constant, reflect, edge and wrap (19+); pads as input (11+), axes as input (18+);
    negative pads crop."""
    X, mode = x[0], a.get("mode", "constant")
    pads = ints(x[1]) if given(x, 1) is not None else list(a["pads"])
    axes = [axis_of(d, X.dim()) for d in (ints(given(x, 3)) or range(X.dim()))]
    n = len(axes)
    begin = dict(zip(axes, pads[:n], strict=True))
    end = dict(zip(axes, pads[n:], strict=True))
    if mode == "constant":
        value = given(x, 2)
        flat: list[int] = []
        for d in reversed(range(X.dim())):
            flat += [begin.get(d, 0), end.get(d, 0)]
        return F.pad(X, flat, value=scalar(value) if value is not None and value.numel() else 0)
    for d in axes:
        X = _pad_axis(X, d, begin[d], end[d], mode)
    return X


def _pad_axis(X: Tensor, axis: int, begin: int, end: int, mode: str) -> Tensor:
    if begin < 0:
        X, begin = X.narrow(axis, -begin, X.shape[axis] + begin), 0
    if end < 0:
        X, end = X.narrow(axis, 0, X.shape[axis] + end), 0
    n = X.shape[axis]
    idx = torch.arange(-begin, n + end)
    if mode == "edge":
        idx = idx.clamp(0, n - 1)
    elif mode == "wrap":
        idx = idx % n
    elif mode == "reflect":
        if n < 2:
            raise ValueError("Pad: reflect needs at least 2 elements on each padded axis")
        period = 2 * (n - 1)
        idx = idx % period
        idx = torch.where(idx >= n, period - idx, idx)
    else:
        raise NotImplementedError(f"Pad mode {mode!r}")
    return X.index_select(axis, idx)


@op("DepthToSpace")
def _depth_to_space(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    X, b = x[0], a["blocksize"]
    N, C, H, W = X.shape
    if a.get("mode", "DCR") == "DCR":
        y = X.reshape(N, b, b, C // (b * b), H, W).permute(0, 3, 4, 1, 5, 2)
    else:  # CRD
        y = X.reshape(N, C // (b * b), b, b, H, W).permute(0, 1, 4, 2, 5, 3)
    return y.reshape(N, C // (b * b), H * b, W * b)


@op("SpaceToDepth")
def _space_to_depth(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    X, b = x[0], a["blocksize"]
    if a.get("mode", "DCR") != "DCR":  # the mode attribute of SpaceToDepth-28
        raise NotImplementedError(f"SpaceToDepth mode={a['mode']}")
    N, C, H, W = X.shape
    y = X.reshape(N, C, H // b, b, W // b, b).permute(0, 3, 5, 1, 2, 4)
    return y.reshape(N, C * b * b, H // b, W // b)
