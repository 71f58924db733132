"""Operators that make tensors from attributes, shapes and scalars (ONNX opset 13+ semantics):
Constant, ConstantOfShape, Range and EyeLike. No gradient."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from tessera.backends.torch_ops import Inputs, from_numpy, ints, op, torch_dtype


@op("Constant")
def _constant(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    if "value" in a:
        return from_numpy(a["value"])
    if "value_float" in a:
        return torch.tensor(a["value_float"], dtype=torch.float32)
    if "value_floats" in a:
        return torch.tensor(list(a["value_floats"]), dtype=torch.float32)
    if "value_int" in a:
        return torch.tensor(a["value_int"], dtype=torch.int64)
    if "value_ints" in a:
        return torch.tensor(list(a["value_ints"]), dtype=torch.int64)
    raise NotImplementedError(f"Constant with attribute(s) {sorted(a)} (strings, sparse tensors)")


@op("ConstantOfShape")  # run eagerly under launch --compile (torch_program.compiled)
def _constant_of_shape(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    value = from_numpy(a["value"]).reshape(()) if "value" in a else torch.zeros((), dtype=torch.float32)
    return value.expand(ints(x[0])).clone()


@op("Range")
def _range(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    start, limit, delta = (t.reshape(()) for t in x[:3])
    if a.get("stash_type", 1) != 1 and start.dtype in (torch.float16, torch.bfloat16):
        raise NotImplementedError("Range accumulating in float16 (stash_type of Range-27)")
    return torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)


@op("EyeLike")
def _eye_like(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    rows, cols = x[0].shape
    dtype = torch_dtype(a["dtype"]) if "dtype" in a else x[0].dtype
    diagonal = torch.arange(cols).unsqueeze(0) - torch.arange(rows).unsqueeze(1) == a.get("k", 0)
    return diagonal.to(dtype)
