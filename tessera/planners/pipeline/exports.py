"""A training plan in the form another engine runs: Megatron-LM's pipeline layout (``plan --export
megatron``), or why it has none. Megatron cuts a decoder between whole layers along a chain, one
micro-batch size and one data-parallel width for every stage; the layers are found from the
graph's own attention (the cp recognizer), not from node names. Details: docs/gpp.md ("Exports")."""

from __future__ import annotations

from typing import Any

from tessera.core.errors import InputError
from tessera.core.graph import Graph
from tessera.core.plans import GppPlan
from tessera.core.schedule import chain_order
from tessera.planners.cp.recognize import recognize_decoder

__all__ = ["megatron_config"]

_WEIGHT_OPS = ("MatMul", "Gemm")


def megatron_config(plan: GppPlan, graph: Graph) -> dict[str, Any]:
    """``{"expressible", "args", "why"}``: Megatron-LM's arguments (``pretrain_gpt.py``) for the
    same pipeline, or why it cannot run it."""
    ids = [st.id for st in plan.stages]
    if (why := chain_order(ids, [(e.src, e.dst) for e in plan.edges])) is not None:
        return _refused(f"Megatron-LM runs a chain of stages: {why}")
    stages = sorted(plan.stages, key=lambda st: st.id)
    widths = {len(st.devices) for st in stages}
    if len(widths) > 1:
        return _refused(
            f"Megatron-LM replicates every stage equally; this plan's stages have {sorted(widths)} replicas"
        )
    micro = {st.micro_batch_size for st in stages}
    if len(micro) > 1:
        return _refused(f"Megatron-LM runs one micro-batch size; this plan's stages use {sorted(micro)}")
    try:
        decoder = recognize_decoder(graph)
    except InputError as exc:
        return _refused(
            f"Megatron-LM's layouts place decoder layers; no decoder was recognized: {exc.message}"
        )
    stage_of = {n: st.id for st in stages for n in st.nodes}
    layers = _layer_nodes(graph, decoder.cores)
    counts = [0] * len(stages)
    for i, nodes in enumerate(layers):
        held = {stage_of.get(n) for n in nodes}
        if len(held) > 1:
            return _refused(
                f"stages {sorted(s for s in held if s is not None)} cut decoder layer {i} (at {sorted(nodes)[0]}): "
                "Megatron-LM cuts between whole layers"
            )
        counts[held.pop()] += 1
    first = next((c for c in graph.consumers.get(next(iter(graph.inputs)), ()) if c in stage_of), None)
    if first is not None and stage_of[first] != 0:
        return _refused(
            f"the token embedding ({first}) is in stage {stage_of[first]}: Megatron-LM puts it in the first"
        )
    layout = "|".join(
        ("E" if i == 0 else "") + "t" * n + ("L" if i == len(stages) - 1 else "")
        for i, n in enumerate(counts)
    )
    d = widths.pop()
    b = micro.pop()
    if b % d:
        return _refused(
            f"micro-batch {b} does not split evenly over the {d} replicas Megatron-LM gives each a share of"
        )
    args = [
        "--num-layers", str(len(layers)),
        "--pipeline-model-parallel-size", str(len(stages)),
        "--pipeline-model-parallel-layout", layout,
        "--micro-batch-size", str(b // d),
        "--global-batch-size", str(plan.mini_batch_size),
    ]  # fmt: skip
    notes = [f"torchrun --nproc-per-node {len(stages) * d}: data-parallel size {d}"]
    recompute = [st.id for st in stages if st.recompute]
    if recompute and len(recompute) == len(stages):
        args += [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ]
    elif recompute:
        notes.append(f"stages {recompute} recompute and Megatron-LM recomputes every stage or none: not set")
    kind = stages[0].schedule.kind
    if kind != "1f1b":
        notes.append(
            f"Megatron-LM runs 1F1B, not this plan's {kind} schedule: its prediction does not hold there"
        )
    return {"expressible": True, "args": args, "why": "; ".join(notes)}


def _layer_nodes(graph: Graph, cores: Any) -> list[set[str]]:
    """Each decoder layer's attention core and weight products: from its Q/K/V projections to the
    next layer's (the last layer: to the LM head, the last weight product), in graph order."""
    order = {n: i for i, n in enumerate(graph.order)}
    weights = [n for n in graph.order if graph.op(n).op_type in _WEIGHT_OPS and _reads_weight(graph, n)]
    starts = [min(order[c.q_projection], order[c.k_projection], order[c.v_projection]) for c in cores]
    head = order[weights[-1]] if weights else len(order)
    layers = []
    for i, core in enumerate(cores):
        end = starts[i + 1] if i + 1 < len(cores) else head
        layers.append({core.qk_matmul, core.av_matmul} | {n for n in weights if starts[i] <= order[n] < end})
    return layers


def _reads_weight(graph: Graph, node: str) -> bool:
    return any(t in graph.initializers for t in graph.op(node).inputs if t)


def _refused(why: str) -> dict[str, Any]:
    return {"expressible": False, "args": [], "why": why}
