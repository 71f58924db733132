"""FLOPs and bytes moved per operator, from shapes alone.

The conventions of the field's FLOP counters: a multiply-accumulate is 2 FLOPs (``MatMul``: ``2·M·K·N``;
``Conv``: ``2·N·C_out·prod(out_spatial)·(C_in/group)·prod(kernel)``), elementwise operators 1 per output
element, data movement 0. Bytes: every input read and every output written once, except metadata-only
operators (Reshape, Squeeze, …), which move nothing. The per-operator table is in docs/core.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Shape = tuple[int, ...]

ELEMENTWISE = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean",
        "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "Gelu", "Sigmoid", "HardSigmoid",
        "HardSwish", "Tanh", "Softplus", "Softsign", "Mish", "Swish", "ThresholdedRelu",
        "Exp", "Log", "Sqrt", "Reciprocal", "Neg", "Abs", "Erf", "Sin", "Cos", "Tan",
        "Floor", "Ceil", "Round", "Sign", "Clip", "Where", "Not", "And", "Or", "Xor",
        "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "IsNaN", "IsInf",
        "BitShift", "QuantizeLinear", "DequantizeLinear", "Dropout",
    }
)  # fmt: skip
REDUCTIONS = frozenset(
    {
        "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
        "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "GlobalAveragePool", "GlobalMaxPool",
        "ArgMax", "ArgMin", "LpNormalization",
    }
)  # fmt: skip
POOLS = frozenset({"AveragePool", "MaxPool", "LpPool"})
VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Shape", "Size"})
NORMS_8 = frozenset({"LayerNormalization", "InstanceNormalization", "GroupNormalization"})


@dataclass(frozen=True)
class OpCost:
    """What one execution of an operator costs: arithmetic and memory traffic."""

    flops: int
    bytes_moved: int


def numel(shape: Shape | None) -> int:
    return math.prod(shape) if shape is not None else 0


def op_cost(
    op_type: str,
    attributes: Mapping[str, Any],
    input_shapes: Sequence[Shape | None],
    output_shapes: Sequence[Shape | None],
    input_bytes: Sequence[int],
    output_bytes: Sequence[int],
) -> OpCost:
    """FLOPs and bytes moved of one operator (see the module docstring for the formulas).

    ``input_shapes``/``input_bytes`` follow the node's inputs in order (None/0 for an absent
    optional input); a shape that inference could not resolve counts as 0.
    """
    flops = op_flops(op_type, attributes, input_shapes, output_shapes)
    if op_type in VIEWS:
        moved = 0
    elif op_type == "Gather" or op_type == "GatherElements" or op_type == "GatherND":
        moved = 2 * sum(output_bytes) + (input_bytes[1] if len(input_bytes) > 1 else 0)
    else:
        moved = sum(input_bytes) + sum(output_bytes)
    return OpCost(flops=int(flops), bytes_moved=int(moved))


def op_flops(
    op_type: str,
    attributes: Mapping[str, Any],
    input_shapes: Sequence[Shape | None],
    output_shapes: Sequence[Shape | None],
) -> int:
    out = output_shapes[0] if output_shapes else None
    ins = list(input_shapes)
    structured = _STRUCTURED.get(op_type)
    if structured is not None:
        return structured(ins, out, attributes)
    if op_type in REDUCTIONS:
        return numel(ins[0]) if ins else 0
    if op_type in POOLS:
        if out is None or not ins or ins[0] is None:
            return 0
        kernel = list(attributes.get("kernel_shape") or [])
        return out[0] * out[1] * window_taps(ins[0][2:], out[2:], kernel, attributes)
    return _PER_OUTPUT.get(op_type, 0) * numel(out)


def _has_bias(ins: list[Shape | None]) -> bool:
    return len(ins) > 2 and ins[2] is not None


# Operators whose FLOPs follow from their operands' shapes (and attributes).
_STRUCTURED: dict[str, Callable[[list[Shape | None], Shape | None, Mapping[str, Any]], int]] = {
    "Conv": lambda ins, out, attrs: _conv_flops(ins, out, attrs, has_bias=_has_bias(ins)),
    "ConvTranspose": lambda ins, out, attrs: _conv_transpose_flops(ins, out, attrs, has_bias=_has_bias(ins)),
    "MatMul": lambda ins, out, attrs: _matmul_flops(ins[0], ins[1], out),
    "MatMulInteger": lambda ins, out, attrs: _matmul_flops(ins[0], ins[1], out),
    "Gemm": lambda ins, out, attrs: _gemm_flops(ins, out, attrs),
    "Attention": lambda ins, out, attrs: _attention_flops(ins, attrs),
}
# FLOPs per output element of the rest (the sets do not overlap).
_PER_OUTPUT: dict[str, int] = {
    **dict.fromkeys(ELEMENTWISE, 1),
    "BatchNormalization": 2,
    **dict.fromkeys(NORMS_8, 8),
    "Softmax": 5,
    "LogSoftmax": 5,
}


def window_taps(
    in_spatial: Sequence[int], out_spatial: Sequence[int], kernel: Sequence[int], attrs: Mapping[str, Any]
) -> int:
    """Kernel taps that fall on the padded input, summed over every output position (a product over
    the spatial axes): ``prod(out) · prod(kernel)`` unless a window overhangs the padded input, as a
    kernel larger than it does, or the last window of ``ceil_mode``."""
    n = len(kernel)
    dims = (*in_spatial[:n], *out_spatial[:n], *kernel)
    if len(in_spatial) < n or len(out_spatial) < n or not all(isinstance(x, int) for x in dims):
        return math.prod(out_spatial) * math.prod(kernel)
    strides = list(attrs.get("strides") or [1] * n)
    dilations = list(attrs.get("dilations") or [1] * n)
    pads = list(attrs.get("pads") or [0] * (2 * n))
    total = 1
    for axis in range(n):
        size, outs, k, s, d = (
            in_spatial[axis],
            out_spatial[axis],
            kernel[axis],
            strides[axis],
            dilations[axis],
        )
        begin, end = pads[axis], pads[axis + n]
        auto = attrs.get("auto_pad", "NOTSET")
        auto = auto.decode() if isinstance(auto, bytes) else auto
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            need = max(0, (outs - 1) * s + (k - 1) * d + 1 - size)
            begin = need // 2 if auto == "SAME_UPPER" else need - need // 2
            end = need - begin
        lo, hi = -begin, size + end  # the padded input: positions lo .. hi - 1
        taps = 0
        for o in range(outs):
            start = o * s - begin
            taps += sum(1 for t in range(k) if lo <= start + t * d < hi)
        total *= taps
    return total


def _conv_flops(
    ins: list[Shape | None], out: Shape | None, attrs: Mapping[str, Any], *, has_bias: bool
) -> int:
    if out is None or len(ins) < 2 or ins[1] is None:
        return 0
    weight = ins[1]  # [C_out, C_in/group, k...]
    batch, c_out, *spatial = out
    taps = (
        window_taps(ins[0][2:], spatial, list(weight[2:]), attrs)
        if ins[0] is not None
        else math.prod(spatial) * math.prod(weight[2:])
    )
    flops = batch * c_out * 2 * weight[1] * taps
    if has_bias:
        flops += batch * c_out * math.prod(spatial)
    return flops


def _conv_transpose_flops(
    ins: list[Shape | None], out: Shape | None, attrs: Mapping[str, Any], *, has_bias: bool
) -> int:
    if out is None or len(ins) < 2 or ins[0] is None or ins[1] is None:
        return 0
    x, weight = ins[0], ins[1]  # weight: [C_in, C_out/group, k...]
    batch, c_in, *in_spatial = x
    flops = 2 * batch * c_in * math.prod(in_spatial) * weight[1] * math.prod(weight[2:])
    if has_bias:
        flops += numel(out)
    return flops


def _matmul_flops(a: Shape | None, b: Shape | None, out: Shape | None) -> int:
    if a is None or b is None:
        return 0
    k = a[-1]
    # The output holds M·N per batch element (1-D operands drop their axis, numpy semantics).
    return 2 * k * numel(out) if out is not None else 0


def _gemm_flops(ins: list[Shape | None], out: Shape | None, attrs: Mapping[str, Any]) -> int:
    if out is None or not ins or ins[0] is None:
        return 0
    a = ins[0]
    k = a[0] if attrs.get("transA", 0) else a[-1]
    flops = 2 * k * numel(out)
    if len(ins) > 2 and ins[2] is not None and attrs.get("beta", 1.0) != 0:
        flops += numel(out)
    return flops


def _attention_flops(ins: list[Shape | None], attrs: Mapping[str, Any]) -> int:
    """ONNX ``Attention`` (opset 23): Q [B,Hq,Sq,D] or [B,Sq,Hq·D]; K, V likewise."""
    if len(ins) < 3 or any(s is None for s in ins[:3]):
        return 0
    q, k, v = ins[0], ins[1], ins[2]
    assert q is not None and k is not None and v is not None
    if len(q) == 4:
        batch, heads, s_q, d_qk = q
        s_k, d_v = k[2], v[3]
    else:
        heads = int(attrs.get("q_num_heads", 1))
        kv_heads = int(attrs.get("kv_num_heads", heads))
        batch, s_q = q[0], q[1]
        d_qk = q[2] // heads
        s_k = k[1]
        d_v = v[2] // kv_heads
    scores = batch * heads * s_q * s_k
    return 2 * scores * d_qk + 2 * scores * d_v + 5 * scores
