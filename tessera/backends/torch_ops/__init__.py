"""The ONNX operators as torch functions, one per operator in the table :data:`OPS` (as ONNX's
reference operators are one class per operator): ``fn(inputs, attributes) -> output(s)``, opset ≥ 13
semantics, differentiable where the operator is. :mod:`.torch_module` runs a graph with them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch import Tensor

Inputs = Sequence[Tensor | None]


OpFn = Callable[[Inputs, Mapping[str, Any]], Tensor | tuple[Tensor, ...]]


OPS: dict[str, OpFn] = {}


def op(*names: str) -> Callable[[OpFn], OpFn]:
    """Register ``fn`` as the implementation of the ONNX operators ``names``."""

    def register(fn: OpFn) -> OpFn:
        for name in names:
            OPS[name] = fn
        return fn

    return register


def _ints(t: Tensor | None) -> list[int]:
    return [] if t is None else [int(v) for v in t.reshape(-1).tolist()]


def _axes(inputs: Inputs, attrs: Mapping[str, Any], position: int) -> list[int] | None:
    """Axes given as an attribute (older opsets) or as input ``position`` (opset 13/18+)."""
    if "axes" in attrs:
        return list(attrs["axes"])
    if len(inputs) > position and inputs[position] is not None:
        return _ints(inputs[position])
    return None


_ONNX_TO_TORCH_DTYPE = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.BOOL: torch.bool,
}


def _tensor(value: np.ndarray) -> Tensor:
    return torch.from_numpy(np.array(value, copy=True))


@op("Add")
def _add(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0] + x[1]


@op("Sub")
def _sub(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0] - x[1]


@op("Mul")
def _mul(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0] * x[1]


@op("Div")
def _div(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    if x[0].is_floating_point():
        return x[0] / x[1]
    return torch.div(x[0], x[1], rounding_mode="trunc")  # ONNX integer Div truncates


@op("Pow")
def _pow(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.pow(x[0], x[1]).to(x[0].dtype)


@op("Sqrt")
def _sqrt(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.sqrt(x[0])


@op("Exp")
def _exp(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.exp(x[0])


@op("Log")
def _log(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.log(x[0])


@op("Neg")
def _neg(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return -x[0]


@op("Abs")
def _abs(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.abs(x[0])


@op("Reciprocal")
def _reciprocal(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.reciprocal(x[0])


@op("Erf")
def _erf(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.erf(x[0])


@op("Relu")
def _relu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.relu(x[0])


@op("LeakyRelu")
def _leaky_relu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return F.leaky_relu(x[0], a.get("alpha", 0.01))


@op("Sigmoid")
def _sigmoid(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.sigmoid(x[0])


@op("Tanh")
def _tanh(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.tanh(x[0])


@op("Gelu")
def _gelu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return F.gelu(x[0], approximate=a.get("approximate", "none"))


@op("Identity", "Dropout")  # Dropout: inference semantics (the identity), as ONNX Runtime runs it
def _identity(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0]


@op("Cast")
def _cast(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0].to(_ONNX_TO_TORCH_DTYPE[a["to"]])


@op("Where")
def _where(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.where(x[0].bool(), x[1], x[2])


@op("Equal")
def _equal(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.eq(x[0], x[1])


@op("Less")
def _less(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.lt(x[0], x[1])


@op("Greater")
def _greater(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.gt(x[0], x[1])


@op("Not")
def _not(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.logical_not(x[0])


@op("Max")
def _max(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    out = x[0]
    for y in x[1:]:
        out = torch.maximum(out, y)
    return out


@op("Min")
def _min(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    out = x[0]
    for y in x[1:]:
        out = torch.minimum(out, y)
    return out


@op("Sum")
def _sum(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    out = x[0]
    for y in x[1:]:
        out = out + y
    return out


@op("MatMul")
def _matmul(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.matmul(x[0], x[1])


@op("Gemm")
def _gemm(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    A = x[0].t() if a.get("transA", 0) else x[0]
    B = x[1].t() if a.get("transB", 0) else x[1]
    y = a.get("alpha", 1.0) * (A @ B)
    if len(x) > 2 and x[2] is not None:
        y = y + a.get("beta", 1.0) * x[2]
    return y


@op("Softmax")
def _softmax(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.softmax(x[0], dim=a.get("axis", -1))


@op("LayerNormalization")
def _layer_norm(x: Inputs, a: Mapping[str, Any]) -> Tensor | tuple[Tensor, ...]:
    X = x[0]
    axis = a.get("axis", -1) % X.dim()
    eps = a.get("epsilon", 1e-5)
    dims = tuple(range(axis, X.dim()))
    mean = X.mean(dim=dims, keepdim=True)
    var = ((X - mean) ** 2).mean(dim=dims, keepdim=True)
    inv_std = torch.rsqrt(var + eps)
    y = (X - mean) * inv_std * x[1]
    if len(x) > 2 and x[2] is not None:
        y = y + x[2]
    return y, mean, inv_std


@op("BatchNormalization")
def _batch_norm(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    if a.get("training_mode", 0):
        raise ValueError(
            "BatchNormalization with training_mode=1 is not supported (inference semantics only)"
        )
    return F.batch_norm(x[0], x[3], x[4], x[1], x[2], training=False, eps=a.get("epsilon", 1e-5))


def _spatial_pads(pads: Sequence[int], n: int) -> tuple[list[int], list[int] | None]:
    """ONNX pads ``[b1, b2, …, e1, e2, …]`` → (symmetric padding, or None and an F.pad list)."""
    begin, end = list(pads[:n]), list(pads[n:])
    if begin == end:
        return begin, None
    pad: list[int] = []
    for b, e in zip(reversed(begin), reversed(end), strict=True):
        pad += [b, e]
    return [0] * n, pad


def _check_auto_pad(a: Mapping[str, Any]) -> None:
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise ValueError(f"auto_pad={a['auto_pad']} is not supported (give explicit pads)")


@op("Conv")
def _conv(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    _check_auto_pad(a)
    X, W = x[0], x[1]
    n = X.dim() - 2
    padding, pad = _spatial_pads(a.get("pads", [0] * 2 * n), n)
    if pad is not None:
        X = F.pad(X, pad)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[n]
    return conv(
        X,
        W,
        x[2] if len(x) > 2 else None,
        stride=a.get("strides", [1] * n),
        padding=padding,
        dilation=a.get("dilations", [1] * n),
        groups=a.get("group", 1),
    )


@op("MaxPool")
def _max_pool(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    _check_auto_pad(a)
    X = x[0]
    n = X.dim() - 2
    kernel = a["kernel_shape"]
    padding, pad = _spatial_pads(a.get("pads", [0] * 2 * n), n)
    if pad is not None:
        X = F.pad(X, pad, value=float("-inf"))
    pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[n]
    return pool(
        X,
        kernel,
        stride=a.get("strides", [1] * n),
        padding=padding,
        dilation=a.get("dilations", [1] * n),
        ceil_mode=bool(a.get("ceil_mode", 0)),
    )


@op("AveragePool")
def _average_pool(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    _check_auto_pad(a)
    X = x[0]
    n = X.dim() - 2
    padding, pad = _spatial_pads(a.get("pads", [0] * 2 * n), n)
    if pad is not None:
        raise ValueError("asymmetric pads are not supported for AveragePool")
    pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[n]
    return pool(
        X,
        a["kernel_shape"],
        stride=a.get("strides", [1] * n),
        padding=padding,
        ceil_mode=bool(a.get("ceil_mode", 0)),
        count_include_pad=bool(a.get("count_include_pad", 0)),
    )


@op("GlobalAveragePool")
def _global_average_pool(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0].mean(dim=tuple(range(2, x[0].dim())), keepdim=True)


@op("GlobalMaxPool")
def _global_max_pool(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return x[0].amax(dim=tuple(range(2, x[0].dim())), keepdim=True)


def _reduce(fn: Callable[..., Tensor], x: Inputs, a: Mapping[str, Any]) -> Tensor:
    axes = _axes(x, a, 1)
    keep = bool(a.get("keepdims", 1))
    if not axes:
        if a.get("noop_with_empty_axes", 0):
            return x[0]
        axes = list(range(x[0].dim()))
    return fn(x[0], dim=tuple(axes), keepdim=keep)


@op("ReduceMean")
def _reduce_mean(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return _reduce(torch.mean, x, a)


@op("ReduceSum")
def _reduce_sum(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return _reduce(torch.sum, x, a)


@op("ReduceMax")
def _reduce_max(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return _reduce(torch.amax, x, a)


@op("Reshape")
def _reshape(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    shape = _ints(x[1])
    if not a.get("allowzero", 0):
        shape = [x[0].shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return x[0].reshape(shape)


@op("Flatten")
def _flatten(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    axis = a.get("axis", 1) % (x[0].dim() + 1) if x[0].dim() else 0
    lead = int(np.prod(x[0].shape[:axis], dtype=np.int64))
    return x[0].reshape(lead, -1)


@op("Transpose")
def _transpose(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    perm = a.get("perm") or list(reversed(range(x[0].dim())))
    return x[0].permute(*perm)


@op("Concat")
def _concat(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.cat([t for t in x if t is not None], dim=a["axis"])


@op("Split")
def _split(x: Inputs, a: Mapping[str, Any]) -> tuple[Tensor, ...]:
    axis = a.get("axis", 0)
    sizes = _ints(x[1]) if len(x) > 1 and x[1] is not None else a.get("split")
    if sizes:
        return tuple(torch.split(x[0], list(sizes), dim=axis))
    return tuple(torch.tensor_split(x[0], a["num_outputs"], dim=axis))


@op("Unsqueeze")
def _unsqueeze(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    axes = _axes(x, a, 1) or []
    rank = x[0].dim() + len(axes)
    y = x[0]
    for ax in sorted(d % rank for d in axes):
        y = y.unsqueeze(ax)
    return y


@op("Squeeze")
def _squeeze(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    axes = _axes(x, a, 1)
    if axes is None:
        return x[0].squeeze()
    return x[0].squeeze(tuple(d % x[0].dim() for d in axes))


@op("Expand")
def _expand(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    shape = torch.broadcast_shapes(tuple(x[0].shape), tuple(_ints(x[1])))
    return x[0].expand(shape)


@op("Shape")
def _shape(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    dims = list(x[0].shape)
    start, end = a.get("start", 0), a.get("end", len(dims))
    return torch.tensor(dims[start:end], dtype=torch.int64)


@op("Size")
def _size(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    return torch.tensor(x[0].numel(), dtype=torch.int64)


@op("Slice")
def _slice(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    X = x[0]
    starts, ends = _ints(x[1]), _ints(x[2])
    axes = _ints(x[3]) if len(x) > 3 and x[3] is not None else list(range(len(starts)))
    steps = _ints(x[4]) if len(x) > 4 and x[4] is not None else [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis %= X.dim()
        idx = range(X.shape[axis])[slice(start, end, step)]  # Python's clamping is ONNX's
        if step == 1:
            X = X.narrow(axis, idx.start, len(idx))
        else:
            X = X.index_select(axis, torch.tensor(list(idx), dtype=torch.int64))
    return X


@op("Gather")
def _gather(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data, idx = x[0], x[1].to(torch.int64)
    axis = a.get("axis", 0) % data.dim()
    idx = torch.where(idx < 0, idx + data.shape[axis], idx)
    flat = data.index_select(axis, idx.reshape(-1))
    # A tuple, not varargs: a scalar index on a 1-D tensor (Shape → Gather(0)) gives shape ().
    return flat.reshape((*data.shape[:axis], *idx.shape, *data.shape[axis + 1 :]))


@op("Trilu")
def _trilu(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    k = _ints(x[1])[0] if len(x) > 1 and x[1] is not None else 0
    return torch.triu(x[0], k) if a.get("upper", 1) else torch.tril(x[0], k)


@op("Constant")
def _constant(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    if "value" in a:
        return _tensor(a["value"])
    if "value_float" in a:
        return torch.tensor(a["value_float"], dtype=torch.float32)
    if "value_floats" in a:
        return torch.tensor(list(a["value_floats"]), dtype=torch.float32)
    if "value_int" in a:
        return torch.tensor(a["value_int"], dtype=torch.int64)
    if "value_ints" in a:
        return torch.tensor(list(a["value_ints"]), dtype=torch.int64)
    raise ValueError(f"Constant with attribute(s) {sorted(a)} is not supported")


@op("ConstantOfShape")
def _constant_of_shape(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    value = _tensor(a["value"]).reshape(-1) if "value" in a else torch.zeros(1, dtype=torch.float32)
    return value.expand(_ints(x[0])).clone()


# The operator families beyond the core set register themselves on import (one module per family).
from tessera.backends.torch_ops import elementwise, indexing, logic  # noqa: E402, F401
