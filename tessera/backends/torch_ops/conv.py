"""Convolution and pooling over 1–3 spatial axes (ONNX opset 13+ semantics): Conv, ConvTranspose,
MaxPool (the output; not the Indices), AveragePool, LpPool, GlobalAveragePool and GlobalMaxPool; explicit pads
(asymmetric too) or ``auto_pad``, ``ceil_mode`` with ONNX's output sizes."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.backends.torch_ops import Inputs, given, op


def _per_axis(a: Mapping[str, Any], key: str, n: int, default: int) -> list[int]:
    return list(a.get(key) or [default] * n)


def _pads(
    a: Mapping[str, Any], sizes: Sequence[int], kernel: Sequence[int], strides: Sequence[int]
) -> tuple[list[int], list[int]]:
    """(begin, end) pads per spatial axis, from ``pads`` or ``auto_pad`` (SAME_*: output = ⌈in /
    stride⌉, the odd pixel at the end for SAME_UPPER, at the beginning for SAME_LOWER)."""
    n, auto = len(sizes), a.get("auto_pad", "NOTSET")
    if auto == "NOTSET":
        pads = list(a.get("pads") or [0] * 2 * n)
        return pads[:n], pads[n:]
    if auto == "VALID":
        return [0] * n, [0] * n
    if auto not in ("SAME_UPPER", "SAME_LOWER"):
        raise NotImplementedError(f"auto_pad={auto}")
    begin, end = [], []
    for size, k, s in zip(sizes, kernel, strides, strict=True):
        total = max(0, (math.ceil(size / s) - 1) * s + k - size)
        small, large = total // 2, total - total // 2
        begin.append(small if auto == "SAME_UPPER" else large)
        end.append(large if auto == "SAME_UPPER" else small)
    return begin, end


def _pad_list(begin: Sequence[int], end: Sequence[int]) -> list[int]:
    """Per-axis (begin, end) as F.pad's list, the last axis first."""
    flat: list[int] = []
    for b, e in zip(reversed(begin), reversed(end), strict=True):
        flat += [b, e]
    return flat


def _dilated(kernel: Sequence[int], dilations: Sequence[int]) -> list[int]:
    return [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]


@op("Conv")
def _conv(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    X, W = x[0], x[1]
    n = X.dim() - 2
    strides, dilations = _per_axis(a, "strides", n, 1), _per_axis(a, "dilations", n, 1)
    begin, end = _pads(a, X.shape[2:], _dilated(W.shape[2:], dilations), strides)
    if begin != end:
        X, begin = F.pad(X, _pad_list(begin, end)), [0] * n
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[n]
    return conv(X, W, given(x, 2), strides, begin, dilations, a.get("group", 1))


@op("ConvTranspose")
def _conv_transpose(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    """The full transposed convolution, then ONNX's pads cropped and ``output_padding`` appended
    (those positions get no input, only the bias)."""
    X, W = x[0], x[1]
    n = X.dim() - 2
    strides, dilations = _per_axis(a, "strides", n, 1), _per_axis(a, "dilations", n, 1)
    extra = _per_axis(a, "output_padding", n, 0)
    full = [
        (size - 1) * s + k + e
        for size, s, k, e in zip(X.shape[2:], strides, _dilated(W.shape[2:], dilations), extra, strict=True)
    ]
    begin, end = _transpose_pads(a, X.shape[2:], full, strides)
    conv = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[n]
    y = conv(X, W, None, strides, 0, 0, a.get("group", 1), dilations)
    y = F.pad(y, _pad_list([-b for b in begin], [e - p for e, p in zip(extra, end, strict=True)]))
    if (B := given(x, 2)) is not None:
        y = y + B.reshape(1, -1, *[1] * n)
    return y


def _transpose_pads(
    a: Mapping[str, Any], sizes: Sequence[int], full: Sequence[int], strides: Sequence[int]
) -> tuple[list[int], list[int]]:
    """ConvTranspose's pads: given, or from ``output_shape`` / SAME_* (output = in × stride), the odd
    pixel at the beginning unless SAME_UPPER (the ONNX spec)."""
    n, auto = len(sizes), a.get("auto_pad", "NOTSET")
    if "output_shape" in a:
        out = list(a["output_shape"])[-n:]
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        out = [size * s for size, s in zip(sizes, strides, strict=True)]
    elif auto == "VALID":
        return [0] * n, [0] * n
    elif auto == "NOTSET":
        pads = list(a.get("pads") or [0] * 2 * n)
        return pads[:n], pads[n:]
    else:
        raise NotImplementedError(f"auto_pad={auto}")
    totals = [f - o for f, o in zip(full, out, strict=True)]
    if auto == "SAME_UPPER":
        return [t // 2 for t in totals], [t - t // 2 for t in totals]
    return [t - t // 2 for t in totals], [t // 2 for t in totals]


def _onnx_pool_sizes(
    sizes: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    begin: Sequence[int],
    end: Sequence[int],
    ceil: bool,
) -> list[int]:
    """ONNX's pooled sizes; with ceil_mode, a last window that would start in the end padding is
    dropped."""
    out = []
    for size, k, s, b, e in zip(sizes, kernel, strides, begin, end, strict=True):
        span = size + b + e - k
        count = (math.ceil(span / s) if ceil else span // s) + 1
        if ceil and (count - 1) * s >= size + b:
            count -= 1
        out.append(count)
    return out


def _crop(y: Tensor, sizes: Sequence[int]) -> Tensor:
    for axis, size in enumerate(sizes, start=2):
        y = y.narrow(axis, 0, min(size, y.shape[axis]))
    return y


def _pool_geometry(
    X: Tensor, a: Mapping[str, Any], dilations: Sequence[int] | None = None
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(kernel, strides, begin pads, end pads, ONNX output sizes) of a pooling node."""
    n = X.dim() - 2
    kernel, strides = list(a["kernel_shape"]), _per_axis(a, "strides", n, 1)
    span = _dilated(kernel, dilations or [1] * n)
    begin, end = _pads(a, X.shape[2:], span, strides)
    return (
        kernel,
        strides,
        begin,
        end,
        _onnx_pool_sizes(X.shape[2:], span, strides, begin, end, bool(a.get("ceil_mode", 0))),
    )


@op("MaxPool")
def _max_pool(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    X = x[0]
    n = X.dim() - 2
    dilations = _per_axis(a, "dilations", n, 1)
    kernel, strides, begin, end, sizes = _pool_geometry(X, a, dilations)
    implicit = begin == end and all(
        2 * b <= s for b, s in zip(begin, _dilated(kernel, dilations), strict=True)
    )
    if not implicit:  # torch pads at most half a window, symmetrically: pad explicitly
        X, begin = F.pad(X, _pad_list(begin, end), value=float("-inf")), [0] * n
    pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[n]
    y = pool(X, kernel, strides, begin, dilations, ceil_mode=bool(a.get("ceil_mode", 0)))
    return _crop(y, sizes)


def _sum_pool(t: Tensor, kernel: Sequence[int], strides: Sequence[int], ceil: bool) -> Tensor:
    """Window sums (no padding): an average pool with divisor 1 (1-D as 2-D)."""
    if len(kernel) == 1:
        return _sum_pool(t.unsqueeze(-1), [*kernel, 1], [*strides, 1], ceil).squeeze(-1)
    pool = {2: F.avg_pool2d, 3: F.avg_pool3d}[len(kernel)]
    return pool(t, list(kernel), list(strides), 0, ceil, True, 1)


def _no_dilation(a: Mapping[str, Any], name: str) -> None:
    if any(d != 1 for d in a.get("dilations") or []):
        raise NotImplementedError(f"{name} with dilations")


@op("AveragePool")
def _average_pool(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    """Padding counted or not (``count_include_pad``); a window over the end of the padded input
    (``ceil_mode``) averages what it covers."""
    _no_dilation(a, "AveragePool")
    X = x[0]
    n = X.dim() - 2
    kernel, strides, begin, end, sizes = _pool_geometry(X, a)
    ceil, with_pads = bool(a.get("ceil_mode", 0)), bool(a.get("count_include_pad", 0))
    if begin == end and all(2 * b <= k for b, k in zip(begin, kernel, strict=True)):
        pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[n]
        return _crop(pool(X, kernel, strides, begin, ceil, with_pads), sizes)
    pads = _pad_list(begin, end)
    sums = _sum_pool(F.pad(X, pads), kernel, strides, ceil)
    ones = torch.ones((1, 1, *X.shape[2:]), dtype=X.dtype)
    counted = torch.ones_like(F.pad(ones, pads)) if with_pads else F.pad(ones, pads)
    return _crop(sums / _sum_pool(counted, kernel, strides, ceil), sizes)


@op("LpPool")
def _lp_pool(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    _no_dilation(a, "LpPool")
    X, p = x[0], a.get("p", 2)
    kernel, strides, begin, end, sizes = _pool_geometry(X, a)
    powered = F.pad(X.abs() ** p, _pad_list(begin, end))
    return _crop(_sum_pool(powered, kernel, strides, bool(a.get("ceil_mode", 0))), sizes) ** (1.0 / p)


def _global(fn: Callable[[Tensor, tuple[int, ...]], Tensor]) -> Callable[[Inputs, Mapping[str, Any]], Tensor]:
    def pool(x: Inputs, a: Mapping[str, Any]) -> Tensor:
        return fn(x[0], tuple(range(2, x[0].dim())))

    return pool


op("GlobalAveragePool")(_global(lambda t, dims: t.mean(dim=dims, keepdim=True)))
op("GlobalMaxPool")(_global(lambda t, dims: t.amax(dim=dims, keepdim=True)))
