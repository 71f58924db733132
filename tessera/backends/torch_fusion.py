"""Exporter patterns the torch executor runs as one torch call: the GELU that torch.onnx's TorchScript
exporter decomposes into Div/Erf/Add/Mul/Mul, LayerNormalization without its statistics
(``F.layer_norm``), a MatMul by a weight followed by the Add of a bias (``F.linear``), and Pow by
a constant (a Python exponent); Identity nodes become aliases and Constant nodes values. Rewrites work on
:class:`Step` lists, never on the ONNX model, and leave any tensor another node or the graph reads.
Why and what it gains: docs/executor.md ("The executor's program").
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F  # noqa: N812 (torch's own spelling)
from onnx import numpy_helper
from torch import Tensor

from tessera.backends.torch_ops import OPS, OpFn, axis_of, from_numpy, function_of, node_attributes


def _linear(x: Sequence[Tensor | None], a: Mapping[str, Any]) -> Tensor:
    """``MatMul(x, W) + b`` with W of shape [in, out] (ONNX's layout): one addmm."""
    return F.linear(x[0], x[1].t(), x[2])


def _layer_norm(x: Sequence[Tensor | None], a: Mapping[str, Any]) -> Tensor:
    """LayerNormalization's Y alone: ``F.layer_norm`` (one kernel, forward and backward) where the
    scale and bias have the normalized shape and the input is fp32/fp64, else the ONNX function."""
    X, scale = x[0], x[1]
    assert X is not None and scale is not None
    shape = X.shape[axis_of(a.get("axis", -1), X.dim()) :]
    bias = x[2] if len(x) > 2 else None
    if (
        X.dtype in (torch.float32, torch.float64)
        and scale.shape == shape
        and (bias is None or bias.shape == shape)
    ):
        return F.layer_norm(X, shape, scale, bias, a.get("epsilon", 1e-5))
    return OPS["LayerNormalization"](x, a)[0]


def _pow_scalar(x: Sequence[Tensor | None], a: Mapping[str, Any]) -> Tensor:
    """``Pow(x, c)`` by a constant: a Python exponent takes torch's fast paths (``x * x * x`` for
    3, as in GPT-2's tanh GELU; a tensor exponent costs 3-4x that, and a gradient for it)."""
    base = x[0]
    assert base is not None
    return torch.pow(base, a["exponent"]).to(base.dtype)


FUSED: dict[str, OpFn] = {"Linear": _linear, "LayerNorm": _layer_norm, "PowScalar": _pow_scalar}


@dataclass(frozen=True)
class Step:
    """One call of the executor's program: an ONNX node, or a fused run of nodes (``nodes`` names
    them all; the first is the one reported in errors)."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any]
    nodes: tuple[str, ...]

    @property
    def fn(self) -> OpFn:
        return FUSED[self.op_type] if self.op_type in FUSED else function_of(self.op_type)


def steps_of(model: onnx.ModelProto) -> tuple[list[Step], dict[str, np.ndarray]]:
    """The model's nodes as fused steps, and the Constant nodes' values (tensor name → array)."""
    g = model.graph
    # The patterns' scalars (√2, 1, 0.5) may be initializers: only one-element ones are read.
    constants: dict[str, np.ndarray] = {
        t.name: numpy_helper.to_array(t) for t in g.initializer if math.prod(t.dims) == 1
    }
    steps: list[Step] = []
    for n in g.node:
        attrs = node_attributes(n)
        if n.op_type == "Constant" and "value" in attrs and len(n.output) == 1:
            constants[n.output[0]] = np.asarray(attrs["value"])
        steps.append(Step(n.op_type, tuple(n.input), tuple(n.output), attrs, (n.name or n.op_type,)))
    kept = {vi.name for vi in g.output}
    steps = _alias_identities(steps, kept)
    steps = _statistics_unread(steps, kept)
    steps = _fuse_gelu(steps, constants, kept)
    steps = _constant_exponents(steps, constants)
    steps = _fuse_linear(steps, {t.name: tuple(t.dims) for t in g.initializer}, kept)
    initializers = {t.name for t in g.initializer}
    return steps, {k: v for k, v in constants.items() if k not in initializers}


def _readers(steps: Iterable[Step]) -> Counter[str]:
    return Counter(t for s in steps for t in s.inputs if t)


def _alias_identities(steps: list[Step], kept: set[str]) -> list[Step]:
    """Drop Identity nodes (not those writing a graph output): their readers read the input."""
    alias: dict[str, str] = {}
    out: list[Step] = []
    for s in steps:
        inputs = tuple(alias.get(t, t) for t in s.inputs)
        if s.op_type == "Identity" and s.outputs[0] not in kept and inputs[0]:
            alias[s.outputs[0]] = inputs[0]
            continue
        out.append(Step(s.op_type, inputs, s.outputs, s.attrs, s.nodes))
    return out


def _statistics_unread(steps: list[Step], kept: set[str]) -> list[Step]:
    """LayerNormalization whose Mean and InvStdDev nobody reads → ``LayerNorm`` (Y only)."""
    readers = _readers(steps)
    return [
        Step("LayerNorm", s.inputs, s.outputs[:1], s.attrs, s.nodes)
        if s.op_type == "LayerNormalization"
        and not any(t and (readers[t] or t in kept) for t in s.outputs[1:])
        else s
        for s in steps
    ]


def _scalar(constants: Mapping[str, np.ndarray], name: str) -> float | None:
    value = constants.get(name)
    if value is None or value.size != 1 or value.dtype.kind != "f":
        return None
    return float(value.reshape(()))


def _fuse_gelu(steps: list[Step], constants: Mapping[str, np.ndarray], kept: set[str]) -> list[Step]:
    """``Mul(Mul(x, Add(Erf(Div(x, √2)), 1)), 0.5)`` (either operand order of each Mul and Add) →
    ``Gelu(x)``, where only the chain reads its intermediates."""
    readers = _readers(steps)
    by_output = {t: i for i, s in enumerate(steps) for t in s.outputs}
    private = {t for t, k in readers.items() if k == 1 and t not in kept}

    def producer(t: str, op_type: str) -> Step | None:
        i = by_output.get(t)
        return steps[i] if i is not None and steps[i].op_type == op_type and t in private else None

    def other(s: Step, t: str) -> str:
        return s.inputs[1] if s.inputs[0] == t else s.inputs[0]

    fused: dict[int, Step] = {}
    gone: set[int] = set()
    for i, half in enumerate(steps):
        if half.op_type != "Mul" or len(half.inputs) != 2:
            continue
        for t in half.inputs:
            outer = producer(t, "Mul")
            if outer is None or _scalar(constants, other(half, t)) != 0.5:
                continue
            chain = _gelu_chain(outer, producer, other, constants)
            if chain is None:
                continue
            x, parts = chain
            gone.update(by_output[p.outputs[0]] for p in parts)
            fused[i] = Step("Gelu", (x,), half.outputs, {}, (*(p.nodes[0] for p in parts), *half.nodes))
            break
    return [fused.get(i, s) for i, s in enumerate(steps) if i not in gone]


def _gelu_chain(outer: Step, producer: Any, other: Any, constants: Mapping[str, np.ndarray]) -> Any:
    """(x, [the four steps]) when ``outer`` is ``Mul(x, Add(Erf(Div(x, √2)), 1))``, else None."""
    for t in outer.inputs:
        add = producer(t, "Add")
        if add is None:
            continue
        x = other(outer, t)
        for u in add.inputs:
            erf = producer(u, "Erf")
            if erf is None or _scalar(constants, other(add, u)) != 1.0:
                continue
            div = producer(erf.inputs[0], "Div")
            if div is None or div.inputs[0] != x:
                continue
            root2 = _scalar(constants, div.inputs[1])
            if root2 is not None and abs(root2 - 2**0.5) < 1e-6:
                return x, [div, erf, add, outer]
    return None


def _constant_exponents(steps: list[Step], constants: Mapping[str, np.ndarray]) -> list[Step]:
    """``Pow(x, c)`` with ``c`` a one-element float constant → ``PowScalar(x)``."""
    out = []
    for s in steps:
        exponent = _scalar(constants, s.inputs[1]) if s.op_type == "Pow" and len(s.inputs) == 2 else None
        if exponent is None:
            out.append(s)
        else:
            out.append(Step("PowScalar", s.inputs[:1], s.outputs, {"exponent": exponent}, s.nodes))
    return out


def _fuse_linear(steps: list[Step], shapes: Mapping[str, tuple[int, ...]], kept: set[str]) -> list[Step]:
    """``Add(MatMul(x, W), b)`` (or ``Add(b, …)``) with W a 2-D initializer and b a 1-D one of W's
    output size → ``Linear(x, W, b)``, where only the Add reads the product."""
    readers = _readers(steps)
    by_output = {s.outputs[0]: i for i, s in enumerate(steps) if s.outputs}
    fused: dict[int, Step] = {}
    gone: set[int] = set()
    for i, add in enumerate(steps):
        if add.op_type != "Add" or len(add.inputs) != 2:
            continue
        for k, t in enumerate(add.inputs):
            j = by_output.get(t)
            bias = add.inputs[1 - k]
            if j is None or j in gone or readers[t] != 1 or t in kept:
                continue
            mm = steps[j]
            if mm.op_type != "MatMul" or len(shapes.get(mm.inputs[1], ())) != 2:
                continue
            if shapes.get(bias) != (shapes[mm.inputs[1]][1],):
                continue
            gone.add(j)
            fused[i] = Step(
                "Linear", (mm.inputs[0], mm.inputs[1], bias), add.outputs, {}, mm.nodes + add.nodes
            )
            break
    return [fused.get(i, s) for i, s in enumerate(steps) if i not in gone]


def constant_tensor(value: np.ndarray) -> Tensor:
    """A Constant node's value as the tensor its function would make (a copy: arrays may be views)."""
    return from_numpy(value)
