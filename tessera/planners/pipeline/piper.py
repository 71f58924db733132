"""Piper-style sequential pipelines: contiguous stages of the unit DAG's ideals (a stage may take
parts of several branches), searched by :mod:`.piper_dp` where the coarsened DAG has few enough
ideals, as the strongest sequential baseline beside the PipeDream-style one. See docs/gpp.md.

References: Tarnawski et al., "Piper: Multidimensional Planner for DNN Parallelization" (NeurIPS 2021);
GraphPipe thesis §3.7."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from tessera.core.cost import CostModel
from tessera.core.errors import InputError
from tessera.core.graph import Graph
from tessera.core.specs import ClusterSpec
from tessera.core.units import format_bytes
from tessera.planners.pipeline.dp import joined
from tessera.planners.pipeline.links import StageLinks
from tessera.planners.pipeline.materialize import materialize
from tessera.planners.pipeline.piper_dp import IdealDP, Lattice, lattice_lower_bound
from tessera.planners.pipeline.search import (
    fastest_mode,
    micro_batch_candidates,
    no_micro_batch,
    planning_inputs,
)
from tessera.planners.pipeline.sp import CutBytes, SPNode, SPTree, coarsen, number_units
from tessera.planners.pipeline.tuning import WARM_UP_SLACKS, fastest_rescheduled, fastest_tuned
from tessera.planners.pipeline.types import PartitionOptions, Pipeline
from tessera.planners.pipeline.unit_costs import UnitCosts
from tessera.planners.sim import simulate_pipeline

# The most ideals the DP runs on: a few seconds at 32 devices (module docstring, "Cost").
PIPER_LIMIT = 1_500


# Coarsening for tractability keeps at least this share of the requested units: the plan is of
# the same model at most ~7x coarser (MMT: layer-sized units), not a different problem.
MIN_UNIT_SHARE = 0.15


_EXPOSED = (0.0, 1.0)  # transfers hidden by the warm-up, or on every stage's cycle (as the GPP DP)


_PER_MICRO_BATCH = 3  # plans per micro-batch size that are materialized


@dataclass
class PiperResult:
    """What :func:`plan_piper` found: a pipeline, or why there is none."""

    pipeline: Pipeline | None
    ideals: int  # ideals of the unit DAG the DP ran on (intractable: of the requested one)
    units: int  # units of that DAG
    requested_units: int  # units of the tree the planner was given
    pairs: int  # ideal pairs I' ⊊ I (the DP's transitions per level and probe)
    search_time_s: float
    reason: str | None = None  # "intractable: N ideals" or the infeasibility, when no pipeline

    @property
    def coarsened(self) -> bool:
        return self.units < self.requested_units

    @property
    def tractable(self) -> bool:
        return self.reason is None or not self.reason.startswith("intractable")

    def describe(self) -> str:
        if self.pipeline is None:
            return self.reason or "no plan"
        more = f", coarsened from {self.requested_units}" if self.coarsened else ""
        return f"{self.ideals} ideals of {self.units} units{more}"


def piper_ideals(tree: SPTree) -> int:
    """Number of ideals (downward-closed sets) of the coarsened unit DAG, exact for the SP tree:
    a leaf has 2, a series of A then B has I(A) + I(B) − 1, a parallel composition the product."""
    return _count(tree.root)


def _count(node: SPNode) -> int:
    if node.kind == "leaf":
        return 2
    counts = [_count(c) for c in node.children]
    if node.kind == "series":
        return sum(counts) - (len(counts) - 1)
    return math.prod(counts)


def plan_piper(
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    *,
    tree: SPTree | None = None,
    limit: int = PIPER_LIMIT,
    coarsen: bool = True,
    cost: CostModel | None = None,
) -> PiperResult:
    """Piper-style sequential pipeline (see the module docstring).

    Returns a :class:`PiperResult`: its ``pipeline`` (kind ``spp``) is ``None`` when the unit DAG
    has more than ``limit`` ideals even after coarsening (``reason`` ``"intractable: N ideals"``)
    or when no plan fits the memory limit. ``cost``: the cost model (default: the roofline).
    ``recompute="auto"``: the fastest of the three modes' plans, as the partitioner picks
    (:func:`~tessera.planners.pipeline.search.fastest_mode`; ``zero="auto"`` too). Raises :class:`InputError`
    for bad options.
    """
    if options.recompute != "auto" and options.zero != "auto":
        return _plan_piper(graph, cluster, options, tree, limit, coarsen, cost)
    started = time.perf_counter()
    results: list[PiperResult] = []

    def search(opts: PartitionOptions) -> Pipeline | None:
        results.append(_plan_piper(graph, cluster, opts, tree, limit, coarsen, cost))
        return results[-1].pipeline

    best = fastest_mode(search, options)
    # The result of the fastest plan; without one, the second search's (the first that chooses
    # per stage: its reason).
    chosen = next((r for r in results if best is not None and r.pipeline is best), results[1])
    return dataclasses.replace(chosen, search_time_s=time.perf_counter() - started)


def _plan_piper(
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    tree: SPTree | None,
    limit: int,
    coarsen: bool,
    cost: CostModel | None,
) -> PiperResult:
    """:func:`plan_piper` for one recompute mode (``auto``: the per-stage choice of the DP)."""
    started = time.perf_counter()
    num, limit_bytes, cost, tree = planning_inputs(graph, cluster, options, tree, cost)
    requested, requested_ideals = tree.num_units, piper_ideals(tree)
    planned, ideals = _tractable_tree(graph, cost, tree, limit, coarsen)
    if ideals > limit:
        more = f"; {ideals} at {planned.num_units} units, the coarsest tried" if planned is not tree else ""
        return PiperResult(
            None,
            requested_ideals,
            requested,
            requested,
            0,
            time.perf_counter() - started,
            f"intractable: {requested_ideals} ideals (limit {limit}{more})",
        )
    tree = planned
    cands = micro_batch_candidates(options)
    if not cands:
        raise InputError(no_micro_batch(options))
    lattice = Lattice(graph, tree, cost)
    links = StageLinks(cluster, num)
    pool: list[tuple[float, int, Pipeline]] = []
    best_estimate = math.inf
    lower = {b: lattice_lower_bound(lattice, options.mini_batch, b, num) for b in cands}
    for b in sorted(cands, key=lambda b: (lower[b], b)):
        if lower[b] >= best_estimate:
            continue  # no plan at this micro-batch size can beat the best so far
        dp = IdealDP(lattice, links, options, b, limit_bytes, num)
        found: dict[tuple[tuple[int, int], ...], float] = {}
        for exposed in _EXPOSED:
            if exposed and found and not any(dp.transfers_matter(plan) for plan in found):
                continue
            # The exposed-transfer run only proposes alternatives: a coarser bisection will do.
            for plan in dp.search(exposed, options.epsilon * (3 if exposed else 1)):
                found.setdefault(plan, dp.estimate(plan))
        # The best few by the 1F1B estimate are materialized (exact in-flight counts and memory).
        for plan in sorted(found, key=lambda p: (found[p], p))[:_PER_MICRO_BATCH]:
            # With 1F1B, also with one more warm-up micro-batch per stage (as the partitioner tries).
            for slack in WARM_UP_SLACKS if options.searched_schedule == "1f1b" else (0,):
                stages = dp.stages(plan)
                pipe = _to_pipeline(
                    graph, cluster, lattice.costs, options, b, stages, num, limit_bytes, slack
                )
                if pipe is not None:
                    pool.append((pipe.estimated_iteration_time, len(pool), pipe))
                    best_estimate = min(best_estimate, pipe.estimated_iteration_time)
    elapsed = time.perf_counter() - started
    if not pool:
        return PiperResult(
            None,
            ideals,
            tree.num_units,
            requested,
            lattice.pairs,
            elapsed,
            f"infeasible: no sequential plan fits {format_bytes(limit_bytes)} per device",
        )
    best = _fastest([p for _, _, p in pool], options)
    best.search_time_s = time.perf_counter() - started
    return PiperResult(best, ideals, tree.num_units, requested, lattice.pairs, best.search_time_s)


def _fastest(pool: list[Pipeline], options: PartitionOptions) -> Pipeline:
    """The fastest of ``pool`` as the simulator times them (about a millisecond each), the fastest
    few with their warm-up tuned per stage (as the partitioner does)."""
    timed = [
        (
            (
                simulate_pipeline(p, trace=False).iteration_time,
                p.bottleneck_tps,
                p.estimated_iteration_time,
                sum(st.in_flight for st in p.stages),
                tuple(tuple(st.nodes) for st in p.stages),
            ),
            p,
        )
        for p in pool
    ]
    if options.searched_schedule == "1f1b":
        best, rank = fastest_tuned(timed)
    else:
        rank, best = min(timed, key=lambda rp: rp[0])
    if options.schedule == "auto":
        best = fastest_rescheduled(best, rank[0], timed)
    return best


def _tractable_tree(
    graph: Graph, cost: CostModel, tree: SPTree, limit: int, coarsen: bool
) -> tuple[SPTree, int]:
    """``tree``, or its finest coarsening with at most ``limit`` ideals and at least
    ``MIN_UNIT_SHARE`` of its units; else (the count to report) the coarsest such tree."""
    ideals = piper_ideals(tree)
    if ideals <= limit or not coarsen:
        return tree, ideals
    floor = max(1, math.ceil(MIN_UNIT_SHARE * tree.num_units))
    # Bisection on the coarsening threshold (the partitioner's rule, sp.decompose): a larger
    # threshold merges more units, and the ideals of the coarser DAG are a subset.
    # Below the lightest unit's cost nothing merges; at the whole model's cost everything does.
    lightest = min(leaf.cost for leaf in tree.root.leaves())
    lo, hi = max(lightest / 2, tree.root.cost * 1e-9, 1e-300), max(tree.root.cost, 1e-300)
    coarsest = tree
    for _ in range(60):
        cand = _coarser(graph, tree, math.sqrt(lo * hi))
        if cand.num_units < floor:
            hi = math.sqrt(lo * hi)
            continue
        coarsest = cand
        if piper_ideals(cand) <= limit:
            hi = math.sqrt(lo * hi)
        else:
            lo = math.sqrt(lo * hi)
        if hi / lo < 1.001:
            break
    best = _coarser(graph, tree, hi)
    if best.num_units >= floor and piper_ideals(best) <= limit:
        return best, piper_ideals(best)
    return coarsest, piper_ideals(coarsest)


def _coarser(graph: Graph, tree: SPTree, threshold: float) -> SPTree:
    """``tree`` with subtrees of cost ≤ ``threshold`` merged into one unit and consecutive light
    units of a series merged at cheap cuts (the partitioner's coarsening, :mod:`tessera.planners.pipeline.sp`)."""
    root = coarsen(tree.root, threshold, CutBytes(graph))
    number_units(root, 0)
    rank = {n: i for i, n in enumerate(graph.order)}
    units: list[tuple[str, ...]] = []
    for leaf in root.leaves():
        old = sorted({tree.unit_of[op] for op in leaf.ops})  # constants stay with their unit
        units.append(tuple(sorted((op for u in old for op in tree.units[u]), key=rank.__getitem__)))
    unit_of = {op: i for i, ops in enumerate(units) for op in ops}
    return SPTree(root=root, units=units, unit_of=unit_of, converted=tree.converted)


def _to_pipeline(  # noqa: PLR0913
    graph: Graph,
    cluster: ClusterSpec,
    costs: UnitCosts,
    opts: PartitionOptions,
    b: int,
    stages: list[tuple[list[int], int, bool]],
    num: int,
    limit: float,
    slack: int = 0,
) -> Pipeline | None:
    """Materialize a chain of ideals with the partitioner's own code: the units reordered stage by
    stage (a topological order, since every prefix of stages is an ideal), so that every stage is
    a contiguous range of that order; ``None`` when a stage exceeds the memory limit with its exact
    in-flight count. ``costs``: the units' costs in the tree's own order."""
    order = [u for units, _, _ in stages for u in units]
    reordered = costs.tree.chained(order)
    plan: tuple | None = None
    end = len(order)
    for units, d, recompute in reversed(stages):
        span = ("S", end - len(units), end, d, int(recompute))
        plan = span if plan is None else joined(span, plan)
        end -= len(units)
    assert plan is not None
    return materialize(
        graph, cluster, reordered, costs.reordered(reordered, order), opts, "spp", b, plan, num, limit, slack
    )
