"""Sequential pipeline-parallel (SPP) baselines on GraphPipe's cost model: PipeDream-style contiguous
stages of one topological order, and Piper-style stages of the DAG's ideals (:mod:`.piper`); the
faster is the baseline a GPP plan is compared with.

References: PipeDream (SOSP 2019); Piper (NeurIPS 2021); GraphPipe thesis §3.7.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Literal

from tessera.core.cost import CostModel
from tessera.core.errors import InfeasibleError
from tessera.core.graph import Graph
from tessera.core.specs import ClusterSpec
from tessera.planners.pipeline.piper import PIPER_LIMIT, PiperResult, piper_ideals, plan_piper
from tessera.planners.pipeline.search import partition, planning_inputs
from tessera.planners.pipeline.sp import SPNode, SPTree
from tessera.planners.pipeline.types import PartitionOptions, Pipeline
from tessera.planners.pipeline.unit_costs import computes
from tessera.planners.sim import simulate_pipeline

__all__ = [
    "PIPER_LIMIT",
    "SequentialPipeline",
    "piper_ideals",
    "plan_sequential",
    "plan_spp",
    "method_name",
    "sequential_record",
]

Method = Literal["pipedream", "piper"]


@dataclass
class SequentialPipeline(Pipeline):
    """A sequential :class:`Pipeline` that says which planner made it and how the other fared."""

    method: Method = "pipedream"
    pipedream_throughput: float | None = None  # simulated samples/s of the PipeDream-style plan
    piper: PiperResult | None = None  # None when Piper was not run
    piper_throughput: float | None = None


def plan_spp(
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    *,
    tree: SPTree | None = None,
    cost: CostModel | None = None,
    explain: bool = True,
) -> Pipeline:
    """PipeDream-style sequential pipeline (see the module docstring): the faster simulated of
    the chain DP on the linearized tree and the same DP guided by the series-parallel tree.

    Raises the chain DP's :class:`InfeasibleError` when neither finds a plan (``explain``: its
    message names the least memory a plan needs, a search of several plans)."""
    started = time.perf_counter()
    _, _, cost, tree = planning_inputs(graph, cluster, options, tree, cost)
    proposals: list[Pipeline] = []
    error: InfeasibleError | None = None
    trees = [tree.linearized(), tree] if _has_branches(tree.root) else [tree.linearized()]
    for proposer in trees:
        try:
            proposals.append(
                partition(graph, cluster, options, tree=proposer, kind="spp", cost=cost, explain=explain)
            )
        except InfeasibleError as exc:
            error = error or exc
    if not proposals:
        assert error is not None
        raise error
    best = min(proposals, key=lambda p: simulate_pipeline(p, trace=False).iteration_time)
    best.search_time_s = time.perf_counter() - started
    return best


def _has_branches(node: SPNode) -> bool:
    return node.kind == "parallel" or any(_has_branches(c) for c in node.children)


def plan_sequential(
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    *,
    tree: SPTree | None = None,
    cost: CostModel | None = None,
    piper: bool = True,
    explain: bool = True,
) -> SequentialPipeline:
    """The strongest sequential pipeline: PipeDream-style, or Piper-style where Piper is
    tractable and its plan simulates faster (ties go to PipeDream). ``piper=False`` skips Piper.
    ``cost``: the cost model (default: the roofline).

    Raises what :func:`plan_spp` raises (``InfeasibleError`` when no sequential plan fits;
    ``explain``: see there).
    """
    _, _, cost, tree = planning_inputs(graph, cluster, options, tree, cost)
    pipedream = plan_spp(graph, cluster, options, tree=tree, cost=cost, explain=explain)
    pd_time = simulate_pipeline(pipedream, trace=False).iteration_time
    result = plan_piper(graph, cluster, options, tree=tree, cost=cost) if piper else None
    chosen: Pipeline = pipedream
    method: Method = "pipedream"
    piper_throughput = None
    if (
        result is not None
        and result.pipeline is not None
        and _stages_as_asked(graph, result.pipeline, options)
    ):
        sim = simulate_pipeline(result.pipeline, trace=False)
        piper_throughput = sim.throughput
        if sim.iteration_time < pd_time:
            chosen, method = result.pipeline, "piper"
    fields = {f.name: getattr(chosen, f.name) for f in dataclasses.fields(Pipeline)}
    fields["search_time_s"] = pipedream.search_time_s + (result.search_time_s if result else 0.0)
    return SequentialPipeline(
        **fields,
        method=method,
        pipedream_throughput=options.mini_batch / pd_time,
        piper=result,
        piper_throughput=piper_throughput,
    )


def _stages_as_asked(graph: Graph, pipe: Pipeline, options: PartitionOptions) -> bool:
    """Whether ``pipe`` has the stages ``--stages`` asks for (Piper's search does not take a count):
    that many, each holding a weight or computing FLOPs, as the DP's (:func:`computes`)."""
    if options.stages is None:
        return True
    return len(pipe.stages) == options.stages and all(computes(graph, s.nodes) for s in pipe.stages)


def sequential_record(pipe: Pipeline) -> dict[str, Any]:
    """What a plan records about its sequential planners (``{}`` for other pipelines):
    ``sequential_method`` (``pipedream`` or ``piper``), ``pipedream_throughput_samples_per_s`` and
    ``piper`` (the Piper-style result: throughput, ideals and units, or why there is none)."""
    if not isinstance(pipe, SequentialPipeline):
        return {}
    out: dict[str, Any] = {"sequential_method": pipe.method}
    if pipe.pipedream_throughput is not None:
        out["pipedream_throughput_samples_per_s"] = _r(pipe.pipedream_throughput)
    r = pipe.piper
    if r is not None:
        piper: dict[str, Any] = {"ideals": r.ideals, "units": r.units}
        if r.coarsened:
            piper["coarsened_from_units"] = r.requested_units
        if r.pipeline is not None and pipe.piper_throughput is not None:
            piper["throughput_samples_per_s"] = _r(pipe.piper_throughput)
        else:
            piper["no_plan"] = r.reason
        out["piper"] = piper
    return out


def method_name(pipe: Pipeline) -> str:
    """A one-line description of the planner behind a sequential pipeline."""
    if isinstance(pipe, SequentialPipeline) and pipe.method == "piper":
        return "Piper-style sequential stages (DP over the ideals of the unit DAG) on the same cost model"
    return "PipeDream-style sequential stages on the same cost model"


def _r(x: float) -> float:
    """9 significant digits: stable JSON across platforms' float noise (as the plan writer)."""
    return float(f"{x:.9g}")
