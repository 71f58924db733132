"""GraphPipe's pipeline stage partitioner (thesis §3.5, Algorithm 2; paper-graphpipe §5).

``partition(graph, cluster, options)`` searches model partitions, device assignments and
micro-batch sizes together for the fastest 1F1B iteration under the per-device memory limit
(Eq. 3.2):

- for each micro-batch size (powers of two dividing the mini-batch; one size per plan, so
  Table 3.2 reduces to one micro-batch per stage), in order of a lower bound on the iteration
  time, skipping sizes that cannot win;
- binary search on the bottleneck TPS ``t_max`` (Algorithm 2, lines 2–11; galloping up from the
  perfect-balance bound, then geometric bisection to relative precision ``epsilon``), then a few
  looser bounds (``_LOOSER``: shallower plans with more data parallelism, shorter fill and drain);
- for each ``t_max``, the memoized series-parallel DP of :mod:`.dp` (lines 21–45): every series
  split point, every device distribution between branches, branch groups as one stage or
  pipelined in series, tiny merges joined to a neighbour's stage; its value is a Pareto front of
  (fill/drain latency, depth, memory slack);
- every feasible probe's front is ranked by the predicted iteration time ``(m − 1)`` bottleneck
  cycles plus the latency of the longest path; the best few are materialized, and the simulator
  (:mod:`tessera.planners.sim`) times every one of them and picks. The DP runs twice per size: with
  transfers hidden by the warm-up and with transfers on every stage's cycle (cuts through large
  tensors cost latency that 1F1B's minimal warm-up does not hide);
- 1F1B warm-up: every candidate is timed with Table 3.2's minimal in-flight counts and with 1 or 2
  more micro-batches on every stage with successors; the fastest few stage graphs then get their
  warm-up tuned on the simulator, first on all those stages together, then stage by stage
  (:func:`tune_warm_up`: a stage runs ahead as far as it helps, within memory — Algorithm 4's
  idea at the grain of the warm-up count);
- ``schedule="auto"``: that search, then its candidates, best first, rescheduled by Algorithm 4
  itself within a budget (:func:`fastest_rescheduled`); the fastest plan wins, 1F1B or greedy —
  stages of unequal load side by side, as in a graph pipeline, gain from passes 1F1B's fixed
  pattern cannot order, and the stage graph that gains most is not always 1F1B's winner;
- stage graph edges come from the operator graph (C2), devices are assigned per stage (data
  parallel groups aligned within a node, C3), schedules are generated per stage (C4: 1F1B, kFkB,
  GPipe, or Algorithm 4's greedy scheduler, :mod:`.greedy`) with in-flight counts recomputed
  exactly from the final stage graph (Table 3.2, reverse topological order, C5), and the memory
  of every stage is re-checked against the limit with those counts;
- activation recomputation (``recompute``): on no stage, on every stage, or ``auto`` — chosen per
  stage by the DP, where keeping the stage's activations does not fit memory (or leaves room for
  fewer stages after it), and that plan compared on the simulator with the plans of the other two
  (:func:`fastest_recompute_mode`); a recomputing stage keeps only its inputs per micro-batch in
  flight and runs its forward again in its backward.

A plan may leave devices idle: a stage gets devices only where they make it faster (one sample per
replica at least, all-reduce included).

Sequential pipelines (SPP, :mod:`tessera.planners.spp`) run the same search on the linearized
tree — PipeDream's problem (contiguous stages with replication) — and run their stages in order:
stage ``i + 1`` depends on stage ``i`` (ordering edges), as a sequential pipeline does.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import networkx as nx
import numpy as np

from tessera.core.cost import CostModel, allreduce_time, per_device_samples
from tessera.core.errors import InfeasibleError, InputError
from tessera.core.graph import Graph
from tessera.core.schedule import ScheduleChoice, ScheduleKind, gpipe, in_flight_of, k_f_k_b, one_f_one_b
from tessera.core.specs import ClusterSpec, Device, DeviceType, Link
from tessera.core.units import format_bytes
from tessera.planners.gpp.dp import Entry, StageDP, stages_of
from tessera.planners.gpp.greedy import greedy_schedules
from tessera.planners.gpp.memory import StageMemoryEstimate, stage_memory
from tessera.planners.gpp.schedule import compute_in_flight
from tessera.planners.gpp.sp import SPNode, SPTree, decompose
from tessera.planners.sim import SimStage, sim_edge, simulate_pipeline

_PER_MICRO_BATCH = 8  # distinct plans per micro-batch size and transfer model, materialized and simulated
# 1F1B warm-up slack tried per candidate (:func:`materialize`): Table 3.2's minimum, and one or two more
# micro-batches in flight on every stage with successors (hides transfers; costs memory).
WARM_UP_SLACKS = (0, 1, 2)
# Warm-up tuning (:func:`fastest_tuned`): the joint step of :func:`tune_warm_up` (a few simulations)
# on this many of the fastest candidates (distinct stage graph and micro-batch size), …
_JOINT_TUNED = 8
# … then its stage-by-stage steps on the fastest few of those (distinct stage graphs).
_TUNED = 3
# Extra warm-up :func:`tune_warm_up` tries on all stages with successors at once (below the number
# of micro-batches, then all of them), before it tunes stage by stage.
_JOINT_EXTRAS = (3, 4, 6, 8, 12, 16, 24, 32)
# Simulated passes (forwards and backwards of all stages) one warm-up tuning may spend: about 0.1 s
# of simulation (1.4 M passes/s untraced on this machine); stages nearest the sinks are tuned first.
_TUNE_TASKS = 150_000
# Algorithm 4's budget under ``--schedule auto``, for all the candidates it reschedules together:
# one costs about 4·m²·S² simulated passes for m micro-batches and S stages (2m trial simulations
# per stage, each of up to 2m·S passes); spending all of it takes 0.2–0.25 s on this machine. Three
# times the budget (and twice the tuned candidates) changed no plan of bench/gpp.py's models.
_GREEDY_TASKS = 1_500_000
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

# Activation recomputation: on no stage, on every stage, or (``auto``) on the stages the search
# finds it pays on — where keeping the activations does not fit memory (:class:`~.dp.StageDP`).
RecomputeChoice = Literal["never", "auto", "all"]
_AUTO_MODES: tuple[RecomputeChoice, ...] = ("never", "auto", "all")  # fastest_recompute_mode's order


@dataclass(frozen=True)
class PartitionOptions:
    mini_batch: int
    num_devices: int | None = None  # default: every device of the cluster
    memory_limit: float | None = None  # bytes per device; default: the device's memory
    schedule: ScheduleChoice = "1f1b"
    k: int = 1  # kFkB's k
    micro_batch_sizes: tuple[int, ...] | None = None  # default: powers of two dividing mini_batch
    max_micro_batches: int = 256
    recompute: RecomputeChoice = "never"
    max_units: int = 128
    epsilon: float = 0.01
    precision: Literal["mixed", "fp32"] = "mixed"
    bytes_per_param: float | None = None

    @property
    def searched_schedule(self) -> ScheduleKind:
        """The schedule the search materializes its candidates with (``auto`` searches as 1F1B)."""
        return "1f1b" if self.schedule == "auto" else self.schedule


@dataclass
class PipelineStage:
    id: int
    nodes: list[str]
    devices: list[str]
    micro_batch_size: int
    in_flight: int  # micro-batches
    forward_time: float  # per micro-batch (one replica's share)
    backward_time: float
    allreduce_time: float  # per iteration
    weights: float
    optimizer: float
    activation_per_sample: float
    input_per_sample: float
    schedule: list[str] = field(default_factory=list)
    memory: StageMemoryEstimate | None = None
    units: tuple[int, int] = (0, 0)
    # The network interfaces the stage's gradient all-reduce crosses (:func:`ring_nics`); none
    # inside a node or when the cluster names no shared interfaces.
    allreduce_nics: tuple[str, ...] = ()
    # Activation recomputation: the stage keeps only its inputs per micro-batch in flight and runs
    # its forward again in the backward (counted in ``backward_time``).
    recompute: bool = False

    @property
    def time_per_sample(self) -> float:
        return (self.forward_time + self.backward_time) / self.micro_batch_size


@dataclass
class PipelineEdge:
    src: int
    dst: int
    tensors: list[tuple[str, float]]  # (name, wire bytes per sample)
    bytes_per_sample: float
    link: Link | None = None
    # Network interfaces (named by node or by device) the activations leave / enter through (none:
    # inside a node, or no shared interfaces), and the largest share of a micro-batch's bytes
    # through one of them (:func:`nic_route`).
    src_nics: tuple[str, ...] = ()
    dst_nics: tuple[str, ...] = ()
    nic_share: float = 1.0


@dataclass
class Pipeline:
    """A partitioned, scheduled pipeline: what the plan JSON is written from."""

    kind: Literal["gpp", "spp"]
    mini_batch_size: int
    micro_batch_size: int
    schedule_kind: ScheduleKind
    k: int
    stages: list[PipelineStage]
    edges: list[PipelineEdge]
    bottleneck_tps: float
    estimated_iteration_time: float
    search_time_s: float
    num_units: int
    memory_limit: float
    probes: int = 0

    @property
    def pipeline_depth(self) -> int:
        g = nx.DiGraph()
        g.add_nodes_from(s.id for s in self.stages)
        g.add_edges_from((e.src, e.dst) for e in self.edges)
        return nx.dag_longest_path_length(g) + 1

    @property
    def num_micro_batches(self) -> int:
        return self.mini_batch_size // self.micro_batch_size


class UnitCosts:
    """Per-unit costs with prefix sums, so any unit range [lo, hi) is costed in O(1)."""

    def __init__(
        self, graph: Graph, tree: SPTree, cost: CostModel, _per_unit: _PerUnit | None = None
    ) -> None:
        self.graph, self.tree, self.cost = graph, tree, cost
        n = tree.num_units
        self.n = n
        per = _per_unit if _per_unit is not None else _PerUnit.of(graph, tree.units, cost)
        self._per = per
        self.weights = _prefix(per.weights)
        self.optimizer = _prefix(per.optimizer)
        self.grads = _prefix(per.grads)
        self.act = _prefix(per.act)
        # The activations crossing units (one walk over the DAG's edges: the flows, the bytes
        # entering unit ranges and Piper's cuts all derive from it).
        self.tensors = unit_tensors(graph, tree, cost)
        # Wire bytes per sample between units u < v (depth-first order is topological).
        flow = unit_flow(self.tensors, n)
        pair = np.zeros((n + 1, n + 1))
        pair[:n, :n] = np.triu(flow + flow.T)
        self._pair = pair
        self._enter = unit_entering(self.tensors, n)
        self._unit_keys = per.keys
        self._times: dict[int, tuple[list[float], list[float]]] = {}

    def reordered(self, tree: SPTree, order: list[int]) -> UnitCosts:
        """The costs of ``tree``: these units in the order ``order`` (unit ``i`` of ``tree`` is
        unit ``order[i]`` here); per-unit costs are reused, not recomputed."""
        return UnitCosts(self.graph, tree, self.cost, self._per.permuted(order))

    def times(self, samples: int) -> tuple[list[float], list[float]]:
        """Prefix sums of forward and backward time per unit at ``samples`` samples."""
        got = self._times.get(samples)
        if got is None:
            fw, bw = self._per.times(self.graph, self.cost, samples)
            got = (_prefix(fw), _prefix(bw))
            self._times[samples] = got
        return got

    def block_key(self, lo: int, hi: int) -> tuple:
        """Identity of the costs of units [lo, hi): equal keys give equal stage costs for every
        sub-range at the same offset (unit costs, internal edges, bytes entering from before)."""
        inner = self._pair[lo:hi, lo:hi]
        entering = self._enter[lo : hi + 1, lo : hi + 1]
        return (tuple(self._unit_keys[lo:hi]), inner.tobytes(), entering.tobytes())

    def enter(self, lo: int, hi: int) -> float:
        """Wire bytes per sample entering units [lo, hi) from earlier units (each tensor once)."""
        return float(self._enter[lo, hi])


def unit_tensors(graph: Graph, tree: SPTree, cost: CostModel) -> list[tuple[int, tuple[int, ...], float]]:
    """Every activation that crosses units: ``(the unit that makes it, the later units that read
    it, its wire bytes per sample)``, in a fixed order (weights' producers excluded)."""
    readers: dict[tuple[str, int], tuple[float, set[int]]] = {}
    for u_name, v_name, data in graph.dag.edges(data=True):
        u, v = tree.unit_of[u_name], tree.unit_of[v_name]
        if u == v or u_name in graph.constant_nodes:
            continue
        for t in data["tensors"]:
            readers.setdefault((t.name, u), (cost.wire_bytes(t.nbytes), set()))[1].add(v)
    return [(p, tuple(sorted(units)), w) for (_, p), (w, units) in sorted(readers.items())]


def unit_flow(tensors: list[tuple[int, tuple[int, ...], float]], n: int) -> np.ndarray:
    """Wire bytes per sample from unit u to unit v of ``n`` (:func:`unit_tensors`), each tensor
    counted once per reading unit."""
    flow = np.zeros((n, n))
    for p, readers, w in tensors:
        for v in readers:
            flow[p, v] += w
    return flow


def unit_entering(tensors: list[tuple[int, tuple[int, ...], float]], n: int) -> np.ndarray:
    """``E[lo, hi]``: wire bytes per sample of the tensors made before unit ``lo`` that units
    [lo, hi) read, each tensor once however many of those units read it (a stage receives a
    tensor once: MMT's residual stream feeds a layer's norm and its residual add).

    A tensor made in unit ``p`` and read by units ``c_1 < … < c_k`` enters [lo, hi) when
    ``p < lo`` and its first reader at or after ``lo`` is before ``hi``; for ``lo`` in
    ``(c_{i-1}, c_i]`` (``c_0 = p``) that reader is ``c_i``. So the tensor adds its bytes to
    column ``c_i + 1`` of rows ``c_{i-1} + 1 … c_i`` (a difference array down the rows), and a
    running sum along each row counts it for every ``hi > c_i``. Exact in floating point for
    the whole-byte sizes of real models."""
    diff = np.zeros((n + 2, n + 2))
    for p, units, w in tensors:
        prev = p
        for c in (x for x in units if x > p):
            diff[prev + 1, c + 1] += w
            diff[c + 1, c + 1] -= w
            prev = c
    first = np.cumsum(diff, axis=0)  # first[lo, c + 1]: bytes whose first reader from lo is c
    return np.cumsum(first, axis=1)[: n + 1, : n + 1]


@dataclass(frozen=True, eq=False)
class _PerUnit:
    """What each unit costs, in the units' order: weight, optimizer and gradient bytes, stored
    activation bytes per sample, an operator-cost identity (equal keys give equal times at every
    sample count: the roofline's inputs, and the model's own times, since measured costs differ
    by operator type), and forward/backward times per sample count (filled as asked for)."""

    ops: list[list[str]]  # each unit's operators that store activations (not constants)
    weights: np.ndarray
    optimizer: np.ndarray
    grads: np.ndarray
    act: np.ndarray
    keys: list[int]
    _times: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @classmethod
    def of(cls, graph: Graph, units: list[list[str]], cost: CostModel) -> _PerUnit:
        activation_ops = [[o for o in u if o not in graph.constant_nodes] for u in units]
        interned: dict[tuple, int] = {}
        keys = [
            interned.setdefault(
                tuple(
                    sorted(
                        (
                            o.op_type,
                            o.flops,
                            o.bytes_moved,
                            o.param_bytes,
                            o.params,
                            cost.activation_bytes(graph, o.name),
                            cost.forward_time(o, 1),
                            cost.backward_time(o, 1),
                        )
                        for o in (graph.op(n) for n in u)
                    )
                ),
                len(interned),
            )
            for u in units
        ]
        memory = np.array([cost.memory_of(graph, u) for u in units]).reshape(len(units), 3)
        return cls(
            ops=activation_ops,
            weights=memory[:, 0],
            optimizer=memory[:, 1],
            grads=np.array([sum(cost.gradient_bytes(graph.op(o)) for o in u) for u in units]),
            act=memory[:, 2],
            keys=keys,
        )

    def permuted(self, order: list[int]) -> _PerUnit:
        """The same units in the order ``order`` (times already computed come along)."""
        idx = np.array(order, dtype=np.int64)
        return _PerUnit(
            ops=[self.ops[u] for u in order],
            weights=self.weights[idx],
            optimizer=self.optimizer[idx],
            grads=self.grads[idx],
            act=self.act[idx],
            keys=[self.keys[u] for u in order],
            _times={s: (fw[idx], bw[idx]) for s, (fw, bw) in self._times.items()},
        )

    def times(self, graph: Graph, cost: CostModel, samples: int) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward time of each unit at ``samples`` samples."""
        got = self._times.get(samples)
        if got is None:
            fw = np.array([sum(cost.forward_time(graph.op(o), samples) for o in u) for u in self.ops])
            bw = np.array([sum(cost.backward_time(graph.op(o), samples) for o in u) for u in self.ops])
            got = self._times[samples] = (fw, bw)
        return got


def _prefix(values: np.ndarray) -> list[float]:
    out = np.zeros(len(values) + 1)
    out[1:] = np.cumsum(values)
    return out.tolist()


class StageLinks:
    """The links the partitioner assumes: inside a node when the devices fit one, else between.

    A data-parallel stage too big for one node is assumed spread evenly over the fewest nodes
    that hold it (``_assign_ranks`` places power-of-two groups so), for its ring's lanes
    (:func:`ring_link`)."""

    def __init__(self, cluster: ClusterSpec, num_devices: int) -> None:
        devices = cluster.devices()[:num_devices]
        per_node = sum(1 for d in cluster.devices() if d.node_index == devices[0].node_index)
        self.per_node = per_node
        intra = cluster.links.intra_node
        inter = cluster.links.inter_node
        self.intra = intra or inter
        self.inter = inter or intra
        self.p2p = self.intra if num_devices <= per_node else self.inter
        self.lanes_per_device = cluster.links.nics == "per-device"

    def within(self, d: int) -> Link | None:
        """The link a ring all-reduce over ``d`` devices runs at."""
        if d <= self.per_node:
            return self.intra
        lanes = d // -(-d // self.per_node) if self.lanes_per_device else 1
        return _ring_between_nodes(self.intra, self.inter, lanes)


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
    no plan). ``recompute="auto"``: :func:`fastest_recompute_mode`.
    """
    if options.recompute != "auto":
        return _partition(graph, cluster, options, tree, kind, cost, explain, window)
    started = time.perf_counter()

    def search(opts: PartitionOptions) -> Pipeline | None:
        try:
            return _partition(graph, cluster, opts, tree, kind, cost, False, window)
        except InfeasibleError:
            return None

    best = fastest_recompute_mode(search, options)
    if best is None:
        num, limit, cost, tree = planning_inputs(graph, cluster, options, tree, cost)
        peak_of = _least_peak(graph, cluster, options, tree, kind, cost) if explain else None
        raise no_plan_error(graph, options, num, limit, kind, peak_of)
    best.search_time_s = time.perf_counter() - started
    return best


def fastest_recompute_mode(
    search: Callable[[PartitionOptions], Pipeline | None], options: PartitionOptions
) -> Pipeline | None:
    """``recompute="auto"``: the fastest simulated of the plans ``search`` finds recomputing on no
    stage, on the stages the DP chooses, and on every stage (ties in that order; ``None`` when it
    finds none). The per-stage DP alone does not dominate the other two: it ranks stages by
    their bottleneck time under 1F1B's in-flight counts, so its bisection can settle on a plan
    that recomputes where a plan keeping its activations simulates faster, and a schedule that
    keeps more micro-batches in flight than 1F1B (greedy) can leave only plans that recompute
    everywhere. About three searches' time."""
    best: Pipeline | None = None
    best_time = math.inf
    for mode in _AUTO_MODES:
        pipe = search(dataclasses.replace(options, recompute=mode))
        if pipe is None:
            continue
        t = simulate_pipeline(pipe, trace=False).iteration_time
        if t < best_time:
            best, best_time = pipe, t
    return best


def _partition(
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
                    pipe = first if not slack else scheduled(first, _uniform(first, slack))
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


def peak_memory(pipe: Pipeline) -> float:
    """The largest per-device memory of ``pipe``'s stages."""
    return float(max(s.memory.peak for s in pipe.stages if s.memory))


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
        _estimate_iteration(p.stages, p.edges, b, m, 1.0)
        > 1.05 * _estimate_iteration(p.stages, p.edges, b, m)
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
    """A lower bound on the 1F1B iteration time (:func:`_estimate_iteration`) at micro-batch ``b``.

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


def materialize(
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
                allreduce_time=allreduce_time(grads, d, link),
                weights=costs.weights[hi] - costs.weights[lo],
                optimizer=costs.optimizer[hi] - costs.optimizer[lo],
                activation_per_sample=costs.act[hi] - costs.act[lo],
                input_per_sample=costs.enter(lo, hi),
                units=(lo, hi),
                allreduce_nics=ring_nics(cluster, group),
                recompute=recompute,
            )
        )
        for u in range(lo, hi):
            unit_stage[u] = sid
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
        estimated_iteration_time=_estimate_iteration(stages, edges, b, m),
        search_time_s=0.0,
        num_units=tree.num_units,
        memory_limit=limit,
    )
    warm_up = _uniform(pipe, slack) if slack and opts.searched_schedule == "1f1b" else {}
    return scheduled(pipe, warm_up)


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
        st.memory = stage_memory(
            weights=st.weights,
            optimizer=st.optimizer,
            activation_per_sample=st.activation_per_sample,
            input_per_sample=st.input_per_sample,
            micro_batch=b,
            devices=len(st.devices),
            in_flight=st.in_flight,
            recompute=st.recompute,
        )
        if st.memory.peak > pipe.memory_limit:
            return None
    return dataclasses.replace(pipe, stages=stages)


def _uniform(pipe: Pipeline, slack: int) -> dict[int, int]:
    return {st.id: slack for st in pipe.stages}


def fastest_tuned(timed: list[tuple[tuple, Pipeline]]) -> tuple[Pipeline, tuple]:
    """The fastest plan after warm-up tuning (:func:`tune_warm_up`), with its rank: the
    :data:`_JOINT_TUNED` fastest candidates of ``timed``, each stage graph and micro-batch size
    once (from its fastest uniform warm-up), get the joint step, which costs a few simulations;
    then the :data:`_TUNED` fastest stage graphs of those get the stage-by-stage steps too.

    ``timed``: ``(rank, pipeline)`` pairs, rank ``(simulated time, bottleneck TPS, estimate,
    warm-up, stage graph key)``; ties go to the better balanced plan, the better estimate, fewer
    micro-batches in flight."""
    joint: list[tuple[tuple, Pipeline]] = []
    seen: set[tuple] = set()
    for rank, pipe in sorted(timed, key=lambda rp: rp[0]):
        # Each stage graph and micro-batch size once: with its warm-up tuned, a stage graph at a
        # larger micro-batch can overtake the smaller one that ranked first untuned (CANDLE-Uno
        # rewritten at 32 devices: 4096 against 2048, 820.3k against 805.7k samples/s).
        if (rank[-1], pipe.micro_batch_size) in seen:
            continue
        seen.add((rank[-1], pipe.micro_batch_size))
        tuned, t = tune_warm_up(pipe, per_stage=False)
        joint.append(((t, rank[1], rank[2], sum(st.in_flight for st in tuned.stages), rank[-1]), tuned))
        if len(seen) == _JOINT_TUNED:
            break
    if not joint:
        raise ValueError("no candidate to tune")
    out: tuple[tuple, Pipeline] | None = None
    graphs: set[tuple] = set()
    for rank, pipe in sorted(joint, key=lambda rp: rp[0]):
        # Each stage graph once here (the slots keyed by micro-batch size too were neutral on the
        # bench, but CANDLE-Uno rewritten at 4 devices lost 1.6 %).
        if rank[-1] in graphs:
            continue
        graphs.add(rank[-1])
        tuned, t = tune_warm_up(pipe)
        mine = (t, *rank[1:3], sum(st.in_flight for st in tuned.stages), rank[-1])
        if out is None or mine < out[0]:
            out = (mine, tuned)
        if len(graphs) == _TUNED:
            break
    assert out is not None
    return out[1], out[0]


def tune_warm_up(pipe: Pipeline, *, per_stage: bool = True) -> tuple[Pipeline, float]:
    """A 1F1B pipeline with each stage's warm-up tuned on the simulator, and its iteration time.

    Algorithm 4's idea (a stage runs ahead as far as it helps, no further) at the grain of the
    warm-up count: first all stages with successors together (:data:`_JOINT_EXTRAS`), then the
    stages one by one in reverse topological order (those downstream already tuned), each
    trying 0, 1, 2, 4, … extra warm-up micro-batches (:func:`scheduled`) within memory; a count
    is kept when the simulated iteration is faster, ties going to fewer in flight. Start: the
    warm-up ``pipe`` has (its stages' extra over Table 3.2). At most :data:`_TUNE_TASKS`
    simulated passes (long pipelines of many micro-batches stop early). ``per_stage=False``:
    the joint step alone."""
    current = {st.id: 0 for st in pipe.stages}
    base = scheduled(pipe, {})
    if base is not None:
        for st, least in zip(pipe.stages, base.stages, strict=True):
            current[st.id] = max(0, st.in_flight - least.in_flight)
    best, best_time = pipe, simulate_pipeline(pipe, trace=False).iteration_time
    if pipe.schedule_kind != "1f1b":
        return best, best_time
    m = pipe.num_micro_batches
    sources = {e.src for e in pipe.edges}
    budget = _TUNE_TASKS // (2 * m * len(pipe.stages))  # simulations this pipeline may take
    # First every stage with successors together (the candidates come with 0–2 extra): where
    # several stages feed one (a graph pipeline's branches into their merge), one running ahead
    # gains nothing while the others hold the merge back, so the stage-by-stage steps below never
    # find the warm-up they need together (CANDLE-Uno rewritten at 32 devices, seven branch stages
    # into one: 1F1B 769.5k → 820.3k samples/s, Algorithm 4's). Extra m: every forward first
    # (GPipe's order) on those stages.
    for extra in [e for e in _JOINT_EXTRAS if e < m] + [m]:
        if budget <= 0:
            break
        trial = {s: max(x, extra) if s in sources else x for s, x in current.items()}
        if trial == current:
            continue
        budget -= 1
        cand = scheduled(pipe, trial)
        if cand is None:
            break  # more warm-up only needs more memory
        t = simulate_pipeline(cand, trace=False).iteration_time
        if t < best_time:
            best, best_time, current = cand, t, trial
    if not per_stage:
        return best, best_time
    for st in reversed(pipe.stages):
        if st.id not in sources:
            continue
        extra = 0
        for step in range(m + 1):
            extra = 0 if step == 0 else 1 << (step - 1)
            if extra >= m:
                break
            if extra == current[st.id]:
                continue
            if budget <= 0:
                return best, best_time
            budget -= 1
            trial = {**current, st.id: extra}
            cand = scheduled(pipe, trial)
            if cand is None:
                if extra > current[st.id]:
                    break  # more warm-up only needs more memory
                continue
            t = simulate_pipeline(cand, trace=False).iteration_time
            if t < best_time or (t == best_time and extra < current[st.id]):
                best, best_time, current = cand, t, trial
    return best, best_time


def fastest_rescheduled(best: Pipeline, best_time: float, timed: list[tuple[tuple, Pipeline]]) -> Pipeline:
    """``--schedule auto``: the fastest of ``best`` (the 1F1B search's plan, simulated at
    ``best_time``) and the candidates of ``timed`` rescheduled by Algorithm 4 (:mod:`.greedy`:
    every stage as early as its successors allow, with the fewest micro-batches in flight that
    costs no time), where that fits memory. Same stages, devices and micro-batch sizes as the
    candidates; only the order of passes changes.

    Candidates go in the order of their 1F1B rank (``timed``: ``(rank, pipeline)``, the stage
    graph's key last in the rank), each distinct stage graph and micro-batch size once. Algorithm 4
    costs about ``4·m²·S²`` simulated passes for ``m`` micro-batches and ``S`` stages: together
    they may spend :data:`_GREEDY_TASKS` (a candidate that would overdraw it is passed over). A
    candidate whose busiest stage alone — ``m`` forwards and backwards, then its all-reduce —
    takes as long as the best so far is passed over too: no schedule makes it faster.

    The stage graph that wins under 1F1B is not always the one that wins under Algorithm 4:
    stages of unequal load side by side gain most from passes 1F1B's fixed pattern cannot
    order."""
    budget = _GREEDY_TASKS
    seen: set[tuple] = set()
    for rank, pipe in sorted(timed, key=lambda rp: rp[0]):
        key = (rank[-1], pipe.micro_batch_size)
        if key in seen:
            continue
        seen.add(key)
        m, n = pipe.num_micro_batches, len(pipe.stages)
        tasks = 4 * m * m * n * n
        busiest = max(m * (st.forward_time + st.backward_time) + st.allreduce_time for st in pipe.stages)
        if tasks > budget or busiest >= best_time:
            continue
        budget -= tasks
        greedy = scheduled(dataclasses.replace(pipe, schedule_kind="greedy"), {})
        if greedy is None:
            continue
        t = simulate_pipeline(greedy, trace=False).iteration_time
        if t < best_time:
            best, best_time = greedy, t
    return best


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


def _estimate_iteration(
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
            t = 2 * (e.link.latency + e.bytes_per_sample * b / e.link.bandwidth)
        graph.add_edge(e.src, e.dst, w=t)
        cycle[e.dst] += exposed * t  # transfers on the receiver's cycle (dp.StageDP.stage)
    longest: dict[int, float] = {}
    for n in nx.topological_sort(graph):
        into = [longest[p] + graph.edges[p, n]["w"] for p in graph.predecessors(n)]
        longest[n] = graph.nodes[n]["w"] + max(into, default=0.0)
    slowest = max(cycle.values())
    return (m - 1) * slowest + max(longest.values()) + max(st.allreduce_time for st in stages)


def nic_route(
    cluster: ClusterSpec, src: list[str], dst: list[str]
) -> tuple[tuple[str, ...], tuple[str, ...], float]:
    """The network interfaces (``cluster.links.nics``) a micro-batch's activations cross from the
    replicas on devices ``src`` to those on ``dst``, and the largest share of its bytes through one.

    Replica ``i`` of ``p`` holds samples ``[i/p, (i+1)/p)`` of a micro-batch; the samples a replica
    pair has in common cross the network when the two devices are on different nodes (leaving
    through the sender's interface, entering through the receiver's) and NVLink otherwise.
    Returns ``((), (), 1.0)`` when no interface is crossed or the cluster names none.
    """
    if cluster.links.nics is None:
        return (), (), 1.0
    a = [cluster.device(d) for d in src]
    b = [cluster.device(d) for d in dst]
    out: dict[str, int] = {}
    into: dict[str, int] = {}
    for i, x in enumerate(a):  # in units of 1 / (len(a) * len(b)) of a micro-batch
        for j, y in enumerate(b):
            if x.node_index == y.node_index:
                continue
            common = min((i + 1) * len(b), (j + 1) * len(a)) - max(i * len(b), j * len(a))
            if common > 0:
                src_nic, dst_nic = nic_of(cluster, x), nic_of(cluster, y)
                out[src_nic] = out.get(src_nic, 0) + common
                into[dst_nic] = into.get(dst_nic, 0) + common
    if not out:
        return (), (), 1.0
    share = max(*out.values(), *into.values()) / (len(a) * len(b))
    return tuple(sorted(out)), tuple(sorted(into)), share


def ring_nics(cluster: ClusterSpec, devices: list[Device]) -> tuple[str, ...]:
    """The network interfaces (``cluster.links.nics``) a ring all-reduce over ``devices`` occupies.

    A ring over several nodes enters and leaves every node it spans, so it holds each node's
    interface (``per-node``) for its whole duration. With ``per-device`` interfaces the
    collective library spreads the ring's channels over every replica's interface (as NCCL does
    over a node's NICs), so it holds all of them. None inside one node or with ``nics`` unset.
    """
    if cluster.links.nics is None or len({d.node_index for d in devices}) < 2:
        return ()
    return tuple(sorted({nic_of(cluster, d) for d in devices}))


def nic_of(cluster: ClusterSpec, device: Device) -> str:
    """The name of ``device``'s network interface: its node's (``per-node``) or its own."""
    return device.node if cluster.links.nics == "per-node" else device.id


def ring_link(cluster: ClusterSpec, devices: list[Device]) -> Link | None:
    """The link a ring all-reduce over ``devices`` runs at (:func:`tessera.core.cost.allreduce_time`).

    Inside one node the intra-node link; over several nodes the inter-node link, which bounds
    the ring where it leaves a node. With ``per-device`` interfaces the collective library runs
    one ring channel through each replica's interface (NCCL spreads its channels over a node's
    NICs), so the ring crosses between nodes ``lanes`` times as fast — ``lanes`` the fewest
    replicas on any of its nodes — up to the intra-node link that every channel also crosses
    (NCCL's bus bandwidth: the node's NICs together, or NVLink, whichever is slower).
    ``None`` for one device."""
    if len(devices) < 2:
        return None
    per_node = Counter(d.node_index for d in devices)
    intra = cluster.links.intra_node or cluster.links.inter_node
    if len(per_node) == 1:
        return intra
    inter = cluster.links.inter_node or cluster.links.intra_node
    lanes = min(per_node.values()) if cluster.links.nics == "per-device" else 1
    return _ring_between_nodes(intra, inter, lanes)


def _ring_between_nodes(intra: Link | None, inter: Link | None, lanes: int) -> Link | None:
    if lanes <= 1 or inter is None:
        return inter
    bandwidth = lanes * inter.bandwidth
    if intra is not None:
        bandwidth = min(bandwidth, intra.bandwidth)
    return Link(bandwidth=bandwidth, latency=inter.latency)


def stage_edges(
    graph: Graph, tree: SPTree, unit_stage: dict[int, int], cost: CostModel
) -> list[PipelineEdge]:
    """Stage graph edges (C2): every operator edge between two stages, with its tensors."""
    crossing: dict[tuple[int, int], dict[str, float]] = {}
    for u, v, data in graph.dag.edges(data=True):
        su, sv = unit_stage[tree.unit_of[u]], unit_stage[tree.unit_of[v]]
        if su == sv:
            continue
        tensors = crossing.setdefault((su, sv), {})
        for t in data["tensors"]:
            tensors[t.name] = cost.wire_bytes(t.nbytes)
    edges = []
    for (su, sv), tensors in sorted(crossing.items()):
        items = sorted(tensors.items())
        edges.append(PipelineEdge(su, sv, items, sum(v for _, v in items)))
    return edges
