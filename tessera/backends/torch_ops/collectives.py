"""Tensor parallelism's operators (not ONNX's: the executor inserts them into a rank's copy of a
stage, ``tessera.executor.tensor_parallel``): ``TpCopy`` (Megatron's f: identity forward, gradient
all-reduced), ``TpReduce`` (its g: partial sums all-reduced forward, identity backward) and
``TpShard`` (the rank's block of a whole tensor), ``TpLocal``/``TpWhole`` (shapes between the
two). Their process group is registered by name
(:func:`use_group`; the nodes' ``group`` attribute)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.backends.torch_ops import Inputs, extension

_GROUPS: dict[str, Any] = {}


def use_group(name: str, group: Any) -> None:
    """Make ``group`` the one nodes naming ``name`` reduce over: a torch.distributed process group,
    or a function that sums every rank's tensor (a decode step's exchange through shared memory,
    forward only)."""
    _GROUPS[name] = group


def _group(attrs: Mapping[str, Any]) -> Any:
    name = attrs.get("group", "tp")
    if name not in _GROUPS:
        raise RuntimeError(f"tensor-parallel group {name!r} is not set up (use_group)")
    return _GROUPS[name]


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # noqa: ARG004
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # noqa: ARG004
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ARG004
        return grad, None


@extension("TpCopy")
def tp_copy(x: Inputs, attrs: Mapping[str, Any]) -> Tensor:
    t = x[0]
    return _Copy.apply(t, _group(attrs)) if t.is_floating_point() else t


@extension("TpReduce")
def tp_reduce(x: Inputs, attrs: Mapping[str, Any]) -> Tensor:
    group = _group(attrs)
    return group(x[0]) if callable(group) else _Reduce.apply(x[0], group)


@extension("TpShard")
def tp_shard(x: Inputs, attrs: Mapping[str, Any]) -> Tensor:
    """Block ``index`` of ``t`` of each part (``part`` long) along ``axis`` (core.tensor_parallel.shard)."""
    axis, t, index, part = (int(attrs[k]) for k in ("axis", "t", "index", "part"))
    parts = x[0].split(part, axis)
    blocks = [p.narrow(axis, index * (part // t), part // t) for p in parts]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, axis)


@extension("TpLocal")
def tp_local(x: Inputs, attrs: Mapping[str, Any]) -> Tensor:
    """A shape (or Split's sizes) as the rank's: entry ``axis`` (-1: every entry) over ``t``, where
    it gives a size (0 copies the input's and -1 infers one: already the rank's)."""
    shape, axis, t = x[0], int(attrs["axis"]), int(attrs["t"])
    out = shape.clone()
    if axis < 0:
        return torch.where(out > 1, out // t, out)
    if out[axis] > 1:
        out[axis] = out[axis] // t
    return out


@extension("TpWhole")
def tp_whole(x: Inputs, attrs: Mapping[str, Any]) -> Tensor:
    """A rank's Shape (entry ``axis``; -1: a Size) of a split tensor as the whole tensor's."""
    shape, axis, t = x[0], int(attrs["axis"]), int(attrs["t"])
    if axis < 0:
        return shape * t
    out = shape.clone()
    out[axis] = out[axis] * t
    return out
