"""Reduced-precision products for training (``launch --precision bf16``).

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

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
PRODUCTS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})

OpFn = Callable[[Sequence[Tensor | None], Mapping[str, Any]], Any]


def in_precision(op_type: str, fn: OpFn, precision: str) -> OpFn:
    """``fn`` (the function of an ONNX operator or fused step ``op_type``) computing in
    ``precision``: a product's fp32 operands go in as bf16 and its bf16 result comes back as fp32
    (an autograd-tracked cast each way, so gradients flow in the same precisions); other
    operators' ``fn`` unchanged."""
    low = PRECISIONS[precision]
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
