"""Reduced-precision products for training (``launch --precision bf16``), and float64 throughout for
the reference that arbitrates round-off (``fp64``, never a user's choice).

The products (MatMul, Gemm, Conv, ConvTranspose, Einsum; the executor's fused ``Linear`` without its
bias) take their fp32 operands cast to bf16 and give their result back in fp32; every other operator
computes as the model says. Every tensor between ONNX operators keeps the model's dtype, so a
pipeline's stage cuts, wherever they fall, compute what one process computes. docs/executor.md
("Precision").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp64": torch.float64}
PRODUCTS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})

OpFn = Callable[[Sequence[Tensor | None], Mapping[str, Any]], Any]


def in_precision(op_type: str, fn: OpFn, precision: str) -> OpFn:
    """``fn`` (the function of an ONNX operator or fused step ``op_type``) computing in
    ``precision``: a product's fp32 operands go in as bf16 and its bf16 result comes back as fp32
    (an autograd-tracked cast each way, so gradients flow in the same precisions); other
    operators' ``fn`` unchanged. ``fp64``: every floating result of every operator in float64, so
    a graph's own casts to fp32, fp16 or bf16 round nothing (the arbiter of round-off)."""
    low = PRECISIONS[precision]
    if low == torch.float64:
        return _cast_in_fp64(fn) if op_type in ("Cast", "CastLike") else lambda a, k: _widened(fn(a, k))
    if low is None or (op_type not in PRODUCTS and op_type != "Linear"):
        return fn

    def product(args: Sequence[Tensor | None], attrs: Mapping[str, Any]) -> Any:
        operands = args[:2] if op_type == "Linear" else args
        if not any(isinstance(t, Tensor) and t.dtype == torch.float32 for t in operands):
            return fn(args, attrs)  # a product of another dtype computes as the model says
        cast = [_as(t, torch.float32, low) for t in operands]
        if op_type == "Linear":  # the bias as the unfused Add adds it: in fp32, after the product
            return _as(fn((*cast, None), attrs), low, torch.float32) + args[2]
        result = fn(cast, attrs)
        if isinstance(result, tuple):
            return tuple(_as(r, low, torch.float32) for r in result)
        return _as(result, low, torch.float32)

    return product


def _cast_in_fp64(fn: OpFn) -> OpFn:
    """A cast in float64: from one floating type to another it rounds nothing (the value stays)."""

    def cast(args: Sequence[Tensor | None], attrs: Mapping[str, Any]) -> Any:
        out = fn(args, attrs)
        x = args[0]
        if isinstance(x, Tensor) and x.is_floating_point() and out.is_floating_point():
            return x.to(torch.float64)
        return _widened(out)

    return cast


def _widened(result: Any) -> Any:
    if isinstance(result, tuple | list):
        return type(result)(_widened(r) for r in result)
    if isinstance(result, Tensor) and result.is_floating_point():
        return result.to(torch.float64)
    return result


def _as(t: Any, old: torch.dtype, new: torch.dtype) -> Any:
    return t.to(new) if isinstance(t, Tensor) and t.dtype == old else t


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 products natively: a CUDA device that torch says supports
    bf16, or a CPU with AVX512-BF16 or AMX (elsewhere oneDNN emulates them, many times slower
    than fp32)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False
