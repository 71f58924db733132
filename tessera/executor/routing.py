"""Routing of a GPP iteration: which unit sends which rows of which tensor to which unit.

A :class:`Unit` is one replica's share of one micro-batch of one stage. Transfers are routed by
*sample range*, so stages with different micro-batch sizes and data-parallel replicas exchange
exactly the rows each needs (:class:`Message`); a tensor's :class:`Layout` says how it holds
samples (batched, or batch-less and sent whole). :func:`build_routing` computes the whole
:class:`Routing` once, before any worker starts. See docs/executor.md ("Routing").
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from tessera.core.errors import InputError, LaunchError
from tessera.core.graph import Graph, is_floating, load_graph
from tessera.core.plans import GppPlan, Stage
from tessera.core.schedule import schedule_problems
from tessera.core.traced import traced_values_message
from tessera.executor.training import float_outputs


@dataclass(frozen=True)
class Unit:
    """One replica's share of one micro-batch of one stage."""

    stage: int
    replica: int
    micro_batch: int


@dataclass(frozen=True)
class Layout:
    """How a tensor holds samples: ``rows_per_sample`` rows of its batch ``axis`` per sample (None:
    batch-less). A message's rows are rows of that axis (a head-major ``[heads, B, S, D]`` tensor
    that a fused projection's split leaves between stages has its batch on axis 1)."""

    rows_per_sample: int | None
    tail: tuple[int, ...]  # the shape without the batch axis (batched) or the whole shape (batch-less)
    dtype: str
    axis: int = 0

    def shape(self, samples: int) -> tuple[int, ...]:
        if self.rows_per_sample is None:
            return self.tail
        return (*self.tail[: self.axis], samples * self.rows_per_sample, *self.tail[self.axis :])

    @property
    def has_grad(self) -> bool:
        return is_floating(self.dtype)


@dataclass(frozen=True)
class Message:
    """One transfer: rows ``src_rows`` of ``tensor`` in unit ``src`` become rows ``dst_rows`` of it in
    unit ``dst`` (None: the whole, batch-less tensor). Its gradient travels back when ``grad``."""

    id: int
    tensor: str
    src: Unit
    dst: Unit
    samples: int
    src_rows: tuple[int, int] | None
    dst_rows: tuple[int, int] | None
    grad: bool


@dataclass
class Routing:
    """Everything the ranks agree on before they start, computed once from the plan and the graph."""

    mini_batch: int
    ranks: dict[tuple[int, int], int]  # (stage, replica) → rank (its tensor-parallel group's first)
    devices: dict[int, str]  # rank → plan device id
    ranges: dict[int, list[list[tuple[int, int]]]]  # stage → [micro-batch][replica] → sample range
    stage_inputs: dict[int, list[str]]
    stage_outputs: dict[int, list[str]]
    loss_outputs: dict[int, list[str]]  # stage → graph outputs it scores
    layouts: dict[str, Layout]
    incoming: dict[Unit, list[Message]] = field(default_factory=dict)
    outgoing: dict[Unit, list[Message]] = field(default_factory=dict)
    # Every stage's tensor-parallel degree: rank ranks[(stage, replica)] + i is its group's i-th
    # rank, and exchanges messages with the i-th ranks of the other stages' groups.
    tensor_parallel: int = 1

    @property
    def world_size(self) -> int:
        return len(self.ranks) * self.tensor_parallel

    def rank_of(self, unit: Unit, index: int = 0) -> int:
        return self.ranks[(unit.stage, unit.replica)] + index

    def packs(self, messages: list[Message], inbound: bool) -> dict[Unit, list[Message]]:
        """``messages`` by peer unit (their sources where ``inbound``), each in the order they are
        packed: what sender and receiver both compute, so a packed message is cut where it was
        joined. Wider dtypes first (then by message id), so every piece starts at a multiple of its
        item size in the bytes and the receiver views it in place (int64 shapes before float32)."""

        def order(msg: Message) -> tuple[int, int]:
            return (-np.dtype(self.layouts[msg.tensor].dtype).itemsize, msg.id)

        packs: dict[Unit, list[Message]] = {}
        for msg in sorted(messages, key=order):
            packs.setdefault(msg.src if inbound else msg.dst, []).append(msg)
        return packs

    def place(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, tensor-parallel index) of ``rank``."""
        index = rank % self.tensor_parallel
        stage, replica = next(k for k, r in self.ranks.items() if r == rank - index)
        return stage, replica, index


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` contiguous ranges, larger ones first (numpy.array_split)."""
    q, r = divmod(hi - lo, parts)
    out, start = [], lo
    for i in range(parts):
        size = q + (1 if i < r else 0)
        out.append((start, start + size))
        start += size
    return out


def tensor_layouts(graph: Graph, model_path: str | bytes | onnx.ModelProto) -> dict[str, Layout]:
    """Layout of every tensor with a known shape, from the model loaded at two batch sizes."""
    if (why := graph.fixed_batch_message() or traced_values_message(graph)) is not None:
        raise InputError(why, source=graph.source)
    batch = {info.shape[0] for info in graph.inputs.values() if info.shape}
    if len(batch) != 1:
        raise LaunchError(f"the model's inputs disagree on the batch size (axis 0): {sorted(batch)}")
    b1 = batch.pop()
    doubled = {n: (2 * b1, *info.shape[1:]) for n, info in graph.inputs.items() if info.shape}
    graph2 = load_graph(model_path, input_shapes=doubled, rewrites=graph.rewrites)
    layouts: dict[str, Layout] = {}
    for name, info in graph.tensors.items():
        other = graph2.tensors.get(name)
        if info.shape is None or other is None or other.shape is None or name in graph.initializers:
            continue
        if other.shape == info.shape:
            layouts[name] = Layout(None, info.shape, info.dtype)
        elif (axis := _batch_axis(info.shape, other.shape, b1)) is not None:
            tail = info.shape[:axis] + info.shape[axis + 1 :]
            layouts[name] = Layout(info.shape[axis] // b1, tail, info.dtype, axis)
    return layouts


def _batch_axis(shape: tuple[int, ...], doubled: tuple[int, ...], b1: int) -> int | None:
    """The one axis that doubles with the batch, holding whole samples (None: none or several)."""
    if len(shape) != len(doubled):
        return None
    grown = [a for a, (n, m) in enumerate(zip(shape, doubled, strict=True)) if n != m]
    if len(grown) != 1:
        return None
    (axis,) = grown
    return axis if doubled[axis] == 2 * shape[axis] and shape[axis] % b1 == 0 else None


def build_routing(plan: GppPlan, graph: Graph, layouts: Mapping[str, Layout]) -> Routing:
    """The transfers of one iteration of ``plan`` (docs/executor.md, "Routing"). Raises LaunchError
    for a plan the executor cannot run (a batch the replicas cannot share, an unroutable tensor)."""
    degrees = sorted({st.tensor_parallel for st in plan.stages})
    if len(degrees) > 1:
        raise LaunchError(
            f"the stages' tensor_parallel differ ({degrees}): the executor runs one degree per plan"
        )
    ranks, devices = _assign_ranks(plan, degrees[0])
    ranges = {st.id: _sample_ranges(st, plan.mini_batch_size) for st in plan.stages}
    stage_inputs, stage_outputs, loss_outputs = _boundaries(plan, graph, layouts)
    routing = Routing(
        plan.mini_batch_size, ranks, devices, ranges, stage_inputs, stage_outputs, loss_outputs, dict(layouts),
        tensor_parallel=degrees[0],
    )  # fmt: skip
    stage_of = {n: st.id for st in plan.stages for n in st.nodes}
    declared = {(e.src, e.dst) for e in plan.edges}
    ids = itertools.count()
    for st in plan.stages:
        for t in stage_inputs[st.id]:
            if t in graph.inputs:
                continue
            src_stage = stage_of[graph.producer[t]]
            if (src_stage, st.id) not in declared:
                raise InputError(
                    f"tensor {t!r} flows from stage {src_stage} to stage {st.id}, "
                    f"but the plan has no edge {src_stage}->{st.id}"
                )
            lay = layouts.get(t)
            if lay is None:
                raise LaunchError(
                    f"tensor {t!r} (stage {src_stage} -> {st.id}) has no static shape, or no one axis "
                    "that holds its samples: cannot route it"
                )
            for msg in _transfers(t, lay, (src_stage, ranges[src_stage]), (st.id, ranges[st.id]), ids):
                routing.incoming.setdefault(msg.dst, []).append(msg)
                routing.outgoing.setdefault(msg.src, []).append(msg)
    return routing


def _assign_ranks(plan: GppPlan, t: int = 1) -> tuple[dict[tuple[int, int], int], dict[int, str]]:
    """(stage, replica) → rank and rank → device: ranks in the cluster's device order (of each
    replica's first device; a replica's ``t`` tensor-parallel devices take consecutive ranks)."""
    cluster_rank: dict[str, int] = {}
    if plan.cluster:
        for d in plan.cluster.get("devices", []):
            cluster_rank[d["id"]] = d["rank"]
    replicas = [(st.id, q, st.devices[q * t : (q + 1) * t]) for st in plan.stages for q in range(st.replicas)]
    order = sorted(range(len(replicas)), key=lambda i: (cluster_rank.get(replicas[i][2][0], i), i))
    ranks = {(replicas[i][0], replicas[i][1]): r * t for r, i in enumerate(order)}
    devices = {r * t + k: dev for r, i in enumerate(order) for k, dev in enumerate(replicas[i][2])}
    return ranks, devices


def _sample_ranges(st: Stage, mini_batch: int) -> list[list[tuple[int, int]]]:
    """A stage's ``[micro-batch][replica]`` sample ranges; its schedule checked against them."""
    b, d = st.micro_batch_size, st.replicas
    if mini_batch % b:
        raise InputError(f"stage {st.id}: micro-batch {b} does not divide the mini-batch {mini_batch}")
    _check_actions(st.id, st.schedule.actions, mini_batch // b)
    if b < d:
        raise LaunchError(f"stage {st.id}: micro-batch {b} is smaller than its {d} data-parallel replicas")
    return [_split(j * b, (j + 1) * b, d) for j in range(mini_batch // b)]


def _boundaries(
    plan: GppPlan, graph: Graph, layouts: Mapping[str, Layout]
) -> tuple[dict[int, list[str]], dict[int, list[str]], dict[int, list[str]]]:
    """Each stage's input and output tensors and the model outputs it scores; LaunchError for a
    model input or scored output that does not hold one row per sample."""
    stage_inputs, stage_outputs, loss_outputs = {}, {}, {}
    scored = set(float_outputs(graph))
    for st in plan.stages:
        ins, outs = graph.boundary(st.nodes)
        stage_inputs[st.id], stage_outputs[st.id] = ins, outs
        loss_outputs[st.id] = [t for t in outs if t in scored]
        for t in loss_outputs[st.id]:
            scalar = graph.outputs[t].scalar  # a loss the model computes (--loss graph)
            lay = layouts.get(t, Layout(None, (), ""))
            if (lay.rows_per_sample is None or lay.axis != 0) and not scalar:
                raise LaunchError(f"model output {t!r} does not hold one row per sample on axis 0")
    for t in graph.inputs:
        lay = layouts.get(t)
        if lay is None or lay.rows_per_sample != 1 or lay.axis != 0:
            raise LaunchError(f"model input {t!r} does not hold one row per sample on axis 0")
    return stage_inputs, stage_outputs, loss_outputs


StageRanges = tuple[int, list[list[tuple[int, int]]]]  # a stage and its [micro-batch][replica] ranges


def _transfers(
    tensor: str, lay: Layout, src: StageRanges, dst: StageRanges, ids: Iterator[int]
) -> Iterator[Message]:
    """The messages that bring ``tensor`` from the producer units to every consumer unit: the rows
    of the samples both hold (a batch-less tensor: whole, from the unit holding the first sample)."""
    src_stage, src_ranges = src
    dst_stage, dst_ranges = dst
    for j, per_replica in enumerate(dst_ranges):
        for q, (lo, hi) in enumerate(per_replica):
            for i, src_replicas in enumerate(src_ranges):
                for r, (plo, phi) in enumerate(src_replicas):
                    a, z = max(lo, plo), min(hi, phi)
                    if lay.rows_per_sample is None:
                        if not plo <= lo < phi:
                            continue
                        src_rows = dst_rows = None
                    elif a < z:
                        f = lay.rows_per_sample
                        src_rows = ((a - plo) * f, (z - plo) * f)
                        dst_rows = ((a - lo) * f, (z - lo) * f)
                    else:
                        continue
                    yield Message(
                        next(ids),
                        tensor,
                        Unit(src_stage, r, i),
                        Unit(dst_stage, q, j),
                        z - a,
                        src_rows,
                        dst_rows,
                        lay.has_grad,
                    )


def _check_actions(stage: int, actions: Sequence[str], m: int) -> None:
    """A stage's schedule must satisfy C4 (:func:`tessera.core.schedule.schedule_problems`, the rule
    the planner and ``validate`` apply): InputError naming the stage and the first problem."""
    if problems := schedule_problems(actions, m):
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InputError(f"stage {stage}: schedule: {problems[0]}{more}")
