"""The whole-graph checks of a recognized decoder: its attention cores causal self-attention (or the
first fault named), causality confirmed by a probe of the whole graph, and a sequence length the
graph cannot leave. Used by :mod:`tessera.planners.cp.recognize`."""

from __future__ import annotations

import numpy as np

from tessera.core.errors import InputError
from tessera.core.graph import Graph, OpNode
from tessera.planners.cp.attention import AttentionCore, Matcher

__all__ = ["check_causal", "check_cores", "fixed_length"]


def check_causal(graph: Graph, m: Matcher, cores: list[AttentionCore]) -> None:
    """Confirm on the whole graph what the cores' scores say: a later token must not move an
    earlier position's outputs. Skipped where the graph does not run here (lazy or large weights)."""
    if m.run is None:
        return
    tokens = m.probe_tokens(m.run.batch, m.run.length())
    changed = tokens.copy()
    changed[:, -1] = tokens[:, 0] if tokens[0, -1] != tokens[0, 0] else tokens[:, 1]
    name = next(iter(graph.outputs))
    try:
        a, b = m.run.run(tokens)[name], m.run.run(changed)[name]
    except Exception:  # noqa: BLE001 - the probe could not run: the evaluation's verdict stands
        return
    if a.ndim < 2 or a.shape[:2] != tokens.shape:
        return
    early_a, early_b = a[:, :-1].astype(np.float64), b[:, :-1].astype(np.float64)
    moved = float(np.max(np.abs(early_a - early_b)))
    if moved > 1e-4 * (1.0 + float(np.max(np.abs(early_a)))):
        raise InputError(
            f"not a causal decoder: changing the last token moves the earlier positions' {name!r} by "
            f"{moved:.3g}, though attention {cores[0].softmax}'s scores were evaluated as causal "
            "(something besides attention mixes positions)",
            source=graph.source,
        )


def fixed_length(graph: Graph, m: Matcher) -> int | None:
    """The declared sequence length when the graph cannot follow another: the token input's axis 1
    is a number and no ``Range``/``CumSum`` counts positions from a ``Shape`` (exporters bake the
    positions of a fixed length into constants; tessera's zoo GPT computes them from the input)."""
    token = next((n for n, info in graph.inputs.items() if info.dtype.startswith("int")), None)
    declared = graph.declared_shapes.get(token) if token is not None else None
    if not declared or len(declared) != 2 or not isinstance(declared[1], int):
        return None
    counters = [op for op in graph.ops() if op.op_type in ("Range", "CumSum")]
    return None if any(_from_shape(m, op) for op in counters) else declared[1]


def _from_shape(m: Matcher, op: OpNode) -> bool:
    """Whether ``op``'s inputs are computed (within a few ops) from a ``Shape``."""
    stack, seen = [(t, 0) for t in op.inputs if t], set()
    while stack:
        tensor, depth = stack.pop()
        producer = m.producer(tensor)
        if producer is None or depth > 8 or tensor in seen:
            continue
        seen.add(tensor)
        if producer.op_type == "Shape":
            return True
        stack += [(t, depth + 1) for t in producer.inputs if t]
    return False


def check_cores(graph: Graph, cores: list[AttentionCore], failed: list) -> None:
    """Refuse a graph whose attention cores are not causal self-attention, naming the first fault."""
    label = graph.source
    if not cores:
        if not failed:
            raise InputError(
                "not a decoder-only transformer: no self-attention found (no Softmax)", source=label
            )
        first = next((why for why in failed if why.softmax is not None), failed[0])  # attention first
        raise InputError(
            f"not a decoder-only transformer: no self-attention found ({len(failed)} Softmax op(s); "
            f"the first fails at node {first.node}: {first.why})",
            source=label,
        )
    unmatched = [why for why in failed if why.softmax is not None]  # (a router's Softmax is no attention)
    if unmatched:
        raise InputError(
            f"cannot decode attention {unmatched[0].softmax} ({len(cores)} other attention block(s) matched): "
            f"at node {unmatched[0].node}: {unmatched[0].why}",
            source=label,
        )
    unknown = [c for c in cores if c.score_error is not None]
    if unknown:
        node, why = unknown[0].score_error  # type: ignore[misc]
        raise InputError(
            f"cannot decode attention {unknown[0].softmax} exactly: what the graph does to its scores "
            f"is not reproduced, at node {node}: {why}",
            source=label,
        )
    non_causal = [c for c in cores if not c.causal]
    if len(non_causal) == len(cores):
        raise InputError(
            f"not a decoder-only transformer: no causal self-attention found ({len(cores)} attention "
            f"block(s), none masks later positions before its Softmax {cores[0].softmax}, evaluated at "
            f"several lengths; an encoder such as BERT?)",
            source=label,
        )
    if non_causal:
        raise InputError(
            f"not a decoder-only transformer: {len(non_causal)} of {len(cores)} attention blocks have no "
            f"causal mask (first: {non_causal[0].softmax}; an encoder-decoder?)",
            source=label,
        )
    cross = [c for c in cores if not c.self_attention]
    if cross:
        raise InputError(
            f"not a decoder-only transformer: attention {cross[0].softmax} takes Q and K/V from different "
            "tensors (cross-attention)",
            source=label,
        )
