"""Which tensors of a model are parameters, and which operator each is charged to: floating,
non-scalar leaf constants (initializers, Constant outputs) followed through constant view operators
to the first operator that reads an activation. The FLOP and memory counts build on it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx


def find_constant_nodes(
    g: onnx.GraphProto,
    inputs: Mapping[str, Any],
    initializers: Mapping[str, Any],
    producer: Mapping[str, str],
    implicit: Mapping[str, tuple[str, ...]],
) -> set[str]:
    """Operators that read no activation: they compute constants (Constant, ConstantOfShape, …)."""
    constant: set[str] = set()
    for node in g.node:
        reads = (*node.input, *implicit[node.name])
        if any(t in inputs for t in reads):
            continue
        if all(not t or t in initializers or producer.get(t) in constant for t in reads):
            constant.add(node.name)
    return constant


def parameter_owners(
    g: onnx.GraphProto,
    tensors: Mapping[str, Any],
    initializers: Mapping[str, Any],
    constant_nodes: set[str],
    consumers: Mapping[str, list[str]],
) -> dict[str, list[str]]:
    """Which operator each parameter is charged to: ``{node: [parameter tensor, …]}``.

    A parameter is a floating, non-scalar leaf constant — an initializer, or the output of a
    Constant/ConstantOfShape node (the "light" test models make their weights that way) — counted
    once, at the first activation-reading operator it reaches. A leaf is followed through constant
    view ops (Unsqueeze, Reshape, …) to that operator. Initializers are always parameters (a
    position-embedding table read by a constant Gather too); a generated constant that is further
    computed on (ConstantOfShape → Trilu: a causal mask) is not. A rank-0 scalar (GELU's 0.5, a
    1/sqrt(d) scale) is a constant, not a parameter.
    """
    nodes = {n.name: n for n in g.node}
    position = {n.name: i for i, n in enumerate(g.node)}
    leaves = [t.name for t in g.initializer] + [
        out
        for n in g.node
        if n.op_type in ("Constant", "ConstantOfShape") and n.name in constant_nodes  # not zeros_like(x)
        for out in n.output
    ]
    owners: dict[str, list[str]] = {}
    for leaf in leaves:
        info = tensors.get(leaf)
        if info is None or info.shape == () or not info.floating:
            continue
        # Walk through constant operators to the first activation-reading ones.
        reached: list[str] = []
        frontier, views_only = [leaf], True
        while frontier:
            for c in consumers.get(frontier.pop(), ()):
                if c not in constant_nodes:
                    reached.append(c)
                    continue
                views_only = views_only and nodes[c].op_type in VIEW_OPS
                frontier.extend(nodes[c].output)
        if reached and (leaf in initializers or views_only):
            owners.setdefault(min(reached, key=position.__getitem__), []).append(leaf)
    return owners


# Operators whose non-activation operands are weights: a constant tensor they read is a parameter.
PARAMETRIC_OPS = frozenset(
    {
        "Conv", "ConvTranspose", "Gemm", "MatMul", "BatchNormalization", "LayerNormalization",
        "InstanceNormalization", "GroupNormalization", "PRelu", "Gather", "LSTM", "GRU", "RNN",
    }
)  # fmt: skip


# Elementwise operators that apply a learned scale or shift when their operand is a leaf constant.
AFFINE_OPS = frozenset({"Add", "Sub", "Mul", "Div"})


VIEW_OPS = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"})
