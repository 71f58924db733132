"""Resize (ONNX opset 13+ semantics): modes nearest, linear and cubic, separable over the resized
axes, every coordinate transformation mode and nearest mode, ``scales`` or ``sizes`` (with
``keep_aspect_ratio_policy`` and ``axes``, 18+). Coordinates are computed in float32, as ONNX
Runtime does; ``antialias`` is refused."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tessera.backends.torch_ops import Inputs, axis_of, given, ints, op


@op("Resize")
def _resize(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    X = x[0]
    if a.get("antialias", 0):
        raise NotImplementedError("Resize with antialias=1")
    axes = [axis_of(d, X.dim()) for d in a.get("axes") or range(X.dim())]
    lengths = [X.shape[d] for d in axes]
    sizes, scales = _output_geometry(given(x, 2), given(x, 3), lengths, a)
    roi = given(x, 1)
    bounds = roi.reshape(2, -1).t().tolist() if roi is not None and roi.numel() else [[0.0, 1.0]] * len(axes)
    for d, length, size, scale, box in zip(axes, lengths, sizes, scales, bounds, strict=True):
        if size != length or scale != 1 or a.get("coordinate_transformation_mode") == "tf_crop_and_resize":
            X = _resize_axis(X, d, _source_coordinates(length, size, scale, box, a), a)
    return X


def _output_geometry(
    scales: Tensor | None, sizes: Tensor | None, lengths: Sequence[int], a: Mapping[str, Any]
) -> tuple[list[int], list[np.float32]]:
    """Output sizes and the float32 scales coordinates are mapped with."""
    if sizes is not None and sizes.numel():
        out = ints(sizes)
        ratios = [np.float32(o) / np.float32(n) for o, n in zip(out, lengths, strict=True)]
        policy = a.get("keep_aspect_ratio_policy", "stretch")
        if policy == "stretch":
            return out, ratios
        ratio = min(ratios) if policy == "not_larger" else max(ratios)
        return [math.floor(ratio * n + 0.5) for n in lengths], [ratio] * len(lengths)
    factors = [np.float32(s) for s in scales.reshape(-1).tolist()]  # type: ignore[union-attr]
    return [int(np.float32(n) * s) for n, s in zip(lengths, factors, strict=True)], factors


def _source_coordinates(
    length: int, size: int, scale: np.float32, box: Sequence[float], a: Mapping[str, Any]
) -> Tensor:
    """Each output position's coordinate in the input (float32)."""
    mode = a.get("coordinate_transformation_mode", "half_pixel")
    out = torch.arange(size, dtype=torch.float32)
    s = float(scale)
    if mode == "half_pixel":
        return (out + 0.5) / s - 0.5
    if mode == "half_pixel_symmetric":
        adjustment = size / (s * length)
        offset = length / 2 * (1 - adjustment)
        return offset + (out + 0.5) / s - 0.5
    if mode == "pytorch_half_pixel":
        return (out + 0.5) / s - 0.5 if size > 1 else torch.zeros(size)
    if mode == "align_corners":
        return out * ((length - 1) / (size - 1)) if size > 1 else torch.zeros(size)
    if mode == "asymmetric":
        return out / s
    if mode == "tf_crop_and_resize":
        start, end = box
        if size == 1:
            return torch.full((1,), 0.5 * (start + end) * (length - 1))
        return start * (length - 1) + out * ((end - start) * (length - 1) / (size - 1))
    raise NotImplementedError(f"Resize coordinate_transformation_mode={mode!r}")


def _along(t: Tensor, axis: int, rank: int) -> Tensor:
    return t.reshape([-1 if d == axis else 1 for d in range(rank)])


def _resize_axis(X: Tensor, axis: int, coords: Tensor, a: Mapping[str, Any]) -> Tensor:
    length, mode = X.shape[axis], a.get("mode", "nearest")
    if mode == "nearest":
        y = X.index_select(axis, _nearest(coords, a).clamp(0, length - 1))
    elif mode == "linear":
        clamped = coords.clamp(0, length - 1)
        low = clamped.floor().long()
        high = (low + 1).clamp(max=length - 1)
        w = _along((clamped - low).to(X.dtype), axis, X.dim())
        y = X.index_select(axis, low) * (1 - w) + X.index_select(axis, high) * w
    elif mode == "cubic":
        y = _cubic(X, axis, coords, a)
    else:
        raise NotImplementedError(f"Resize mode={mode!r}")
    if a.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        outside = _along((coords < 0) | (coords > length - 1), axis, X.dim())
        y = torch.where(outside, torch.tensor(a.get("extrapolation_value", 0.0), dtype=X.dtype), y)
    return y


def _nearest(coords: Tensor, a: Mapping[str, Any]) -> Tensor:
    mode = a.get("nearest_mode", "round_prefer_floor")
    if mode == "round_prefer_floor":
        picked = torch.ceil(coords - 0.5)
    elif mode == "round_prefer_ceil":
        picked = torch.floor(coords + 0.5)
    elif mode == "floor":
        picked = torch.floor(coords)
    elif mode == "ceil":
        picked = torch.ceil(coords)
    else:
        raise NotImplementedError(f"Resize nearest_mode={mode!r}")
    return picked.long()


def _cubic(X: Tensor, axis: int, coords: Tensor, a: Mapping[str, Any]) -> Tensor:
    """Keys' cubic convolution with coefficient ``cubic_coeff_a`` over the 4 nearest inputs (edges
    repeated, or left out and the weights renormalized with ``exclude_outside``)."""
    length, A = X.shape[axis], a.get("cubic_coeff_a", -0.75)
    base = coords.floor()
    t = coords - base
    weights = torch.stack([_keys(1 + t, A), _keys(t, A), _keys(1 - t, A), _keys(2 - t, A)])  # (4, size)
    taps = base.long().unsqueeze(0) + torch.arange(-1, 3).unsqueeze(1)  # (4, size)
    if a.get("exclude_outside", 0):
        weights = torch.where((taps < 0) | (taps >= length), torch.zeros_like(weights), weights)
        weights = weights / weights.sum(dim=0, keepdim=True)
    taps = taps.clamp(0, length - 1)
    y = 0
    for w, idx in zip(weights, taps, strict=True):
        y = y + X.index_select(axis, idx) * _along(w.to(X.dtype), axis, X.dim())
    return y  # type: ignore[return-value]


def _keys(d: Tensor, A: float) -> Tensor:
    """Keys (1981), Eq. 15: the cubic kernel at distance |d| ≤ 2."""
    d = d.abs()
    near = ((A + 2) * d - (A + 3)) * d * d + 1
    far = ((A * d - 5 * A) * d + 8 * A) * d - 4 * A
    return torch.where(d <= 1, near, far)
