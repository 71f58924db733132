"""GraphPipe's stage partitioner: binary search on the bottleneck time per sample over the
series-parallel DP, per micro-batch size, then materialization, simulation and tuning of the best
candidates. The narrative is in docs/gpp.md.

References: GraphPipe thesis §3.5, Algorithm 2; GraphPipe paper §5."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Literal

from tessera.core.cost import CostModel, per_device_samples
from tessera.core.errors import InfeasibleError, InputError
from tessera.core.graph import Graph
from tessera.core.specs import ClusterSpec, DeviceType
from tessera.core.units import format_bytes
from tessera.planners.pipeline.dp import Entry, StageDP, stages_of
from tessera.planners.pipeline.links import StageLinks
from tessera.planners.pipeline.materialize import estimate_iteration, materialize, scheduled, uniform_warm_up
from tessera.planners.pipeline.sp import SPNode, SPTree, decompose
from tessera.planners.pipeline.tuning import WARM_UP_SLACKS, fastest_rescheduled, fastest_tuned
from tessera.planners.pipeline.types import PartitionOptions, Pipeline, RecomputeChoice, peak_memory
from tessera.planners.pipeline.unit_costs import UnitCosts
from tessera.planners.sim import simulate_pipeline

_PER_MICRO_BATCH = 8  # distinct plans per micro-batch size and transfer model, materialized and simulated


# Bottleneck bounds probed beyond the bisection's minimum, as multiples of it.
_LOOSER = (1.25, 1.6, 2.5)


# Transfers hidden by the warm-up (0) or on every stage's cycle (1): two DP runs per micro-batch
# size, whose plans differ where cuts through large tensors matter; the simulator decides.
_EXPOSED = (0.0, 1.0)


# The SPP baseline's chain has every unit of the model (70–80 here): it tries the 4 longest
# feasible first stages per data-parallel degree, not every split point (search time).
_SPP_WINDOW = 4


# An infeasible memory limit's message: the least memory a plan needs, to 3 %, in at most 6 plans.
_NEED_PROBES = 6


_NEED_PRECISION = 0.03


_AUTO_MODES: tuple[RecomputeChoice, ...] = ("never", "auto", "all")  # fastest_mode's order


def micro_batch_candidates(opts: PartitionOptions) -> list[int]:
    if opts.micro_batch_sizes:
        return sorted(b for b in opts.micro_batch_sizes if b > 0 and opts.mini_batch % b == 0)
    out = []
    b = 1
    while b <= opts.mini_batch:
        if opts.mini_batch % b == 0 and opts.mini_batch // b <= opts.max_micro_batches:
            out.append(b)
        b *= 2
    return out


def no_micro_batch(opts: PartitionOptions) -> str:
    """Why :func:`micro_batch_candidates` is empty, and a mini-batch size that has candidates."""
    if opts.micro_batch_sizes:
        return f"none of the micro-batch sizes {list(opts.micro_batch_sizes)} divides the mini-batch {opts.mini_batch}"
    b = 1
    while b * opts.max_micro_batches < opts.mini_batch:
        b *= 2
    near = -(-opts.mini_batch // b) * b
    return (
        f"mini-batch {opts.mini_batch}: no micro-batch size fits (a power of two that divides it into "
        f"at most {opts.max_micro_batches} micro-batches); a multiple of {b} has one, e.g. {near}"
    )


def partition(
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    *,
    tree: SPTree | None = None,
    kind: Literal["gpp", "spp"] = "gpp",
    cost: CostModel | None = None,
    explain: bool = True,
    window: int | None = _SPP_WINDOW,
) -> Pipeline:
    """GraphPipe's stage partitioner (thesis §3.5, Algorithm 2); see the module docstring.

    Returns the best :class:`Pipeline` over the micro-batch candidates, with per-stage schedules
    and memory. Raises :class:`InfeasibleError` when no plan fits the memory limit (the message
    names the least per-device memory of the plans it finds, :func:`no_plan_error`, unless
    ``explain`` is false) and :class:`InputError` for bad options. ``window`` (``kind="spp"``
    only): split points tried per stage, :class:`~.dp.StageDP`'s (all of them when that finds
    no plan). ``recompute="auto"`` or ``zero="auto"``: :func:`fastest_mode`.
    """
    if options.recompute != "auto" and options.zero != "auto":
        return _partition(graph, cluster, options, tree, kind, cost, explain, window)
    started = time.perf_counter()

    def search(opts: PartitionOptions) -> Pipeline | None:
        try:
            return _partition(graph, cluster, opts, tree, kind, cost, False, window)
        except InfeasibleError:
            return None

    best = fastest_mode(search, options)
    if best is None:
        num, limit, cost, tree = planning_inputs(graph, cluster, options, tree, cost)
        peak_of = _least_peak(graph, cluster, options, tree, kind, cost) if explain else None
        raise no_plan_error(graph, options, num, limit, kind, peak_of)
    best.search_time_s = time.perf_counter() - started
    return best


def fastest_mode(
    search: Callable[[PartitionOptions], Pipeline | None], options: PartitionOptions
) -> Pipeline | None:
    """The fastest simulated of the plans ``search`` finds in each memory mode ``options`` leave
    open (ties to the first; ``None`` when it finds none). ``recompute="auto"``: recomputing on no
    stage, on the stages the DP chooses, and on every stage. The per-stage DP alone does not
    dominate the other two: it ranks stages by their bottleneck time under 1F1B's in-flight
    counts, so its bisection can settle on a plan that recomputes where a plan keeping its
    activations simulates faster, and a schedule that keeps more micro-batches in flight than
    1F1B (greedy) can leave only plans that recompute everywhere. ``zero="auto"``: without ZeRO,
    then sharding where memory needs it; the looser memory bound changes which candidates the
    search's fronts keep, so the sharding search alone can settle on a slower plan (BERT on 4
    V100s at 0.92 GiB: 3 % slower). One search per mode."""
    recompute = _AUTO_MODES if options.recompute == "auto" else (options.recompute,)
    zero = (0, "auto") if options.zero == "auto" else (options.zero,)
    best: Pipeline | None = None
    best_time = math.inf
    for mode in recompute:
        for shard in zero:
            pipe = search(dataclasses.replace(options, recompute=mode, zero=shard))
            if pipe is None:
                continue
            t = simulate_pipeline(pipe, trace=False).iteration_time
            if t < best_time:
                best, best_time = pipe, t
    return best


def _partition(  # noqa: C901
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    tree: SPTree | None,
    kind: Literal["gpp", "spp"],
    cost: CostModel | None,
    explain: bool,
    window: int | None,
) -> Pipeline:
    """:func:`partition` for one recompute mode (``auto``: the per-stage choice of the DP)."""
    started = time.perf_counter()
    num, limit, cost, tree = planning_inputs(graph, cluster, options, tree, cost)
    costs = UnitCosts(graph, tree, cost)
    _check_stage_count(graph, costs, options)
    links = StageLinks(cluster, num)
    cands = micro_batch_candidates(options)
    if not cands:
        raise InputError(no_micro_batch(options))
    best: Pipeline | None = None  # the fastest plan as simulated: the simulator has the last word
    best_time = math.inf
    best_rank: tuple | None = None
    leader: Pipeline | None = None  # the best plan as estimated (which micro-batch sizes can win)
    hidden: list[tuple[float, Pipeline]] = []  # plans of the hidden-transfer runs, estimated
    timed: list[tuple[tuple, Pipeline]] = []  # every materialized candidate, ranked as simulated
    probes = 0
    # Micro-batch sizes in order of a lower bound on the iteration time; a size whose bound
    # cannot beat the best estimate so far is skipped.
    lower = {b: _lower_bound(costs, options.mini_batch, b, num) for b in cands}
    for b in sorted(cands, key=lambda b: (lower[b], b)):
        if leader is not None and lower[b] >= leader.estimated_iteration_time:
            continue
        if not _may_fit(costs, b, num, limit):
            continue
        m = options.mini_batch // b
        for exposed in _EXPOSED:
            if exposed and not _transfers_matter(hidden, b, m, leader):
                continue
            dp = StageDP(
                tree,
                costs,
                links,
                options,
                b,
                limit,
                num,
                chain=kind == "spp",
                exposed=exposed,
                window=window if kind == "spp" else None,
            )
            # The exposed-transfer run only proposes alternatives: a coarser bisection will do.
            # With transfers hidden, a plan whose bottleneck TPS exceeds cap cannot beat the best
            # simulated plan: its busiest device alone is loaded B · TPS. With transfers exposed,
            # such a plan is as slow where they are exposed, and where the simulator hides them it
            # is a plan of the hidden-transfer run (up to the fronts' truncation: a looser cap here
            # found MMT at 8 devices a 7 % faster plan, but cost CANDLE-Uno at 16 3 % through the
            # search's other heuristics, and doubled MMT's search time at 32).
            cap = best_time / options.mini_batch
            entries, n_probes = _binary_search(dp, num, options.epsilon * (3 if exposed else 1), cap)
            probes += n_probes
            if not entries:
                # Exposing transfers only raises stage TPS (same memory, same bracket: the whole
                # model as one stage receives nothing), so its DP finds nothing either.
                break
            # 1F1B: (m − 1) micro-batches at the bottleneck stage's pace, plus one through the
            # longest path (its latency: the fill and drain).
            ranked = sorted(entries, key=lambda e: ((m - 1) * e[3] * b + e[0], e[3], e[1]))
            seen: set[tuple] = set()
            for entry in ranked:
                spans = tuple(stages_of(entry[5]))
                if spans in seen:
                    continue
                seen.add(spans)
                first = materialize(graph, cluster, tree, costs, options, kind, b, entry[5], num, limit)
                if first is None:
                    continue  # more warm-up only needs more memory
                for slack in WARM_UP_SLACKS if options.searched_schedule == "1f1b" else (0,):
                    pipe = first if not slack else scheduled(first, uniform_warm_up(first, slack))
                    if pipe is None:
                        break
                    if not exposed:
                        hidden.append((pipe.estimated_iteration_time, pipe))
                    if leader is None or pipe.estimated_iteration_time < leader.estimated_iteration_time:
                        leader = pipe
                    # Every candidate is simulated (about a millisecond): transfers, all-reduce and
                    # fill/drain interact in ways a closed form only approximates.
                    # Ties (equal times to the last bit: one micro-batch runs the stages in turn)
                    # go to the better balanced plan, then the better estimate.
                    rank = (
                        simulate_pipeline(pipe, trace=False).iteration_time,
                        pipe.bottleneck_tps,
                        pipe.estimated_iteration_time,
                        slack,
                        spans,
                    )
                    timed.append((rank, pipe))
                    if best_rank is None or rank < best_rank:
                        best, best_rank = pipe, rank
                        best_time = rank[0]
                if len(seen) == _PER_MICRO_BATCH:
                    break
    if timed and options.searched_schedule == "1f1b":
        best, best_rank = fastest_tuned(timed)
    if best is not None and best_rank is not None and options.schedule == "auto":
        best = fastest_rescheduled(best, best_rank[0], timed)
    if best is None and kind == "spp" and window is not None:
        # The SPP DP tries a few split points per stage (for time on long chains): under a tight
        # memory limit the longest first stages can leave no plan where shorter ones fit. Every
        # split point is tried before the limit is called infeasible.
        return _partition(graph, cluster, options, tree, kind, cost, explain, None)
    if best is None:
        raise no_plan_error(
            graph,
            options,
            num,
            limit,
            kind,
            _least_peak(graph, cluster, options, tree, kind, cost)
            if explain and math.isfinite(limit)
            else None,
        )
    best.search_time_s = time.perf_counter() - started
    best.probes = probes
    return best


def planning_inputs(
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    tree: SPTree | None = None,
    cost: CostModel | None = None,
) -> tuple[int, float, CostModel, SPTree]:
    """What every pipeline planner starts from: the number of devices (options checked, raising
    :class:`InputError`), the per-device memory limit in bytes, the cost model (default: the
    roofline of the cluster's device type) and the coarsened series-parallel tree."""
    devices = cluster.devices()
    num = options.num_devices or len(devices)
    if num < 1 or num > len(devices):
        raise InputError(f"--devices {num}: the cluster has {len(devices)} device(s)")
    if options.mini_batch < 1:
        raise InputError("the mini-batch size must be positive")
    if options.schedule == "kfkb" and options.k < 1:
        raise InputError("kFkB needs k >= 1")
    if options.schedule == "kfkb" and options.k > options.mini_batch:
        raise InputError(
            f"--k {options.k}: a mini-batch of {options.mini_batch} has at most {options.mini_batch} "
            "micro-batches (k of them or more in a row is GPipe: --schedule gpipe)"
        )
    device_type = planned_device_type(cluster, num)
    limit = float(options.memory_limit if options.memory_limit is not None else device_type.memory)
    if cost is None:
        cost = CostModel.for_device(device_type, options.precision, options.bytes_per_param)
    if tree is None:
        tree = build_tree(graph, cost, options.max_units)
    return num, limit, cost, tree


def planned_device_type(
    cluster: ClusterSpec, num: int | None = None, source: str | None = None
) -> DeviceType:
    """The one device type of the first ``num`` devices (default: all) a pipeline is planned on.

    The cost model and Eq. 3.2's memory limit are per device type, so a mix is an
    :class:`InputError` (naming ``source``, the spec's file, when given) that says how to plan
    on the first devices only.
    """
    devices = cluster.devices()[: num or None]
    types = Counter(d.type_name for d in devices)
    if len(types) > 1:
        mix = ", ".join(f"{name} x{n}" for name, n in types.items())
        raise InputError(
            f"pipeline plans need devices of one type (the cost model and the memory limit are per "
            f"type); the {len(devices)} devices planned on mix {mix}: give --devices to plan on the "
            "first ones only, or a cluster of one device type",
            source=source or f"cluster {cluster.name!r}",
        )
    return devices[0].type


def build_tree(graph: Graph, cost: CostModel, max_units: int) -> SPTree:
    """The coarsened series-parallel tree, operators weighed by their time at 8 samples."""

    def weigh(n: str) -> float:
        op = graph.op(n)
        return cost.forward_time(op, 8) + cost.backward_time(op, 8)

    return decompose(graph, op_cost=weigh, max_units=max_units)


def _gib(n: float | None) -> str:
    """A memory size in messages: GiB to two decimals (limits are near device sizes), smaller
    sizes in the unit that shows them (a tiny model needs KiB, not "0.00 GiB")."""
    if n is None:
        return "?"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else format_bytes(n)


def no_plan_error(
    graph: Graph,
    options: PartitionOptions,
    num: int,
    limit: float,
    kind: str,
    peak_of: Callable[[float], float | None] | None = None,
) -> InfeasibleError:
    """The error of a memory limit no plan fits; with ``peak_of`` (a planner: the largest stage
    peak of its plan under a limit, ``None`` when none fits) it names the least per-device memory
    a plan needs (:func:`least_memory`).

    The search is not monotone in the limit (it optimizes time; its pruning, warm-up and greedy
    schedules depend on the limit): a plan found under a looser limit may need less than this
    one. The message then says under which limit the search finds it."""
    got = least_memory(peak_of, limit) if peak_of is not None else None
    more = ""
    if got is not None:
        need, found = got
        if need > limit:
            more = f"; the smallest plan found needs {_gib(need)} per device"
        else:
            where = "without --memory-limit" if math.isinf(found) else f"under --memory-limit {_gib(found)}"
            more = f"; a plan needing {_gib(need)} per device is found only {where}"
    if options.recompute == "never":
        more += " (--recompute auto recomputes activations where a stage needs the memory)"
    return InfeasibleError(
        f"no {kind.upper()} plan of {graph.num_nodes} operators on {num} device(s) fits "
        f"{_gib(limit)} per device at mini-batch {options.mini_batch}{more}"
    )


def least_memory(peak_of: Callable[[float], float | None], limit: float) -> tuple[float, float] | None:
    """The least per-device memory of the plans ``peak_of`` finds (see :func:`no_plan_error`) and
    the limit it found that plan under (``inf``: none), or ``None`` when it finds none at any
    limit: a bisection on the limit between ``limit`` (no plan fits) and the peak of the plan
    without a limit, each probe that finds a plan lowering the bracket to that plan's peak — at
    most :data:`_NEED_PROBES` probes, to within :data:`_NEED_PRECISION` of the least the planner
    finds (it optimizes time: a limit is known to fit only where it finds a plan, and what it
    returns is such a plan's peak)."""
    hi = peak_of(math.inf)
    if hi is None:
        return None
    found = math.inf
    lo = limit
    for _ in range(_NEED_PROBES):
        if hi <= lo * (1 + _NEED_PRECISION):
            break
        mid = math.sqrt(lo * hi)
        got = peak_of(mid)
        if got is None:
            lo = mid
        else:
            hi, found = got, mid
    return hi, found


def _least_peak(
    graph: Graph, cluster: ClusterSpec, options: PartitionOptions, tree: SPTree, kind: str, cost: CostModel
) -> Callable[[float], float | None]:
    """:func:`partition`'s plans as a ``peak_of`` for :func:`no_plan_error`."""

    def peak_of(cap: float) -> float | None:
        # One search per probe, recompute="auto" included (its per-stage DP, not the three).
        probe = dataclasses.replace(options, memory_limit=cap)
        try:
            pipe = _partition(graph, cluster, probe, tree, kind, cost, False, _SPP_WINDOW)  # type: ignore[arg-type]
        except InfeasibleError:
            return None
        return peak_memory(pipe)

    return peak_of


def _transfers_matter(pool: list[tuple[float, Pipeline]], b: int, m: int, best: Pipeline | None) -> bool:
    """Whether a DP run with exposed transfers is worth it at this micro-batch size: its plans
    may win (the hidden-transfer plans are within 10 % of the best so far) and exposing the
    transfers changes their predicted time by over 5 %."""
    mine = [p for _, p in pool if p.micro_batch_size == b]
    if (
        mine
        and best is not None
        and min(p.estimated_iteration_time for p in mine) > 1.1 * (best.estimated_iteration_time)
    ):
        return False
    return not mine or any(
        estimate_iteration(p.stages, p.edges, b, m, 1.0) > 1.05 * estimate_iteration(p.stages, p.edges, b, m)
        for p in mine
    )


def _may_fit(costs: UnitCosts, b: int, num: int, limit: float) -> bool:
    """Whether ``num`` devices of ``limit`` bytes can hold some plan at micro-batch ``b``: every
    stage keeps at least one micro-batch's activations (with recomputation too: the one being
    recomputed), ``ceil(b / d)`` samples on each of its ``d`` replicas, and its parameters on each,
    so over the stages at least the model's parameter state once plus ``b`` samples' activations.
    A size beyond that (MMT at 32 devices: 549 GB for one micro-batch of 512 on 542 GB) is
    skipped without a search that can only fail."""
    n = costs.n
    need = costs.weights[n] + costs.optimizer[n] + b * costs.act[n]
    return need <= num * limit


def _lower_bound(costs: UnitCosts, mini_batch: int, b: int, num: int) -> float:
    """A lower bound on the 1F1B iteration time (:func:`estimate_iteration`) at micro-batch ``b``.

    Every unit runs at best at its most data-parallel pace (``b / min(b, num)`` samples per
    device). A stage's cycle is at least the heaviest unit in it, and at least the micro-batch's
    total work over the devices (a stage on ``d`` devices takes at least ``1/d`` of its work at
    ``b`` samples: roofline time is sub-linear in the samples); one micro-batch must also cross
    the model's critical path (series parts add up, parallel branches take the longest). So::

        (m − 1) · max(W(b) / num, heaviest) + critical_path  and  m · max(W(b) / num, heaviest)
    """
    m = mini_batch // b
    fw, bw = costs.times(b)
    balanced = (fw[-1] + bw[-1]) / num
    fw, bw = costs.times(per_device_samples(b, min(b, num)))
    unit = [fw[u + 1] - fw[u] + bw[u + 1] - bw[u] for u in range(costs.n)]
    cycle = max(balanced, max(unit))
    return max(m * cycle, (m - 1) * cycle + _critical_path(costs.tree.root, unit))


def _critical_path(node: SPNode, unit: list[float]) -> float:
    if node.kind == "leaf":
        return sum(unit[node.lo : node.hi])
    paths = [_critical_path(c, unit) for c in node.children]
    return sum(paths) if node.kind == "series" else max(paths)


def _check_stage_count(graph: Graph, costs: UnitCosts, options: PartitionOptions) -> None:
    """``--stages N`` needs N units that compute (:meth:`UnitCosts.computes`)."""
    if options.stages is None:
        return
    working = sum(costs.computes(u, u + 1) for u in range(costs.n))
    if working < options.stages:
        raise InputError(
            f"--stages {options.stages}: at most {working} stage(s) of {graph.source} can compute "
            "anything (hold a weight or FLOPs)"
        )


def _binary_search(dp: StageDP, num: int, epsilon: float, cap: float = math.inf) -> tuple[list[Entry], int]:
    """Algorithm 2, lines 2–11: bisection on the bottleneck TPS ``t_max``.

    The bracket is found by galloping up from the perfect-balance bound (tight probes are cheap:
    the work bound prunes most states; loose ones are not), then bisected geometrically to a
    relative precision ``epsilon``. Returns the entries of every feasible probe's front (the caller
    picks by predicted iteration time: a slightly slower bottleneck with a shorter pipeline can
    win) and the number of probes. Bottlenecks above ``cap`` are of no use to the caller: the
    bracket never goes beyond it (no plan at all when none is feasible at ``cap``).
    """
    n = dp.costs.n
    # No stage graph beats perfect balance, nor the heaviest unit at its most data parallel.
    fw, bw = dp.costs.times(per_device_samples(dp.b, min(dp.b, num)))
    heaviest = max(fw[u + 1] - fw[u] + bw[u + 1] - bw[u] for u in range(n)) / dp.b
    lo_t = max(dp.work[n] / num, heaviest) * (1 - 1e-9)
    ceiling = 4 * (dp.stage(0, n, 1)[0] + 1e-12)  # beyond this, memory is what rules plans out
    ceiling = min(ceiling, cap)
    if ceiling < lo_t:
        return [], 0
    probes = 0
    entries: list[Entry] = []
    step = 1.25
    lo_t = max(lo_t, sys.float_info.min)  # a model of free operators: gallop from a positive bound
    hi_t = lo_t
    while True:
        hi_t = min(hi_t * step, ceiling)
        probes += 1
        front = dp.run(hi_t)
        if front:
            entries.extend(front)
            break
        if hi_t >= ceiling:
            return [], probes
        lo_t = hi_t
        step *= step
    # At most ~60 halvings of log(hi/lo) reach epsilon from any finite bracket; the bound only
    # guards against a bracket that cannot shrink (a spec whose times overflow to infinity).
    for _ in range(200):
        if not hi_t / lo_t > 1 + epsilon:
            break
        mid = math.sqrt(lo_t) * math.sqrt(hi_t)  # lo·hi may overflow where the mean does not
        probes += 1
        front = dp.run(mid)
        if front:
            hi_t = mid
            entries.extend(front)
        else:
            lo_t = mid
    # Looser bottlenecks admit shallower plans (fewer stages, more data parallelism) whose shorter
    # fill and drain can win: the minimal bottleneck is where the search starts, not ends.
    for factor in _LOOSER:
        t = hi_t * factor
        if t > ceiling:
            break
        probes += 1
        entries.extend(dp.run(t))
    return entries, probes
