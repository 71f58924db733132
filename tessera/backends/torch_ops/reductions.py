"""Reductions (ONNX opset 13+ semantics): axes as an attribute (ReduceSum before 13, the others
before 18) or as an input, ``keepdims``, ``noop_with_empty_axes``; ArgMax and ArgMin."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from tessera.backends.torch_ops import Inputs, axes_of, axis_of, op

# fn(x, dims, keepdim) over a non-empty tuple of non-negative dims.
Reduction = Callable[[Tensor, tuple[int, ...], bool], Tensor]


def _prod(t: Tensor, dims: tuple[int, ...], keep: bool) -> Tensor:
    for d in sorted(dims, reverse=True):  # torch.prod takes one dim at a time
        t = t.prod(d, keepdim=keep)
    return t


def _sum(t: Tensor, dims: tuple[int, ...], keep: bool) -> Tensor:
    return t.sum(dim=dims, keepdim=keep, dtype=t.dtype)  # integer sums keep their type, as ONNX


REDUCTIONS: dict[str, Reduction] = {
    "ReduceSum": _sum,
    "ReduceMean": lambda t, d, k: t.mean(dim=d, keepdim=k),
    "ReduceMax": lambda t, d, k: t.amax(dim=d, keepdim=k),
    "ReduceMin": lambda t, d, k: t.amin(dim=d, keepdim=k),
    "ReduceProd": _prod,
    "ReduceL1": lambda t, d, k: _sum(t.abs(), d, k),
    "ReduceL2": lambda t, d, k: torch.sqrt(_sum(t * t, d, k)),
    "ReduceSumSquare": lambda t, d, k: _sum(t * t, d, k),
    "ReduceLogSum": lambda t, d, k: torch.log(_sum(t, d, k)),
    "ReduceLogSumExp": lambda t, d, k: torch.logsumexp(t, dim=d, keepdim=k),
}


# What a reduction over no axes computes with noop_with_empty_axes (ONNX's reference: the elementwise
# part of the reduction; the identity for the rest).
NOOP: dict[str, Callable[[Tensor], Tensor]] = {
    "ReduceL1": torch.abs,
    "ReduceL2": torch.abs,
    "ReduceSumSquare": torch.square,
    "ReduceLogSum": torch.log,
}


def _reduction(name: str, fn: Reduction) -> Callable[[Inputs, Mapping[str, Any]], Tensor]:
    def reduce(x: Inputs, a: Mapping[str, Any]) -> Tensor:
        X = x[0]
        axes = axes_of(x, a, 1)
        if not axes:  # absent or empty: every axis, or none with noop_with_empty_axes
            if a.get("noop_with_empty_axes", 0):
                return NOOP.get(name, torch.clone)(X)
            axes = list(range(X.dim()))
        if not axes:  # a scalar: nothing to reduce
            return NOOP.get(name, torch.clone)(X)
        return fn(X, tuple(sorted({axis_of(d, X.dim()) for d in axes})), bool(a.get("keepdims", 1)))

    return reduce


for _name, _fn in REDUCTIONS.items():
    op(_name)(_reduction(_name, _fn))


def _arg(fn: Callable[..., Tensor], x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data = x[0]
    axis = axis_of(a.get("axis", 0), data.dim())
    last = bool(a.get("select_last_index", 0))
    if last:  # torch returns the first extremum: search the flipped axis
        data = data.flip(axis)
    out = fn(data, dim=axis, keepdim=bool(a.get("keepdims", 1)))
    return data.shape[axis] - 1 - out if last else out


@op("ArgMax")
def _arg_max(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return _arg(torch.argmax, x, a)


@op("ArgMin")
def _arg_min(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return _arg(torch.argmin, x, a)
