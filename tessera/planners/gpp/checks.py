"""Validity of a GPP/SPP plan: GraphPipe's constraints C1–C5 (thesis §3.3) and Eq. 3.2 memory.

Registered in :data:`tessera.core.plans.PLAN_CHECKS` for kinds ``gpp`` and ``spp`` when this
module is imported (``tessera.planners.gpp`` imports it), so ``tessera validate`` runs it.

- C1: every operator in exactly one stage, and the stages' quotient graph is acyclic (which
  implies every stage is a convex subgraph: a path leaving a stage and re-entering it would be a
  cycle of the quotient graph);
- C2: every operator edge between two stages is an edge of the plan's stage graph;
- C3: every stage has devices, no device is in two stages, and every device is in the cluster;
- C4: each stage's schedule runs F0..F(m−1) and B0..B(m−1) in order, each forward before its
  backward, with m = mini_batch / micro_batch;
- C5: the schedules respect the dependencies across stages — checked by simulating the plan with
  unit times: a schedule that violates C5 deadlocks;
- memory: the peak is weights + optimizer + activations, within the device memory, and the
  in-flight count matches the schedule's.
"""

from __future__ import annotations

from typing import Any

import networkx as nx

from tessera.core.plans import PLAN_CHECKS
from tessera.planners.gpp.schedule import check_schedule, in_flight_of
from tessera.planners.sim import SimEdge, SimStage, simulate


def check_gpp_plan(plan: Any, graph: Any) -> list[str]:
    problems: list[str] = []
    stage_of: dict[str, int] = {}
    for st in plan.stages:
        for n in st.nodes:
            if n in stage_of:
                problems.append(f"C1: node {n!r} is in stages {stage_of[n]} and {st.id}")
            stage_of[n] = st.id
    missing = [n for n in graph.order if n not in stage_of]
    if missing:
        problems.append(f"C1: {len(missing)} node(s) in no stage, first {missing[0]!r}")
    quotient = nx.DiGraph()
    quotient.add_nodes_from(st.id for st in plan.stages)
    needed: set[tuple[int, int]] = set()
    for u, v in graph.dag.edges:
        su, sv = stage_of.get(u), stage_of.get(v)
        if su is not None and sv is not None and su != sv:
            quotient.add_edge(su, sv)
            needed.add((su, sv))
    if not nx.is_directed_acyclic_graph(quotient):
        problems.append("C1: a stage is not convex (the stages' quotient graph has a cycle)")
    declared = {(e.src, e.dst) for e in plan.edges}
    for su, sv in sorted(needed - declared):
        problems.append(f"C2: operators of stage {su} feed stage {sv} but the plan has no edge {su}->{sv}")
    owner: dict[str, int] = {}
    known = None
    if not plan.cluster:  # tessera plan always records it; without it C3 and memory go unchecked
        problems.append("cluster: the plan records no cluster, so C3 and device memory cannot be checked")
    else:
        from tessera.core.specs import ClusterSpec

        try:
            cluster = ClusterSpec.from_json_dict(plan.cluster)
            known = {d.id: d for d in cluster.devices()}
        except Exception as exc:  # noqa: BLE001 - reported as a problem
            problems.append(f"cluster: {exc}")
    for st in plan.stages:
        for dev in st.devices:
            if dev in owner:
                problems.append(f"C3: device {dev!r} is in stages {owner[dev]} and {st.id}")
            owner[dev] = st.id
            if known is not None and dev not in known:
                problems.append(f"C3: stage {st.id} names device {dev!r}, not in the cluster")
    for st in plan.stages:
        if plan.mini_batch_size % st.micro_batch_size:
            problems.append(
                f"stage {st.id}: micro-batch {st.micro_batch_size} does not divide the mini-batch"
            )
            continue
        m = plan.mini_batch_size // st.micro_batch_size
        problems.extend(f"C4: stage {st.id}: {p}" for p in check_schedule(st.schedule.actions, m))
        if st.in_flight != in_flight_of(st.schedule.actions):
            problems.append(
                f"stage {st.id}: in_flight {st.in_flight} but its schedule keeps "
                f"{in_flight_of(st.schedule.actions)} micro-batches in flight"
            )
        mem = st.memory
        if mem.peak != mem.weights + mem.optimizer + mem.activations:
            problems.append(f"memory: stage {st.id} peak is not weights + optimizer + activations")
        memories = [known[d].type.memory for d in st.devices if d in known] if known is not None else []
        if memories:  # unknown devices are reported under C3
            limit = min(memories)
            if mem.peak > limit:
                problems.append(f"memory: stage {st.id} needs {mem.peak} bytes, its devices have {limit}")
    if not any(p.startswith(("C1", "C4")) for p in problems):
        sim_stages = [
            SimStage(st.id, st.micro_batch_size, 1.0, 2.0, tuple(st.schedule.actions)) for st in plan.stages
        ]
        sim_edges = [SimEdge(e.src, e.dst) for e in plan.edges]
        try:
            simulate(sim_stages, sim_edges, plan.mini_batch_size)
        except ValueError as exc:
            problems.append(f"C5: {exc}")
    return problems


for _kind in ("gpp", "spp"):
    if check_gpp_plan not in PLAN_CHECKS.setdefault(_kind, []):
        PLAN_CHECKS[_kind].append(check_gpp_plan)
