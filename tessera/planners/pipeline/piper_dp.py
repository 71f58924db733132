"""Piper's dynamic program over the ideals (downward-closed unit sets) of a coarsened unit DAG:
the lattice of ideals with their costs, and the DP that splits it into stages with data parallelism.

References: Tarnawski et al., "Piper: Multidimensional Planner for DNN Parallelization" (NeurIPS 2021)."""

from __future__ import annotations

import math

import numpy as np

from tessera.core.cost import CostModel, allreduce_time, per_device_samples
from tessera.core.graph import Graph
from tessera.core.specs import Link
from tessera.planners.pipeline.dp import RECOMPUTE_VARIANTS
from tessera.planners.pipeline.links import StageLinks
from tessera.planners.pipeline.memory import sharded_optimizer
from tessera.planners.pipeline.sp import SPNode, SPTree
from tessera.planners.pipeline.types import PartitionOptions
from tessera.planners.pipeline.unit_costs import UnitCosts

_LADDER = (1.25, 1.6, 2.5)  # looser bounds probed after the bisection (shallower plans)


_STAGE = 1 << 10  # W's encoding: devices · _STAGE + stages (stages ≤ devices < _STAGE)


_INF = 1 << 28  # int32: two of them still add without overflow


_BIG = 1 << 30


class Lattice:
    """The ideals of the unit DAG, their pairs ``I' ⊊ I``, and per-ideal sums of unit costs.

    Ideals are sorted by their cost (the units' coarsening weights), then size: every proper
    sub-ideal of an ideal comes before it, and the ideals light enough for a level of the DP form
    a short prefix. Pairs are grouped by ``I`` in that order: ideal ``i``'s sub-ideals are pairs
    ``group[i] .. group[i + 1] − 1``.
    """

    def __init__(self, graph: Graph, tree: SPTree, cost: CostModel) -> None:
        self.tree = tree
        self.costs = UnitCosts(graph, tree, cost)
        raw = ideals_of(tree.root)
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


def ideals_of(node: SPNode) -> list[int]:
    """Every ideal of ``node``'s units as a bit mask over the unit numbers."""
    if node.kind == "leaf":
        return [0, 1 << node.lo]
    if node.kind == "series":
        out = [0]
        done = 0
        for c in node.children:
            out.extend(done | x for x in ideals_of(c) if x)
            done |= ((1 << c.hi) - 1) ^ ((1 << c.lo) - 1)
        return out
    out = [0]
    for c in node.children:
        sub = ideals_of(c)
        out = [a | x for a in out for x in sub]
    return out


def lattice_lower_bound(lattice: Lattice, mini_batch: int, b: int, num: int) -> float:
    """A lower bound on the 1F1B iteration estimate at micro-batch ``b``: ``m − 1`` cycles of the
    larger of a balanced share of the work and the heaviest unit at its most data parallel, plus
    one micro-batch through every unit in sequence at that pace (roofline time is sub-linear in
    the samples, so no stage is faster)."""
    fastest = lattice.unit_work(per_device_samples(b, min(b, num)))
    cycle = max(float(lattice.unit_work(b).sum()) / num, float(fastest.max()))
    return (mini_batch // b - 1) * cycle + float(fastest.sum())


def allreduce_times(nbytes: np.ndarray, devices: int, link: Link | None) -> np.ndarray:
    """Ring all-reduce (:func:`tessera.core.cost.allreduce_time`), over an array of sizes."""
    if devices <= 1 or link is None:
        return np.zeros_like(nbytes)
    p = devices
    t = 2 * (p - 1) / p * nbytes / link.bandwidth + 2 * (p - 1) * link.latency
    return np.where(nbytes > 0, t, 0.0)


class IdealDP:
    """The DP of the module docstring for one micro-batch size ``b``.

    Per data-parallel degree ``k`` and pair ``p = (I', I)``: the stage's TPS, and ``smax[k, p]``,
    the most stages that may follow it before its in-flight micro-batches exceed the memory limit.
    For a bound ``t``, ``need(p, s)`` is the smallest degree with TPS ≤ ``t`` and ``smax ≥ s``.
    Going down the levels ``s`` it only gets smaller, at the *breakpoints* where the running
    maximum of ``smax`` over a pair's TPS-feasible degrees reaches ``s``: each probe sorts the
    breakpoints once and updates ``need`` level by level.
    """

    def __init__(
        self, lattice: Lattice, links: StageLinks, opts: PartitionOptions, b: int, limit: float, num: int
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
        for k, (d, recompute) in enumerate(self.rows):
            # ZeRO-1 where the search may shard (materialize decides which stages need it).
            static = lattice.weights + sharded_optimizer(
                lattice.optimizer, lattice.optimizer - lattice.grads, d, int(opts.zero != 0)
            )
            s = per_device_samples(b, d)
            fw, bw = lattice.times(s)
            compute = fw + bw + (fw if recompute else 0.0)
            self.tps[k] = compute / b + allreduce_times(lattice.grads, d, links.within(d)) / self.B
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
