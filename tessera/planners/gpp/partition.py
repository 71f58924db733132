"""GraphPipe's pipeline stage partitioner (thesis §3.5, Algorithm 2; paper-graphpipe §5).

``partition(graph, cluster, options)`` searches model partitions, device assignments and
micro-batch sizes together for the smallest Time-Per-Sample (TPS) of the bottleneck stage
(Eq. 3.1) under the per-device memory limit (Eq. 3.2):

- binary search on the bottleneck TPS ``t_max`` (Algorithm 2, lines 2–11; geometric midpoints,
  relative precision ``epsilon``);
- for each ``t_max``, a memoized DP over the series-parallel tree (:mod:`.sp`): a region is either
  one stage (base case, data parallel over ``d`` devices, line 25), or split in series (a first
  stage / first child, then the rest; lines 30–37) or in parallel (one branch or a group of
  branches, then the other branches; lines 38–43) with every split of the devices;
- the DP value of a region is a Pareto front of (pipeline depth, slack): the depth is the number
  of stages on its longest path — its source stage's in-flight count in 1F1B (Table 3.2 with
  equal micro-batch sizes adds one micro-batch per stage) — and the slack is the largest depth
  that may follow the region before a stage runs out of memory. Parallel regions take the larger
  in-flight count of their branches (§3.5); the DP minimizes the source's in-flight count, as the
  paper's DP does, so among feasible plans it prefers the shallowest pipeline;
- micro-batch sizes are powers of two dividing the mini-batch; for search time, one micro-batch
  size is chosen per plan (an outer loop over the candidates, best predicted iteration time wins)
  instead of per stage: Table 3.2 then reduces to +b per stage;
- devices: any split between branches; a single stage's data-parallel degree is any count (a
  replica processes ``ceil(b / d)`` samples);
- stage graph edges come from the operator graph (C2), devices are assigned in stage order
  (contiguous ranks, C3), schedules are generated per stage (C4) with in-flight counts recomputed
  exactly from the final stage graph (Table 3.2, reverse topological order, C5), and the memory of
  every stage is re-checked against the limit with those counts.

Sequential pipelines (SPP, :mod:`tessera.planners.spp`) run the same search on the linearized
tree: with one series of units, it is PipeDream's problem (contiguous stages with replication).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

import networkx as nx
import numpy as np

from tessera.core.cost import CostModel, allreduce_time, per_device_samples
from tessera.core.errors import InfeasibleError, InputError
from tessera.core.graph import Graph
from tessera.core.specs import ClusterSpec, Link
from tessera.planners.gpp.memory import StageMemoryEstimate, max_in_flight, stage_memory
from tessera.planners.gpp.schedule import compute_in_flight, gpipe, k_f_k_b, one_f_one_b
from tessera.planners.gpp.sp import SPNode, SPTree, decompose

ScheduleKind = Literal["1f1b", "kfkb", "greedy", "gpipe"]
_INF = 1 << 30
_FRONT = 3  # Pareto entries kept per DP state


@dataclass(frozen=True)
class PartitionOptions:
    mini_batch: int
    num_devices: int | None = None  # default: every device of the cluster
    memory_limit: float | None = None  # bytes per device; default: the device's memory
    schedule: ScheduleKind = "1f1b"
    k: int = 1  # kFkB's k
    micro_batch_sizes: tuple[int, ...] | None = None  # default: powers of two dividing mini_batch
    max_micro_batches: int = 256
    recompute: bool = False
    max_units: int = 128
    epsilon: float = 0.01
    precision: Literal["mixed", "fp32"] = "mixed"
    bytes_per_param: float | None = None


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

    def __init__(self, graph: Graph, tree: SPTree, cost: CostModel) -> None:
        self.graph, self.tree, self.cost = graph, tree, cost
        units = tree.units
        n = len(units)
        self.n = n
        activation_ops = [[o for o in u if o not in graph.constant_nodes] for u in units]
        self._ops = activation_ops
        weights = np.array([sum(cost.weight_bytes(graph.op(o)) for o in u) for u in units])
        optimizer = np.array([sum(cost.optimizer_bytes(graph.op(o)) for o in u) for u in units])
        grads = np.array([sum(cost.gradient_bytes(graph.op(o)) for o in u) for u in units])
        act = np.array([sum(cost.activation_bytes(graph, o) for o in u) for u in activation_ops])
        self.weights = _prefix(weights)
        self.optimizer = _prefix(optimizer)
        self.grads = _prefix(grads)
        self.act = _prefix(act)
        # Wire bytes per sample from unit u to unit v (u < v: depth-first order is topological).
        pair = np.zeros((n + 1, n + 1))
        seen: set[tuple[str, int]] = set()
        for u_name, v_name, data in graph.dag.edges(data=True):
            u, v = tree.unit_of[u_name], tree.unit_of[v_name]
            if u == v or u_name in graph.constant_nodes:
                continue
            for t in data["tensors"]:
                if (t.name, v) in seen:
                    continue
                seen.add((t.name, v))
                pair[min(u, v), max(u, v)] += cost.wire_bytes(t.nbytes)
        # enter(lo, hi) = Σ pair[u, v] for u < lo ≤ v < hi, via a 2-D cumulative sum.
        cum = np.zeros((n + 1, n + 1))
        cum[1:, 1:] = np.cumsum(np.cumsum(pair[:n, :n], axis=0), axis=1)
        self._cum = cum
        self._times: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def times(self, samples: int) -> tuple[np.ndarray, np.ndarray]:
        """Prefix sums of forward and backward time per unit at ``samples`` samples."""
        got = self._times.get(samples)
        if got is None:
            fw = [sum(self.cost.forward_time(self.graph.op(o), samples) for o in u) for u in self._ops]
            bw = [sum(self.cost.backward_time(self.graph.op(o), samples) for o in u) for u in self._ops]
            got = (_prefix(np.array(fw)), _prefix(np.array(bw)))
            self._times[samples] = got
        return got

    def enter(self, lo: int, hi: int) -> float:
        """Wire bytes per sample entering units [lo, hi) from earlier units."""
        c = self._cum
        return float(c[lo, hi] - c[lo, lo])


def _prefix(values: np.ndarray) -> list[float]:
    out = np.zeros(len(values) + 1)
    out[1:] = np.cumsum(values)
    return out.tolist()


class _Links:
    """The links the partitioner assumes: inside a node when the devices fit one, else between."""

    def __init__(self, cluster: ClusterSpec, num_devices: int) -> None:
        devices = cluster.devices()[:num_devices]
        per_node = sum(1 for d in cluster.devices() if d.node_index == devices[0].node_index)
        self.per_node = per_node
        intra = cluster.links.intra_node
        inter = cluster.links.inter_node
        self.intra = intra or inter
        self.inter = inter or intra
        self.p2p = self.intra if num_devices <= per_node else self.inter

    def within(self, d: int) -> Link | None:
        return self.intra if d <= self.per_node else self.inter


class _Search:
    """One micro-batch size: Algorithm 2's binary search with the series-parallel DP."""

    def __init__(
        self, tree: SPTree, costs: UnitCosts, links: _Links, opts: PartitionOptions, b: int, limit: float
    ) -> None:
        self.tree, self.costs, self.links, self.opts = tree, costs, links, opts
        self.b = b
        self.B = opts.mini_batch
        self.m = self.B // b
        self.limit = limit
        self.step = opts.k if opts.schedule == "kfkb" else 1
        if opts.schedule == "gpipe":
            self.step = self.m
        self._stage_cache: dict[tuple[int, int, int], tuple[float, int]] = {}
        self._ids: dict[int, int] = {}
        self._nodes: list[SPNode] = []
        self._index(tree.root)
        fw, bw = costs.times(b)
        self.work_per_sample = [(f + g) / b for f, g in zip(fw, bw, strict=True)]  # prefix sums

    def _index(self, node: SPNode) -> None:
        self._ids[id(node)] = len(self._nodes)
        self._nodes.append(node)
        for c in node.children:
            self._index(c)

    # -- one stage ---------------------------------------------------------------------------

    def stage(self, lo: int, hi: int, d: int) -> tuple[float, int]:
        """(TPS, most in-flight micro-batches that fit memory) of units [lo, hi) on ``d`` devices."""
        key = (lo, hi, d)
        got = self._stage_cache.get(key)
        if got is not None:
            return got
        c = self.costs
        s = per_device_samples(self.b, d)
        fw, bw = c.times(s)
        compute = (fw[hi] - fw[lo]) + (bw[hi] - bw[lo])
        if self.opts.recompute:
            compute += fw[hi] - fw[lo]
        grads = c.grads[hi] - c.grads[lo]
        ar = allreduce_time(grads, d, self.links.within(d))
        tps = compute / self.b + ar / self.B
        enter = c.enter(lo, hi)
        if enter > 0 and self.links.p2p is not None:
            tps = max(tps, (self.links.p2p.latency + enter * self.b / self.links.p2p.bandwidth) / self.b)
        cap = max_in_flight(
            limit=self.limit,
            weights=c.weights[hi] - c.weights[lo],
            optimizer=c.optimizer[hi] - c.optimizer[lo],
            activation_per_sample=c.act[hi] - c.act[lo],
            input_per_sample=enter,
            micro_batch=self.b,
            devices=d,
            recompute=self.opts.recompute,
        )
        got = (tps, cap)
        self._stage_cache[key] = got
        return got

    def base(self, lo: int, hi: int, d: int, t_max: float) -> tuple[int, int, tuple] | None:
        tps, cap = self.stage(lo, hi, d)
        if tps > t_max:
            return None
        if cap >= self.m:
            slack = _INF
        else:
            slack = cap // self.step - 1
            if cap < min(self.step, self.m) or slack < 0:
                return None
        return (1, slack, ("S", lo, hi, d))

    # -- the DP ------------------------------------------------------------------------------

    def run(self, t_max: float) -> tuple | None:
        self.t_max = t_max
        self.memo: dict[tuple[int, int, int, int], list[tuple[int, int, tuple]]] = {}
        front = self.solve(self.tree.root, self.opts_devices)
        for depth, slack, plan in front:
            if slack >= 0:
                return (depth, plan)
        return None

    @property
    def opts_devices(self) -> int:
        return self._devices

    def solve(self, node: SPNode, d: int) -> list[tuple[int, int, tuple]]:
        if node.kind == "leaf":
            e = self.base(node.lo, node.hi, d, self.t_max)
            return [e] if e else []
        if node.kind == "series":
            return self.series(node, 0, d)
        return self.parallel(node, 0, d)

    def _lower_bound_fails(self, lo: int, hi: int, d: int) -> bool:
        w = self.work_per_sample
        return (w[hi] - w[lo]) / d > self.t_max * (1 + 1e-9)

    def series(self, node: SPNode, i: int, d: int) -> list[tuple[int, int, tuple]]:
        ch = node.children
        if i == len(ch) - 1:
            return self.solve(ch[i], d)
        key = (0, self._ids[id(node)], i, d)
        got = self.memo.get(key)
        if got is not None:
            return got
        lo, hi = ch[i].lo, node.hi
        result: list[tuple[int, int, tuple]] = []
        if not self._lower_bound_fails(lo, hi, d):
            whole = self.base(lo, hi, d, self.t_max)
            if whole is not None:
                result = [whole]
            elif d > 1:
                cands: list[tuple[int, int, tuple]] = []
                for d1 in range(1, d):
                    d2 = d - d1
                    m = self._max_end(ch, i, len(ch) - 1, d1)
                    for mm in range(m, max(i, m - 2), -1):
                        first = self.base(lo, ch[mm].lo, d1, self.t_max)
                        if first is None:
                            continue
                        rest = self.series(node, mm, d2)
                        cands.extend(_seq(first, r) for r in rest)
                        if rest:
                            break
                    if ch[i].kind != "leaf":
                        heads = self.solve(ch[i], d1)
                        if heads:
                            rest = self.series(node, i + 1, d2)
                            cands.extend(_seq(h, r) for h in heads for r in rest)
                result = _pareto(cands)
        self.memo[key] = result
        return result

    def parallel(self, node: SPNode, i: int, d: int) -> list[tuple[int, int, tuple]]:
        ch = node.children
        if i == len(ch) - 1:
            return self.solve(ch[i], d)
        key = (1, self._ids[id(node)], i, d)
        got = self.memo.get(key)
        if got is not None:
            return got
        lo, hi = ch[i].lo, node.hi
        result: list[tuple[int, int, tuple]] = []
        if not self._lower_bound_fails(lo, hi, d):
            whole = self.base(lo, hi, d, self.t_max)
            if whole is not None:
                result = [whole]
            elif d > 1:
                cands: list[tuple[int, int, tuple]] = []
                for d1 in range(1, d):
                    d2 = d - d1
                    heads = self.solve(ch[i], d1)
                    if heads:
                        rest = self.parallel(node, i + 1, d2)
                        cands.extend(_par(h, r) for h in heads for r in rest)
                    m = self._max_end(ch, i, len(ch) - 1, d1)
                    if m > i + 1:
                        group = self.base(lo, ch[m].lo, d1, self.t_max)
                        if group is not None:
                            cands.extend(_par(group, r) for r in self.parallel(node, m, d2))
                result = _pareto(cands)
        self.memo[key] = result
        return result

    def _max_end(self, ch: list[SPNode], i: int, last: int, d: int) -> int:
        """Largest m in (i, last] with children [i, m) fitting ``t_max`` as one stage (i if none)."""
        lo = ch[i].lo
        a, b = i, last
        while a < b:
            mid = (a + b + 1) // 2
            if self.stage(lo, ch[mid].lo, d)[0] <= self.t_max:
                a = mid
            else:
                b = mid - 1
        return a


def _seq(first: tuple[int, int, tuple], rest: tuple[int, int, tuple]) -> tuple[int, int, tuple]:
    o1, s1, p1 = first
    o2, s2, p2 = rest
    return (o1 + o2, min(s2, s1 - o2), ("+", p1, p2))


def _par(a: tuple[int, int, tuple], b: tuple[int, int, tuple]) -> tuple[int, int, tuple]:
    return (max(a[0], b[0]), min(a[1], b[1]), ("+", a[2], b[2]))


def _pareto(cands: list[tuple[int, int, tuple]]) -> list[tuple[int, int, tuple]]:
    cands = [c for c in cands if c[1] >= 0]
    cands.sort(key=lambda c: (c[0], -c[1]))
    out: list[tuple[int, int, tuple]] = []
    best = -1
    for c in cands:
        if c[1] > best:
            out.append(c)
            best = c[1]
            if len(out) == _FRONT:
                break
    return out


def _stages_of(plan: tuple) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    todo = [plan]
    while todo:
        p = todo.pop()
        if p[0] == "S":
            out.append((p[1], p[2], p[3]))
        else:
            todo.extend((p[2], p[1]))
    return sorted(out)


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


def partition(
    graph: Graph,
    cluster: ClusterSpec,
    options: PartitionOptions,
    *,
    tree: SPTree | None = None,
    kind: Literal["gpp", "spp"] = "gpp",
) -> Pipeline:
    """GraphPipe's stage partitioner (thesis §3.5, Algorithm 2); see the module docstring.

    Returns the best :class:`Pipeline` over the micro-batch candidates, with per-stage schedules
    and memory. Raises :class:`InfeasibleError` when no plan fits the memory limit (the message
    names the per-device memory the best plan would need) and :class:`InputError` for bad options.
    """
    started = time.perf_counter()
    devices = cluster.devices()
    num = options.num_devices or len(devices)
    if num < 1 or num > len(devices):
        raise InputError(f"--devices {num}: the cluster has {len(devices)} device(s)")
    if options.mini_batch < 1:
        raise InputError("the mini-batch size must be positive")
    if options.schedule == "kfkb" and options.k < 1:
        raise InputError("kFkB needs k >= 1")
    device_type = devices[0].type
    limit = float(options.memory_limit if options.memory_limit is not None else device_type.memory)
    cost = CostModel.for_device(device_type, options.precision, options.bytes_per_param)
    if tree is None:
        tree = build_tree(graph, cost, options.max_units)
    costs = UnitCosts(graph, tree, cost)
    links = _Links(cluster, num)
    cands = micro_batch_candidates(options)
    if not cands:
        raise InputError(f"no micro-batch size divides the mini-batch {options.mini_batch}")
    best: Pipeline | None = None
    probes = 0
    for b in cands:
        search = _Search(tree, costs, links, options, b, limit)
        search._devices = num
        found, n_probes = _binary_search(search, num)
        probes += n_probes
        if found is None:
            continue
        t_bn, plan = found
        pipe = _materialize(graph, cluster, tree, costs, links, options, kind, b, t_bn, plan, num, limit)
        if pipe is None:
            continue
        if best is None or pipe.estimated_iteration_time < best.estimated_iteration_time * (1 - 1e-9):
            best = pipe
    if best is None:
        need = _memory_needed(graph, cluster, options, tree, kind) if math.isfinite(limit) else None
        more = f"; the best plan without the limit needs {_gib(need)} per device" if need else ""
        raise InfeasibleError(
            f"no {kind.upper()} plan of {graph.num_nodes} operators on {num} device(s) fits "
            f"{_gib(limit)} per device at mini-batch {options.mini_batch}{more}"
        )
    best.search_time_s = time.perf_counter() - started
    best.probes = probes
    return best


def build_tree(graph: Graph, cost: CostModel, max_units: int) -> SPTree:
    """The coarsened series-parallel tree, operators weighed by their time at 8 samples."""

    def weigh(n: str) -> float:
        op = graph.op(n)
        return cost.forward_time(op, 8) + cost.backward_time(op, 8)

    return decompose(graph, op_cost=weigh, max_units=max_units)


def _gib(n: float | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def _memory_needed(
    graph: Graph, cluster: ClusterSpec, options: PartitionOptions, tree: SPTree, kind: str
) -> float | None:
    relaxed = PartitionOptions(**{**options.__dict__, "memory_limit": float("inf")})
    try:
        pipe = partition(graph, cluster, relaxed, tree=tree, kind=kind)  # type: ignore[arg-type]
    except InfeasibleError:
        return None
    return max(s.memory.peak for s in pipe.stages if s.memory)


def _binary_search(search: _Search, num: int) -> tuple[tuple[float, tuple] | None, int]:
    c = search.costs
    n = c.n
    hi_t = search.stage(0, n, 1)[0] * 1.001 + 1e-12
    # A safe upper bound: every unit on its own device would be at most the whole graph's TPS;
    # check feasibility there first (memory may rule everything out).
    probes = 1
    found = search.run(hi_t)
    if found is None:
        hi_t *= 4
        probes += 1
        found = search.run(hi_t)
        if found is None:
            return None, probes
    best = (hi_t, found[1])
    lo_t = search.work_per_sample[n] / num * 0.5
    while hi_t / lo_t > 1 + search.opts.epsilon:
        mid = math.sqrt(lo_t * hi_t)
        probes += 1
        got = search.run(mid)
        if got is None:
            lo_t = mid
        else:
            hi_t = mid
            best = (mid, got[1])
    return best, probes


def _materialize(
    graph: Graph,
    cluster: ClusterSpec,
    tree: SPTree,
    costs: UnitCosts,
    links: _Links,
    opts: PartitionOptions,
    kind: Literal["gpp", "spp"],
    b: int,
    t_bn: float,
    plan: tuple,
    num: int,
    limit: float,
) -> Pipeline | None:
    """Stages, devices, edges, exact in-flight counts, schedules and memory of a DP solution."""
    devices = cluster.devices()[:num]
    spans = _stages_of(plan)
    stages: list[PipelineStage] = []
    unit_stage: dict[int, int] = {}
    next_rank = 0
    m = opts.mini_batch // b
    for sid, (lo, hi, d) in enumerate(spans):
        ids = [dev.id for dev in devices[next_rank : next_rank + d]]
        next_rank += d
        s = per_device_samples(b, d)
        fw, bw = costs.times(s)
        f = fw[hi] - fw[lo]
        g = bw[hi] - bw[lo]
        if opts.recompute:
            g += f
        grads = costs.grads[hi] - costs.grads[lo]
        link = _group_link(cluster, devices[next_rank - d : next_rank])
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
            )
        )
        for u in range(lo, hi):
            unit_stage[u] = sid
    edges = stage_edges(graph, tree, unit_stage, costs.cost)
    for e in edges:
        e.link = cluster.link_between(stages[e.src].devices[0], stages[e.dst].devices[0])
    # Exact in-flight counts (Table 3.2) in reverse topological order of the stage graph (C5).
    succ: dict[int, list[int]] = {s.id: [] for s in stages}
    for e in edges:
        succ[e.src].append(e.dst)
    k = opts.k if opts.schedule == "kfkb" else 1
    for st in reversed(stages):  # stage ids follow a topological order of the units
        if opts.schedule == "gpipe":
            samples = opts.mini_batch
        elif not succ[st.id]:
            samples = k * b
        else:
            samples = max(compute_in_flight(k, b, k, b, stages[j].in_flight * b) for j in succ[st.id])
        st.in_flight = max(1, min(m, math.ceil(samples / b)))
    for st in stages:
        if opts.schedule == "kfkb":
            st.schedule = k_f_k_b(m, k, st.in_flight)
        elif opts.schedule == "gpipe":
            st.schedule = gpipe(m)
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
            recompute=opts.recompute,
        )
        if st.memory.peak > limit:
            return None
    depth_graph = nx.DiGraph()
    depth_graph.add_nodes_from(s.id for s in stages)
    depth_graph.add_edges_from((e.src, e.dst) for e in edges)
    depth = nx.dag_longest_path_length(depth_graph) + 1
    slowest = max(s.forward_time + s.backward_time for s in stages)
    estimate = (m + depth - 1) * slowest + max(s.allreduce_time for s in stages)
    estimate = max(estimate, t_bn * opts.mini_batch)
    return Pipeline(
        kind=kind,
        mini_batch_size=opts.mini_batch,
        micro_batch_size=b,
        schedule_kind=opts.schedule,
        k=k,
        stages=stages,
        edges=edges,
        bottleneck_tps=max(s.time_per_sample + s.allreduce_time / opts.mini_batch for s in stages),
        estimated_iteration_time=estimate,
        search_time_s=0.0,
        num_units=tree.num_units,
        memory_limit=limit,
    )


def _group_link(cluster: ClusterSpec, devices: list) -> Link | None:
    if len(devices) < 2:
        return None
    nodes = {d.node_index for d in devices}
    if len(nodes) == 1:
        return cluster.links.intra_node or cluster.links.inter_node
    return cluster.links.inter_node or cluster.links.intra_node


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
