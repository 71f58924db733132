"""The ONNX operators as torch functions: the table :data:`OPS`, ``fn(inputs, attributes) ->
output(s)``, differentiable where the operator is, and the conventions every function follows.

One module per operator family registers its functions on import (the folder listing is the
registry, as ONNX's reference operators): ``elementwise``, ``activations``, ``logic``, ``shape``,
``creation``, ``indexing``, ``reductions``, ``linalg``, ``conv``, ``normalization``, ``resize``,
``attention``. The
table implements the schema versions in use at opsets :data:`MIN_OPSET`–:data:`MAX_OPSET`
(:func:`schema_versions`); later versions only add element types (or attributes the functions
check). A form a function cannot run exactly raises ``NotImplementedError``, never approximated."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import Tensor

Inputs = Sequence[Tensor | None]
OpFn = Callable[[Inputs, Mapping[str, Any]], Tensor | tuple[Tensor, ...]]

OPS: dict[str, OpFn] = {}
# Operators of tessera's own that the executor inserts into a graph it runs (collectives: not ONNX's,
# so not in OPS, whose coverage of the ONNX schemas is tested).
EXTENSIONS: dict[str, OpFn] = {}

# The opsets the table's schema versions are taken from and tested at (docs/operators.md).
MIN_OPSET, MAX_OPSET = 13, 23


def _registrar(table: dict[str, OpFn], *names: str) -> Callable[[OpFn], OpFn]:
    def register(fn: OpFn) -> OpFn:
        for name in names:
            table[name] = fn
        return fn

    return register


def op(*names: str) -> Callable[[OpFn], OpFn]:
    """Register ``fn`` as the implementation of the ONNX operators ``names``."""
    return _registrar(OPS, *names)


def extension(*names: str) -> Callable[[OpFn], OpFn]:
    """Register ``fn`` as the implementation of tessera's own operators ``names`` (EXTENSIONS)."""
    return _registrar(EXTENSIONS, *names)


def function_of(op_type: str) -> OpFn:
    """The function of an ONNX operator, or of one of tessera's own (EXTENSIONS)."""
    return OPS[op_type] if op_type in OPS else EXTENSIONS[op_type]


@functools.cache
def schema_version(op_type: str, opset: int) -> int | None:
    """The ``since_version`` of the default-domain schema ``op_type`` has at ``opset`` (None: none, or
    deprecated there, which onnx.checker refuses)."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    return None if schema.deprecated else schema.since_version


@functools.cache
def schema_versions(op_type: str) -> tuple[int, ...]:
    """The schema versions of ``op_type`` in use at opsets MIN_OPSET–MAX_OPSET: the ones the table
    implements (and tests) for a registered operator."""
    found = {schema_version(op_type, v) for v in range(MIN_OPSET, MAX_OPSET + 1)}
    return tuple(sorted(v for v in found if v is not None))


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """The node's attributes as Python values (tensors as numpy arrays, strings decoded), plus what
    the node implies: Split's ``num_outputs`` (opset 13 splits into as many parts as outputs)."""
    attrs: dict[str, Any] = {}
    for a in node.attribute:
        value = helper.get_attribute_value(a)
        if isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        elif isinstance(value, bytes):
            value = value.decode()
        attrs[a.name] = value
    if node.op_type == "Split" and "split" not in attrs and "num_outputs" not in attrs:
        attrs["num_outputs"] = len(node.output)
    return attrs


def co_located(*xs: Tensor) -> tuple[Tensor, ...]:
    """``xs`` on one device. On a GPU run the CPU makes shapes and positions (Shape, Range,
    ConstantOfShape) while the weights and constants live on the GPU; where they meet, shape
    arithmetic (only small integer tensors) goes to the CPU, where the next Reshape reads it
    without waiting for the GPU, and anything else to the GPU tensor's device. Nothing moves when
    all are on one device."""
    cuda = xs[0].is_cuda
    for t in xs:
        if t.is_cuda != cuda:
            break
    else:
        return xs
    if all(not t.is_floating_point() and t.numel() <= SHAPE_NUMEL for t in xs):
        return tuple(t.cpu() for t in xs)
    device = next(t.device for t in xs if t.is_cuda)
    return tuple(t.to(device) for t in xs)


SHAPE_NUMEL = 64  # integer tensors up to this size that meet CPU-made ones are shape arithmetic


def given(x: Inputs, position: int) -> Tensor | None:
    """Optional input ``position``: None when the node leaves it out (or names it "")."""
    return x[position] if len(x) > position else None


def ints(t: Tensor | None) -> list[int]:
    """A shape, axes or sizes tensor (any integer type, any rank) as Python ints."""
    return [] if t is None else [int(v) for v in t.reshape(-1).tolist()]


def scalar(t: Tensor) -> float | int:
    """A one-element tensor (rank 0 or 1) as a Python number (read as :func:`ints` reads, so a
    constant reads in a traced step too)."""
    return t.reshape(-1).tolist()[0]


def axes_of(inputs: Inputs, attrs: Mapping[str, Any], position: int) -> list[int] | None:
    """Axes given as an attribute (older opsets) or as input ``position`` (opset 13/18+); None when
    neither is given."""
    if "axes" in attrs:
        return list(attrs["axes"])
    if (t := given(inputs, position)) is not None:
        return ints(t)
    return None


def axis_of(axis: int, rank: int) -> int:
    """An ONNX axis in [-rank, rank) as a non-negative one."""
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    return axis % rank


ONNX_TO_TORCH_DTYPE = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.UINT16: torch.uint16,
    onnx.TensorProto.UINT32: torch.uint32,
    onnx.TensorProto.UINT64: torch.uint64,
    onnx.TensorProto.BOOL: torch.bool,
}


def torch_dtype(onnx_type: int) -> torch.dtype:
    """The torch dtype of an ONNX element type; NotImplementedError for those torch lacks (strings,
    float8, 4-bit)."""
    if onnx_type not in ONNX_TO_TORCH_DTYPE:
        name = onnx.TensorProto.DataType.Name(onnx_type)
        raise NotImplementedError(f"element type {name} is not supported by the torch executor")
    return ONNX_TO_TORCH_DTYPE[onnx_type]


def from_numpy(value: np.ndarray) -> Tensor:
    """A numpy array (an initializer, a tensor attribute) as a tensor that owns its memory; bf16
    arrays (ml_dtypes' ``bfloat16``, as onnx reads them) bit for bit."""
    array = np.array(value, copy=True)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(tensor: Tensor) -> np.ndarray:
    """A tensor as a numpy array (bf16: ml_dtypes' ``bfloat16``, bit for bit)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.dtype("bfloat16"))
    return tensor.numpy()


# The operator families register themselves on import.
from tessera.backends.torch_ops import (  # noqa: E402, F401
    activations,
    attention,
    collectives,
    conv,
    creation,
    elementwise,
    indexing,
    linalg,
    logic,
    normalization,
    reductions,
    resize,
    shape,
)
