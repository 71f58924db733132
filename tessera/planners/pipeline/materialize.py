"""A DP entry made concrete: stages with devices, edges (C2), per-stage schedules and in-flight
counts (C4, C5; Table 3.2) and memory re-checked against the limit (Eq. 3.2)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import networkx as nx

from tessera.core.cost import allreduce_time, per_device_samples, sharded_sync_time
from tessera.core.graph import Graph
from tessera.core.schedule import gpipe, in_flight_of, k_f_k_b, one_f_one_b
from tessera.core.specs import ClusterSpec
from tessera.planners.pipeline.dp import stages_of
from tessera.planners.pipeline.greedy import greedy_schedules
from tessera.planners.pipeline.links import clip_time, nic_route, ring_link, ring_nics, stage_edges
from tessera.planners.pipeline.memory import StageMemoryEstimate, sharded_optimizer, stage_memory
from tessera.planners.pipeline.schedule import compute_in_flight
from tessera.planners.pipeline.sp import SPTree
from tessera.planners.pipeline.types import PartitionOptions, Pipeline, PipelineEdge, PipelineStage
from tessera.planners.pipeline.unit_costs import UnitCosts
from tessera.planners.sim import SimStage, sim_edge


def materialize(  # noqa: PLR0913
    graph: Graph,
    cluster: ClusterSpec,
    tree: SPTree,
    costs: UnitCosts,
    opts: PartitionOptions,
    kind: Literal["gpp", "spp"],
    b: int,
    plan: tuple,
    num: int,
    limit: float,
    slack: int = 0,
) -> Pipeline | None:
    """Stages, devices, edges, exact in-flight counts, schedules and memory of a DP solution.

    ``slack`` (1F1B only): extra warm-up forwards on every stage with successors, beyond Table
    3.2's minimum — a stage then sends micro-batch ``i + 1`` while its successor still works on
    ``i``, hiding the transfer behind compute, at the memory of ``slack`` more micro-batches (a
    successor keeps at least one fewer in flight than its predecessor: C5 still holds)."""
    devices = cluster.devices()[:num]
    spans = stages_of(plan)
    stages: list[PipelineStage] = []
    unit_stage: dict[int, int] = {}
    m = opts.mini_batch // b
    ranks = _assign_ranks([d for _, _, d, _ in spans])
    for sid, (lo, hi, d, recompute) in enumerate(spans):
        group = [devices[r] for r in ranks[sid]]
        ids = [dev.id for dev in group]
        s = per_device_samples(b, d)
        fw, bw = costs.times(s)
        f = fw[hi] - fw[lo]
        g = bw[hi] - bw[lo]
        if recompute:
            g += f
        grads = costs.grads[hi] - costs.grads[lo]
        link = ring_link(cluster, group)
        ring = allreduce_time(grads, d, link)
        extra = sharded_sync_time(grads, d, link) - ring if d > 1 and opts.zero != 0 else 0.0
        zero = 1 if opts.zero == 1 and d > 1 else 0
        nodes = [op for u in range(lo, hi) for op in tree.units[u]]
        rank = {n: i for i, n in enumerate(graph.order)}
        nodes.sort(key=rank.__getitem__)
        stages.append(
            PipelineStage(
                id=sid,
                nodes=nodes,
                devices=ids,
                micro_batch_size=b,
                in_flight=1,
                forward_time=f,
                backward_time=g,
                allreduce_time=ring + (extra if zero else 0.0),
                weights=costs.weights[hi] - costs.weights[lo],
                optimizer=costs.optimizer[hi] - costs.optimizer[lo],
                activation_per_sample=costs.act[hi] - costs.act[lo],
                input_per_sample=costs.enter(lo, hi),
                units=(lo, hi),
                allreduce_nics=ring_nics(cluster, group),
                recompute=recompute,
                # ZeRO-1 moves what the all-reduce does (a reduce-scatter of the gradients and an
                # all-gather of the updated weights, each half a ring all-reduce), at the link's
                # measured time for the pair where calibrate measured it.
                zero=zero,
                state=(costs.optimizer[hi] - costs.optimizer[lo]) - grads,
                zero_sync_extra=extra,
            )
        )
        for u in range(lo, hi):
            unit_stage[u] = sid
    _add_shared_weights(graph, cluster, stages, costs.cost)
    edges = stage_edges(graph, tree, unit_stage, costs.cost)
    if kind == "spp":
        # A sequential pipeline runs its stages in order (thesis §3.2: linearizing "imposes new
        # data dependencies"): stage i+1 waits for stage i even where no tensor flows between them.
        have = {(e.src, e.dst) for e in edges}
        edges.extend(
            PipelineEdge(i, i + 1, [], 0.0) for i in range(len(stages) - 1) if (i, i + 1) not in have
        )
        edges.sort(key=lambda e: (e.src, e.dst))
    for e in edges:
        src, dst = stages[e.src].devices, stages[e.dst].devices
        e.src_nics, e.dst_nics, e.nic_share = nic_route(cluster, src, dst)
        e.link = cluster.links.inter_node if e.src_nics else cluster.link_between(src[0], dst[0])
    pipe = Pipeline(
        kind=kind,
        mini_batch_size=opts.mini_batch,
        micro_batch_size=b,
        schedule_kind=opts.searched_schedule,
        k=opts.k if opts.schedule == "kfkb" else 1,
        stages=stages,
        edges=edges,
        bottleneck_tps=max(s.time_per_sample + s.allreduce_time / opts.mini_batch for s in stages),
        estimated_iteration_time=estimate_iteration(stages, edges, b, m),
        search_time_s=0.0,
        num_units=tree.num_units,
        memory_limit=limit,
        zero=opts.zero,
        clip_time=clip_time(cluster, [d for st in stages for d in st.devices], opts.max_grad_norm),
    )
    warm_up = uniform_warm_up(pipe, slack) if slack and opts.searched_schedule == "1f1b" else {}
    return scheduled(pipe, warm_up)


def _add_shared_weights(graph: Graph, cluster: ClusterSpec, stages: list[PipelineStage], cost: Any) -> None:
    """Weights read by several stages (a tied embedding and LM head): every stage but the one the
    unit costs charge holds a copy (weights, gradients, optimizer state), and each stage reading one
    all-reduces its gradient over the devices of all of them (how launch trains it)."""
    groups = [st.nodes for st in stages]
    shared = graph.shared_weights(groups)
    if not shared:
        return
    memory = cost.memory
    owned = graph.shared_owned(groups)
    for st, extra, own in zip(stages, graph.shared_copies(groups), owned, strict=True):
        st.weights += extra * memory.weight_bytes_per_param
        st.optimizer += extra * (memory.gradient_bytes_per_param + memory.optimizer_state_bytes_per_param)
        st.state -= own * memory.optimizer_state_bytes_per_param  # a tied weight's state stays whole
    # One all-reduce per set of readers, of all the weights they share (launch sums them as one
    # bucket per group of ranks), not one per weight: a cut through a layer can share several.
    grouped: dict[tuple[int, ...], int] = {}
    for name, readers in shared.items():
        grouped[tuple(readers)] = grouped.get(tuple(readers), 0) + graph.initializers[name].numel
    by_id = {d.id: d for d in cluster.devices()}
    for readers, numel in grouped.items():
        union = [by_id[d] for i in readers for d in stages[i].devices]
        seconds = allreduce_time(
            numel * memory.gradient_bytes_per_param, len(union), ring_link(cluster, union)
        )
        for i in readers:
            stages[i].allreduce_time += seconds


def scheduled(pipe: Pipeline, extra: Mapping[int, int]) -> Pipeline | None:
    """``pipe`` with every stage's in-flight count, schedule and memory (a copy; ``None`` when a
    stage exceeds ``pipe.memory_limit``).

    In-flight counts are Table 3.2's, in reverse topological order of the stage graph (C5), the
    sinks keeping ``k`` micro-batches. 1F1B only: ``extra[s]`` more warm-up forwards on stage ``s``
    (if it has successors) beyond Table 3.2's minimum — the stage then sends micro-batch ``i + 1``
    while its successors still work on ``i``, hiding transfers and uneven loads behind compute, at
    the memory of ``extra[s]`` more micro-batches. A stage keeps at least Table 3.2's count for
    its successors' actual counts, so C5 holds for any ``extra``."""
    b, k = pipe.micro_batch_size, pipe.k
    m = pipe.mini_batch_size // b
    kind = pipe.schedule_kind
    stages = [dataclasses.replace(st) for st in pipe.stages]
    succ: dict[int, list[int]] = {s.id: [] for s in stages}
    for e in pipe.edges:
        succ[e.src].append(e.dst)
    by_id = {st.id: st for st in stages}
    table: dict[int, int] = {}  # Table 3.2's count with every successor at its own Table 3.2 count
    for st in reversed(stages):  # stage ids follow a topological order of the units
        if kind == "gpipe":
            table[st.id] = st.in_flight = m
            continue
        if not succ[st.id]:
            table[st.id] = st.in_flight = max(1, min(m, k))
            continue
        need = max(compute_in_flight(k, b, k, b, by_id[j].in_flight * b) for j in succ[st.id])
        least = max(compute_in_flight(k, b, k, b, table[j] * b) for j in succ[st.id])
        table[st.id] = max(1, min(m, math.ceil(least / b)))
        own = table[st.id] + (extra.get(st.id, 0) if kind == "1f1b" else 0)
        st.in_flight = max(1, min(m, max(math.ceil(need / b), own)))
    greedy = _greedy(stages, pipe.edges, pipe.mini_batch_size) if kind == "greedy" else {}
    for st in stages:
        if kind == "kfkb":
            st.schedule = k_f_k_b(m, k, st.in_flight)
        elif kind == "gpipe":
            st.schedule = gpipe(m)
        elif kind == "greedy":
            st.schedule = greedy[st.id]
            st.in_flight = in_flight_of(st.schedule)
        else:
            st.schedule = one_f_one_b(m, st.in_flight)
        before = st.zero
        if pipe.zero == "auto":  # ZeRO-1 only where keeping the whole state does not fit
            st.zero = 0
        st.memory = _memory(st, b)
        if st.memory.peak > pipe.memory_limit and pipe.zero == "auto" and len(st.devices) > 1:
            st.zero = 1
            st.memory = _memory(st, b)
        st.allreduce_time += (st.zero - before) * st.zero_sync_extra
        if st.memory.peak > pipe.memory_limit:
            return None
    return dataclasses.replace(pipe, stages=stages)


def _memory(st: PipelineStage, b: int) -> StageMemoryEstimate:
    """Eq. 3.2 for one device of ``st`` as it is scheduled (recomputing, sharded where it does)."""
    d = len(st.devices)
    return stage_memory(
        weights=st.weights,
        optimizer=sharded_optimizer(st.optimizer, st.state, d, st.zero),
        activation_per_sample=st.activation_per_sample,
        input_per_sample=st.input_per_sample,
        micro_batch=b,
        devices=d,
        in_flight=st.in_flight,
        recompute=st.recompute,
    )


def uniform_warm_up(pipe: Pipeline, slack: int) -> dict[int, int]:
    return {st.id: slack for st in pipe.stages}


def _greedy(stages: list[PipelineStage], edges: list[PipelineEdge], mini_batch: int) -> dict[int, list[str]]:
    """Algorithm 4's schedules for the materialized stages (times and transfers as simulated)."""
    sim_stages = [
        SimStage(st.id, st.micro_batch_size, st.forward_time, st.backward_time, (), len(st.devices))
        for st in stages
    ]
    sim_edges = [sim_edge(e) for e in edges]
    return greedy_schedules(sim_stages, sim_edges, mini_batch)


def _assign_ranks(degrees: list[int]) -> list[list[int]]:
    """Device ranks per stage: data-parallel groups (powers of two) first, each aligned to its
    size so that a group fits one node when it can; single-device stages after, in stage order
    (neighbouring stages on neighbouring devices)."""
    order = sorted(range(len(degrees)), key=lambda i: (-degrees[i], i))
    ranks: list[list[int]] = [[] for _ in degrees]
    cursor = 0
    for i in order:
        ranks[i] = list(range(cursor, cursor + degrees[i]))
        cursor += degrees[i]
    return ranks


def estimate_iteration(
    stages: list[PipelineStage], edges: list[PipelineEdge], b: int, m: int, exposed: float = 0.0
) -> float:
    """1F1B iteration time: (m − 1) micro-batches at the slowest stage's pace plus one micro-batch
    along the longest forward+backward path (transfers included), plus the largest all-reduce."""
    graph = nx.DiGraph()
    cycle = {st.id: st.forward_time + st.backward_time for st in stages}
    for st in stages:
        graph.add_node(st.id, w=cycle[st.id])
    for e in edges:
        t = 0.0
        if e.link is not None and e.bytes_per_sample > 0:
            # activations forward, and gradients back where a tensor is floating
            t = (1 + e.grads) * (e.link.latency + e.bytes_per_sample * b / e.link.bandwidth)
        graph.add_edge(e.src, e.dst, w=t)
        cycle[e.dst] += exposed * t  # transfers on the receiver's cycle (dp.StageDP.stage)
    longest: dict[int, float] = {}
    for n in nx.topological_sort(graph):
        into = [longest[p] + graph.edges[p, n]["w"] for p in graph.predecessors(n)]
        longest[n] = graph.nodes[n]["w"] + max(into, default=0.0)
    slowest = max(cycle.values())
    return (m - 1) * slowest + max(longest.values()) + max(st.allreduce_time for st in stages)
