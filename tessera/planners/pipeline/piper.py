"""Piper-style sequential pipeline partitioner: a dynamic program over the ideals of the unit DAG.

Piper (Tarnawski, Narayanan & Phanishayee, NeurIPS 2021; GraphPipe paper §7.2, Table 1) plans a
*sequential* pipeline without linearizing the model first: its DP runs over the *ideals* (downsets,
Piper's Definition 4.1) of the operator DAG, and a stage is the difference ``I \\ I'`` of two
ideals ``I' ⊊ I`` — a convex ("contiguous") set that may take part of several parallel branches.
A PipeDream-style plan (:func:`tessera.planners.pipeline.spp.plan_spp`) cuts one fixed topological
order; Piper's search space holds the cuts of every topological order at once. The price is the
number of ideals, exponential in the number of parallel branches: the DP looks at every pair
``I' ⊊ I`` (Piper's ``O(|D|²)``, its Appendix D), so GraphPipe reports no Piper strategy for DLRM
and CANDLE-Uno (8+ branches) and minutes of search for MMT.

:func:`plan_piper` runs on the same units (the leaves of the coarsened series-parallel tree,
:func:`tessera.planners.pipeline.search.build_tree`), cost model, memory model (Eq. 3.2),
micro-batch candidates and schedules as the PipeDream-style planner, and returns the same
:class:`~tessera.planners.pipeline.types.Pipeline` (kind ``spp``: stages run in order, stage
``i + 1`` after stage ``i``):

- **tractability**: the ideals are counted exactly first (:func:`piper_ideals`). The DP runs on at
  most :data:`PIPER_LIMIT` ideals. Above it — as Piper's own evaluation plans at layer
  granularity — the units are coarsened further (the partitioner's coarsening rule with a larger
  threshold: whole light subtrees and runs of light units merge) to the finest coarsening within
  the limit, keeping at least :data:`MIN_UNIT_SHARE` of the units; when even that is over the
  limit there is no plan and the result says ``intractable: N ideals``. A coarsened run says so
  (:attr:`PiperResult.units` < :attr:`PiperResult.requested_units`).
- **objective** (PipeDream's and Piper's): the smallest bottleneck time per sample (TPS) of any
  stage, all-reduce included, under the per-device memory limit. For a bound ``t`` the DP computes
  ``W(I, s)``, the fewest devices (then the fewest stages) that run ideal ``I`` as consecutive
  stages with every TPS ≤ ``t`` when ``s`` stages follow ``I``::

      W(∅, s) = 0,   W(I, s) = min over ideals I' ⊊ I of  need(I \\ I', s) + W(I', s + 1)

  where ``need(S, s)`` is the smallest data-parallel degree (a power of two, at most the
  micro-batch) at which stage ``S`` has TPS ≤ ``t`` and fits the memory limit holding
  ``min(m, k·(s + 1))`` micro-batches in flight (1F1B: one more than the stages after it; kFkB:
  ``k`` times that; GPipe: all ``m``) — with ``recompute="auto"``, keeping its activations where
  that fits, else recomputing them. Level ``s`` only reads level ``s + 1``, so a level is one
  vectorized min-plus product over all pairs (levels: up to one per device). ``t`` is bisected to
  a relative precision ``epsilon`` per micro-batch size, then a few looser bounds are probed
  (shallower plans); transfers are charged as the PipeDream-style DP charges them (a stage
  receives everything crossing its left cut), hidden by the warm-up or on every cycle — both are
  searched, the second only where transfers change a plan's estimate.
- **choice**: the plans of the probes are ranked by the partitioner's 1F1B iteration estimate
  (fill and drain along the stage graph included); the best few per micro-batch size are
  materialized with exact in-flight counts, schedules and memory by the partitioner's own code
  (on the units reordered stage by stage, so every stage is a contiguous range; with 1F1B also
  with one more warm-up micro-batch per stage, as the partitioner does), and the simulator picks
  among all of them (:func:`tessera.planners.sim.simulate_pipeline`).

Cost. A probe costs about ``pairs × levels`` element operations. With :data:`PIPER_LIMIT` = 1,500
the paper-size MMT (four branches; 97 units coarsened to 21) plans in 0.5–2.2 s for 4–32 devices
on this project's 2-core machine (measured on an earlier 69-unit tree: 25 units, 2,402 ideals,
3–8 s; 29 units, 4,097 ideals, 9–21 s, for the same throughput); CANDLE-Uno (65 units coarsened
to 10) in about 0.1 s. DLRM stays intractable (its eight branches: 1e10 ideals).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from tessera.core.cost import CostModel, allreduce_time, per_device_samples
from tessera.core.errors import InputError
from tessera.core.graph import Graph
from tessera.core.specs import ClusterSpec, Link
from tessera.core.units import format_bytes
from tessera.planners.pipeline.dp import RECOMPUTE_VARIANTS
from tessera.planners.pipeline.links import StageLinks
from tessera.planners.pipeline.materialize import materialize
from tessera.planners.pipeline.search import (
    fastest_recompute_mode,
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
_LADDER = (1.25, 1.6, 2.5)  # looser bounds probed after the bisection (shallower plans)
_STAGE = 1 << 10  # W's encoding: devices · _STAGE + stages (stages ≤ devices < _STAGE)
_INF = 1 << 28  # int32: two of them still add without overflow
_BIG = 1 << 30


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
    (:func:`~tessera.planners.pipeline.search.fastest_recompute_mode`). Raises :class:`InputError`
    for bad options.
    """
    if options.recompute != "auto":
        return _plan_piper(graph, cluster, options, tree, limit, coarsen, cost)
    started = time.perf_counter()
    results: list[PiperResult] = []

    def search(opts: PartitionOptions) -> Pipeline | None:
        results.append(_plan_piper(graph, cluster, opts, tree, limit, coarsen, cost))
        return results[-1].pipeline

    best = fastest_recompute_mode(search, options)
    # The result of the fastest plan; without one, the per-stage search's (its reason).
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
    lattice = _Lattice(graph, tree, cost)
    links = StageLinks(cluster, num)
    pool: list[tuple[float, int, Pipeline]] = []
    best_estimate = math.inf
    lower = {b: _lower_bound(lattice, options.mini_batch, b, num) for b in cands}
    for b in sorted(cands, key=lambda b: (lower[b], b)):
        if lower[b] >= best_estimate:
            continue  # no plan at this micro-batch size can beat the best so far
        dp = _IdealDP(lattice, links, options, b, limit_bytes, num)
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
    # The simulator picks among all of them (about a millisecond each), the fastest few with
    # their warm-up tuned per stage (as the partitioner does).
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
        for _, _, p in pool
    ]
    if options.searched_schedule == "1f1b":
        best, rank = fastest_tuned(timed)
    else:
        rank, best = min(timed, key=lambda rp: rp[0])
    if options.schedule == "auto":
        best = fastest_rescheduled(best, rank[0], timed)
    best.search_time_s = time.perf_counter() - started
    return PiperResult(best, ideals, tree.num_units, requested, lattice.pairs, best.search_time_s)


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


class _Lattice:
    """The ideals of the unit DAG, their pairs ``I' ⊊ I``, and per-ideal sums of unit costs.

    Ideals are sorted by their cost (the units' coarsening weights), then size: every proper
    sub-ideal of an ideal comes before it, and the ideals light enough for a level of the DP form
    a short prefix. Pairs are grouped by ``I`` in that order: ideal ``i``'s sub-ideals are pairs
    ``group[i] .. group[i + 1] − 1``.
    """

    def __init__(self, graph: Graph, tree: SPTree, cost: CostModel) -> None:
        self.tree = tree
        self.costs = UnitCosts(graph, tree, cost)
        raw = _ideals(tree.root)
        n, u = len(raw), tree.num_units
        self.n = n
        words = (u + 63) // 64
        full = (1 << 64) - 1
        w = np.zeros((n, words), dtype=np.uint64)
        for j in range(words):
            w[:, j] = np.array([(x >> (64 * j)) & full for x in raw], dtype=np.uint64)
        member = np.zeros((n, u), dtype=np.int64)
        for k in range(u):
            member[:, k] = ((w[:, k // 64] >> np.uint64(k % 64)) & np.uint64(1)).astype(np.int64)
        leaf_cost = np.array([leaf.cost for leaf in tree.root.leaves()], dtype=float)
        scale = float(leaf_cost.sum()) or 1.0
        weight = member @ np.round(np.maximum(leaf_cost, 0.0) / scale * 2**32).astype(np.int64)  # exact
        order = np.lexsort((np.arange(n), member.sum(axis=1), weight))
        self.masks = [raw[i] for i in order]
        w = w[order]
        self.member = member[order].astype(float)
        lows: list[np.ndarray] = []
        counts = np.zeros(n, dtype=np.int64)
        for i in range(1, n):
            sub = np.flatnonzero(np.all((w[:i] & ~w[i]) == 0, axis=1))
            lows.append(sub)
            counts[i] = len(sub)
        self.lo = np.concatenate(lows).astype(np.int32) if lows else np.zeros(0, dtype=np.int32)
        self.hi = np.repeat(np.arange(n, dtype=np.int32), counts)
        self.group = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self.pairs = len(self.lo)
        c = self.costs
        self.weights = self._pair_sum(np.diff(c.weights))
        self.optimizer = self._pair_sum(np.diff(c.optimizer))
        self.grads = self._pair_sum(np.diff(c.grads))
        self.act = self._pair_sum(np.diff(c.act))
        # The activations that cross units, each counted once per stage that reads it (a stage
        # receives a tensor once however many of its units read it): made[t, u] = 1 where unit u
        # makes tensor t, read[t, u] = 1 where u reads it; wire bytes per sample.
        tensors = c.tensors
        self.made = np.zeros((len(tensors), u))
        self.read = np.zeros((len(tensors), u))
        for t, (p, readers, _) in enumerate(tensors):
            self.made[t, p] = 1.0
            self.read[t, list(readers)] = 1.0
        self.tensor_bytes = np.array([w for _, _, w in tensors])
        self.unit_grads = np.diff(c.grads)
        self._made_in = self.member @ self.made.T  # ideals × tensors: made inside the ideal
        self._read_in = self.member @ self.read.T  # ideals × tensors: readers inside
        # Wire bytes per sample crossing each ideal's cut (a sequential stage receives all of it):
        # made inside, read by some unit outside.
        outside = (self.read.sum(axis=1) - self._read_in) > 0
        self.cut = (self._made_in * outside) @ self.tensor_bytes
        self._input: np.ndarray | None = None

    def _pair_sum(self, per_unit: np.ndarray) -> np.ndarray:
        per_ideal = self.member @ per_unit
        return per_ideal[self.hi] - per_ideal[self.lo]

    def times(self, samples: int) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward time of every pair's stage at ``samples`` samples per replica."""
        fw, bw = self.costs.times(samples)
        return self._pair_sum(np.diff(fw)), self._pair_sum(np.diff(bw))

    def stage_input(self) -> np.ndarray:
        """Wire bytes per sample entering every pair's stage ``I \\ I'`` from ``I'`` (recompute)."""
        if self._input is None:
            out = np.empty(self.pairs)
            step = max(1, (1 << 22) // max(1, len(self.tensor_bytes)))
            for a in range(0, self.pairs, step):
                lo, hi = self.lo[a : a + step], self.hi[a : a + step]
                # made in I', read by some unit of I \ I' (I' ⊂ I): each tensor once
                enters = self._made_in[lo] * ((self._read_in[hi] - self._read_in[lo]) > 0)
                out[a : a + step] = enters @ self.tensor_bytes
            self._input = out
        return self._input

    def flows(self, assign: np.ndarray) -> np.ndarray:
        """Wire bytes per sample from stage ``i`` to stage ``j`` (``assign``: stages × units, 1
        where the stage has the unit): the tensors made in ``i`` and read in ``j``, each once."""
        return ((assign @ self.made.T) * self.tensor_bytes) @ ((self.read @ assign.T) > 0)

    def unit_times(self, samples: int) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward time of every unit at ``samples`` samples."""
        fw, bw = self.costs.times(samples)
        return np.diff(fw), np.diff(bw)

    def unit_work(self, samples: int) -> np.ndarray:
        fw, bw = self.unit_times(samples)
        return fw + bw


def _ideals(node: SPNode) -> list[int]:
    """Every ideal of ``node``'s units as a bit mask over the unit numbers."""
    if node.kind == "leaf":
        return [0, 1 << node.lo]
    if node.kind == "series":
        out = [0]
        done = 0
        for c in node.children:
            out.extend(done | x for x in _ideals(c) if x)
            done |= ((1 << c.hi) - 1) ^ ((1 << c.lo) - 1)
        return out
    out = [0]
    for c in node.children:
        sub = _ideals(c)
        out = [a | x for a in out for x in sub]
    return out


def _lower_bound(lattice: _Lattice, mini_batch: int, b: int, num: int) -> float:
    """A lower bound on the 1F1B iteration estimate at micro-batch ``b``: ``m − 1`` cycles of the
    larger of a balanced share of the work and the heaviest unit at its most data parallel, plus
    one micro-batch through every unit in sequence at that pace (roofline time is sub-linear in
    the samples, so no stage is faster)."""
    fastest = lattice.unit_work(per_device_samples(b, min(b, num)))
    cycle = max(float(lattice.unit_work(b).sum()) / num, float(fastest.max()))
    return (mini_batch // b - 1) * cycle + float(fastest.sum())


def _allreduce(nbytes: np.ndarray, devices: int, link: Link | None) -> np.ndarray:
    """Ring all-reduce (:func:`tessera.core.cost.allreduce_time`), over an array of sizes."""
    if devices <= 1 or link is None:
        return np.zeros_like(nbytes)
    p = devices
    t = 2 * (p - 1) / p * nbytes / link.bandwidth + 2 * (p - 1) * link.latency
    return np.where(nbytes > 0, t, 0.0)


class _IdealDP:
    """The DP of the module docstring for one micro-batch size ``b``.

    Per data-parallel degree ``k`` and pair ``p = (I', I)``: the stage's TPS, and ``smax[k, p]``,
    the most stages that may follow it before its in-flight micro-batches exceed the memory limit.
    For a bound ``t``, ``need(p, s)`` is the smallest degree with TPS ≤ ``t`` and ``smax ≥ s``.
    Going down the levels ``s`` it only gets smaller, at the *breakpoints* where the running
    maximum of ``smax`` over a pair's TPS-feasible degrees reaches ``s``: each probe sorts the
    breakpoints once and updates ``need`` level by level.
    """

    def __init__(
        self, lattice: _Lattice, links: StageLinks, opts: PartitionOptions, b: int, limit: float, num: int
    ) -> None:
        self.lat, self.links = lattice, links
        self.b, self.B, self.num = b, opts.mini_batch, num
        self.m = m = opts.mini_batch // b
        step = opts.k if opts.schedule == "kfkb" else 1
        if opts.schedule == "gpipe":
            step = m
        self.levels = min(num, lattice.tree.num_units)  # stages after an ideal: 0 .. levels − 1
        # A stage's options, the "degrees" ``k`` below: (data-parallel degree, recompute),
        # degree-major, so their device counts (codes) never decrease and a degree's variant that
        # keeps its activations comes first: a stage recomputes only where that is not feasible.
        degrees = [1 << p for p in range(32) if (1 << p) <= min(b, num)]
        self.rows = [(d, r) for d in degrees for r in RECOMPUTE_VARIANTS[opts.recompute]]
        self.codes = np.array([d * _STAGE + 1 for d, _ in self.rows], dtype=np.int32)
        n_pairs, n_rows = lattice.pairs, len(self.rows)
        self.tps = np.empty((n_rows, n_pairs))
        self.smax = np.empty((n_rows, n_pairs), dtype=np.int16)
        top = self.levels - 1
        static = lattice.weights + lattice.optimizer
        for k, (d, recompute) in enumerate(self.rows):
            s = per_device_samples(b, d)
            fw, bw = lattice.times(s)
            compute = fw + bw + (fw if recompute else 0.0)
            self.tps[k] = compute / b + _allreduce(lattice.grads, d, links.within(d)) / self.B
            if math.isinf(limit):
                self.smax[k] = top
                continue
            free = limit - static
            if recompute:
                free = free - s * lattice.act
                per = s * lattice.stage_input()
            else:
                per = s * lattice.act
            with np.errstate(divide="ignore", invalid="ignore"):
                cap = np.where(per > 0, np.floor(free / np.where(per > 0, per, 1.0)), _BIG)
            cap = np.where(free < 0, -1, cap)
            # Eq. 3.2 with min(m, step · (s + 1)) micro-batches in flight (Table 3.2).
            most = np.where(cap >= m, top, cap // step - 1)
            most = np.where(cap < min(step, m), -1, most)
            self.smax[k] = np.clip(most, -1, top)
        self.transfer = np.zeros(n_pairs)  # per sample, activations in and gradients out
        p2p = links.p2p
        if p2p is not None:
            cut = lattice.cut[lattice.lo]
            self.transfer = np.where(cut > 0, 2 * (p2p.latency + cut * b / p2p.bandwidth), 0.0) / b
        work = lattice.unit_work(b) / b
        self.total_work = float(work.sum())
        self.ideal_work = lattice.member @ work
        self.heaviest = float(lattice.unit_work(per_device_samples(b, min(b, num))).max()) / b

    def search(self, exposed: float, epsilon: float) -> list[tuple[tuple[int, int], ...]]:
        """Bisection on the bottleneck bound ``t`` (transfers on every cycle with ``exposed``):
        the plan of every feasible probe, as stages (pair, degree index) in order."""
        tps = self.tps + exposed * self.transfer if exposed else self.tps
        # No plan beats perfect balance, nor the heaviest unit at its most data parallel.
        lo_t = max(self.total_work / self.num, self.heaviest) * (1 - 1e-9)
        whole = int(self.lat.group[-2])  # the pair (∅, every unit): the model as one stage
        ceiling = 4 * float(tps[0, whole]) + 1e-12  # beyond this, memory is what rules plans out
        plans: list[tuple[tuple[int, int], ...]] = []
        hi_t, step = lo_t, 1.25
        while True:
            hi_t = min(hi_t * step, ceiling)
            levels = self._run(tps, hi_t)
            if levels is not None:
                plans.append(self._plan(tps, hi_t, levels))
                hi_t = max(float(tps[k, p]) for p, k in plans[-1])  # its own bottleneck
                break
            if hi_t >= ceiling:
                return []
            lo_t = hi_t
            step *= step
        while hi_t / lo_t > 1 + epsilon:
            mid = math.sqrt(lo_t * hi_t)
            levels = self._run(tps, mid)
            if levels is None:
                lo_t = mid
                continue
            plans.append(self._plan(tps, mid, levels))
            hi_t = max(float(tps[k, p]) for p, k in plans[-1])
        # Looser bounds give shallower pipelines (fewer devices, then fewer stages, at each bound),
        # whose shorter fill and drain may win over a slightly smaller bottleneck.
        for factor in _LADDER:
            if len(plans[-1]) == 1 or hi_t * factor >= ceiling:
                break
            levels = self._run(tps, hi_t * factor)
            if levels is not None:
                plans.append(self._plan(tps, hi_t * factor, levels))
        return plans

    def estimate(self, plan: tuple[tuple[int, int], ...], exposed: float = 0.0) -> float:
        """The partitioner's 1F1B estimate of a plan, before materializing it: ``m − 1`` cycles of
        the slowest stage (its incoming transfers on its cycle with ``exposed``), one micro-batch
        along the longest path of the stage graph (stages in order, plus a transfer wherever
        tensors flow between two stages), and the largest all-reduce."""
        lat, b = self.lat, self.b
        assign = np.stack([lat.member[lat.hi[p]] - lat.member[lat.lo[p]] for p, _ in plan])
        flows = lat.flows(assign)
        cycles, allreduces = [], []
        for (_, k), units in zip(plan, assign, strict=True):
            d, recompute = self.rows[k]
            fw, bw = lat.unit_times(per_device_samples(b, d))
            cycles.append(float(units @ (fw + bw + (fw if recompute else 0.0))))
            allreduces.append(allreduce_time(float(units @ lat.unit_grads), d, self.links.within(d)))
        p2p = self.links.p2p
        longest: list[float] = []
        busy = list(cycles)
        for j in range(len(plan)):
            into = [0.0] if j == 0 else [longest[j - 1]]
            for i in range(j):
                if flows[i, j] > 0 and p2p is not None:
                    hop = 2 * (p2p.latency + flows[i, j] * b / p2p.bandwidth)
                    into.append(longest[i] + hop)
                    busy[j] += exposed * hop
            longest.append(cycles[j] + max(into))
        return (self.m - 1) * max(busy) + longest[-1] + max(allreduces)

    def transfers_matter(self, plan: tuple[tuple[int, int], ...]) -> bool:
        """Whether transfers on every cycle change the plan's estimate by over 5 % (when they do for
        some plan, the DP runs again with them exposed, as the GPP partitioner does)."""
        return self.estimate(plan, 1.0) > 1.05 * self.estimate(plan)

    def _run(self, tps: np.ndarray, t: float) -> list[np.ndarray] | None:
        """W(·, s) for every level s (list index s), or None when no plan has bottleneck ≤ t."""
        lat, top = self.lat, self.levels - 1
        # Breakpoints of need(p, ·): where the running maximum of smax over the TPS-feasible
        # degrees rises, degree by degree.
        idx: list[np.ndarray] = []
        deg: list[np.ndarray] = []
        val: list[np.ndarray] = []
        reach = np.full(lat.pairs, -1, dtype=np.int16)
        for k in range(len(self.rows)):
            now = np.where(tps[k] <= t, self.smax[k], reach)
            rise = np.flatnonzero(now > reach)
            idx.append(rise)
            deg.append(np.full(len(rise), k, dtype=np.int16))
            val.append(now[rise])
            reach = np.maximum(reach, now)
        at = np.concatenate(val)
        order = np.argsort(-at.astype(np.int16), kind="stable")
        pairs, degree, at = np.concatenate(idx)[order], np.concatenate(deg)[order], at[order]
        bounds = np.searchsorted(-at.astype(np.int16), np.arange(-top, 1), side="right")
        need = np.full(lat.pairs, _INF, dtype=np.int32)
        nxt = np.full(lat.n, _INF, dtype=np.int32)
        nxt[0] = 0  # `levels` stages after: no devices left, only the empty ideal
        out = [nxt]
        done = 0
        for level in range(top, -1, -1):
            upto = bounds[top - level]
            need[pairs[done:upto]] = self.codes[degree[done:upto]]
            done = upto
            cur = np.full(lat.n, _INF, dtype=np.int32)
            cur[0] = 0
            if level == 0:
                first, last = lat.n - 1, lat.n  # only the whole model has no stage after it
            else:
                # An ideal run on at most num − level devices has at most t · (num − level) work.
                light = np.flatnonzero(self.ideal_work <= t * (self.num - level) * (1 + 1e-9))
                first, last = 1, int(light[-1]) + 1 if len(light) else 1
            if last > first:
                a, z = lat.group[first], lat.group[last]
                value = need[a:z] + np.take(nxt, lat.lo[a:z])
                cur[first:last] = np.minimum.reduceat(value, lat.group[first:last] - a)
                cur[cur > (self.num - level + 1) * _STAGE - 1] = _INF  # more devices than are left
            out.append(cur)
            nxt = cur
        out.reverse()
        return out if out[0][lat.n - 1] < _INF else None

    def _plan(self, tps: np.ndarray, t: float, levels: list[np.ndarray]) -> tuple[tuple[int, int], ...]:
        """The stages of W(whole model, 0) as (pair, degree index), in stage order."""
        lat = self.lat
        plan: list[tuple[int, int]] = []
        ideal, level = lat.n - 1, 0
        while ideal:
            a, z = int(lat.group[ideal]), int(lat.group[ideal + 1])
            ok = (tps[:, a:z] <= t) & (self.smax[:, a:z] >= level)
            first = ok.argmax(axis=0)  # the smallest feasible degree
            value = np.where(ok.any(axis=0), self.codes[first], _INF) + levels[level + 1][lat.lo[a:z]]
            j = int(np.argmin(value))
            plan.append((a + j, int(first[j])))
            ideal, level = int(lat.lo[a + j]), level + 1
        plan.reverse()
        return tuple(plan)

    def stages(self, plan: tuple[tuple[int, int], ...]) -> list[tuple[list[int], int, bool]]:
        """A plan's stages as (units in depth-first order, devices, recompute)."""
        lat = self.lat
        out = []
        for p, k in plan:
            diff = lat.masks[int(lat.hi[p])] & ~lat.masks[int(lat.lo[p])]
            units = [u for u in range(lat.tree.num_units) if diff >> u & 1]
            out.append((units, *self.rows[k]))
        return out


def _to_pipeline(
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
        plan = span if plan is None else ("+", span, plan)
        end -= len(units)
    assert plan is not None
    return materialize(
        graph, cluster, reordered, costs.reordered(reordered, order), opts, "spp", b, plan, num, limit, slack
    )
