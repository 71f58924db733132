"""A plan checked against the model it names: the sha256, the operators it names and covers, the
stage graph, a cp plan's cluster and memory, and the checks registered in :data:`PLAN_CHECKS`."""

from __future__ import annotations

import itertools
import os
from typing import Any

import networkx as nx

from tessera.core.errors import InputError
from tessera.core.plans import PLAN_CHECKS, CpPlan, GppPlan, PlacementPlan, Plan
from tessera.core.rewrite import REWRITES, apply_rewrites

__all__ = ["check_plan_against_model", "cp_plan_problems", "problems_error"]


def check_plan_against_model(plan: Plan, graph: Any) -> list[str]:
    """Problems of a plan against the loaded model it names (empty when it fits).

    Checks the sha256, the node count, that every node the plan names exists, and — for placement
    and pipeline plans — that every node is covered exactly once and the stage graph is a DAG.
    """
    problems: list[str] = []
    if plan.model is None:
        return ["the plan was made from an LLM config (llm_config), not from an ONNX model"]
    if plan.model.sha256 != graph.sha256:
        problems.append(
            f"model changed: the plan was made for sha256 {plan.model.sha256[:12]}…, "
            f"the model is {graph.sha256[:12]}…"
        )
        return problems
    groups: list[list[str]] = []
    if isinstance(plan, PlacementPlan):
        groups = [g.nodes for g in plan.groups]
    elif isinstance(plan, GppPlan):
        groups = [s.nodes for s in plan.stages]
    if plan.model.num_nodes != graph.num_nodes:
        missing = _missing_rewrites(plan.model.num_nodes, {n for nodes in groups for n in nodes}, graph)
        if missing:
            listed = ", ".join(plan.model.rewrites) or "none"
            return [
                f"the plan names the operators of the model rewritten by {', '.join(missing)}, which "
                f"model.rewrites ({listed}) does not list: add it there, or plan again"
            ]
        problems.append(
            f"model.num_nodes is {plan.model.num_nodes}; the model has {graph.num_nodes} operators"
        )
    if groups:
        problems.extend(_coverage_problems(groups, graph))
    if isinstance(plan, GppPlan):
        problems.extend(_stage_graph_problems(plan))
    if isinstance(plan, CpPlan):
        problems.extend(cp_plan_problems(plan))
    for check in PLAN_CHECKS.get(plan.kind, []):
        problems.extend(check(plan, graph))
    return problems


def _coverage_problems(groups: list[list[str]], graph: Any) -> list[str]:
    """Every node of ``graph`` in exactly one group (placement) or stage (pipeline), none unknown."""
    problems: list[str] = []
    known = set(graph.dag.nodes)
    seen: dict[str, int] = {}
    for i, nodes in enumerate(groups):
        for n in nodes:
            if n not in known:
                problems.append(f"group/stage {i} names unknown node {n!r}")
            elif n in seen:
                problems.append(f"node {n!r} is in both group/stage {seen[n]} and {i}")
            else:
                seen[n] = i
    missing = [n for n in graph.order if n not in seen]
    if missing:
        problems.append(f"{len(missing)} node(s) not covered by any group/stage, first {missing[0]!r}")
    return problems


def _stage_graph_problems(plan: GppPlan) -> list[str]:
    """A pipeline's edges between its own stages, and no cycle among them."""
    problems: list[str] = []
    ids = {s.id for s in plan.stages}
    stage_dag = nx.DiGraph()
    stage_dag.add_nodes_from(ids)
    for e in plan.edges:
        if e.src not in ids or e.dst not in ids:
            problems.append(f"edge {e.src}->{e.dst} names an unknown stage")
        stage_dag.add_edge(e.src, e.dst)
    if not nx.is_directed_acyclic_graph(stage_dag):
        problems.append("stage graph has a cycle")
    return problems


def _missing_rewrites(num_nodes: int, named: set[str], graph: Any) -> list[str]:
    """The rewrites a plan's ``model.rewrites`` lost: the fewest rewrites (:data:`REWRITES`) not
    applied to ``graph`` whose application together with those that are gives the model of
    ``num_nodes`` operators with every operator in ``named``; empty when none does. A rewrite that
    comes before an applied one needs the model before its rewrites: read from ``graph``'s file
    again (none when the graph has no file)."""
    applied = set(graph.rewrites)
    base = graph.model
    if applied:
        if not os.path.isfile(graph.source):
            return []
        from tessera.core.graph import load_graph  # the plan schema does not need the IR

        try:
            base = load_graph(graph.source, input_shapes=graph.input_shapes).model
        except InputError:
            return []
    others = [n for n in REWRITES if n not in applied]
    for size in range(1, len(others) + 1):
        for extra in itertools.combinations(others, size):
            names = [n for n in REWRITES if n in applied or n in extra]
            model = apply_rewrites(base, names, label=graph.source)
            ops = {n.name for n in model.graph.node}
            if len(ops) == num_nodes and named <= ops:
                return list(extra)
    return []


def cp_plan_problems(plan: CpPlan) -> list[str]:
    """What a cp plan's schema cannot see: its devices must be in its cluster, and its predicted
    memory per device within that device's capacity."""
    problems: list[str] = []
    devices = plan.workload.get("devices") or [s.device for s in plan.kv_shards]
    if plan.cluster:
        from tessera.core.specs import ClusterSpec

        try:
            spec = ClusterSpec.from_json_dict(plan.cluster)
        except Exception as exc:  # noqa: BLE001 - reported as a problem
            return [f"cluster: {' '.join(str(exc).split())}"]
        known = {d.id for d in spec.devices()}
        resolved = spec.to_json_dict()  # the executor reads these keys (the devices' kinds, nodes)
        problems += [
            f"cluster.{key} is not what the cluster's nodes resolve to"
            for key in ("num_nodes", "num_devices", "devices")
            if key in plan.cluster and plan.cluster[key] != resolved[key]
        ]
        problems += [f"device {d!r} is not in the plan's cluster" for d in devices if d not in known]
        if plan.degree > len(known):
            problems.append(
                f"degree {plan.degree} is more than the {len(known)} device(s) of the plan's cluster"
            )
    memory = plan.predicted.get("memory_per_device")
    memory = memory if isinstance(memory, dict) else {}
    total, capacity = memory.get("total"), memory.get("capacity")
    if isinstance(total, int | float) and isinstance(capacity, int | float) and total > capacity:
        problems.append(f"predicted memory per device {total} bytes exceeds its capacity {capacity}")
    return problems


def problems_error(problems: list[str], source: str) -> InputError:
    """One line for a plan's problems: the first, and how many more."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    error = InputError(f"{problems[0]}{more}", source=source)
    error.problems = list(problems)  # every one, for validate --json
    return error
