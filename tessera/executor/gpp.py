"""GPP stage workers: run a graph-pipeline-parallel training plan on torch.distributed ranks.

The plan is data; this module only interprets it (as ``torch.distributed.pipelining``'s runtime
interprets a schedule). Each rank runs one *replica* of one *stage*:

- it builds the stage's module from ``Graph.extract(stage.nodes)`` (:mod:`.torch_module`);
- the mini-batch of ``B`` samples is cut into the stage's micro-batches (``B / b`` of
  ``micro_batch_size`` ``b`` samples: micro-batch ``j`` holds samples ``[j·b, (j+1)·b)``), and each
  micro-batch is cut among the stage's ``d`` data-parallel replicas (``numpy.array_split`` sizes:
  ``ceil(b/d)`` first, as the planner's memory model assumes);
- it executes the stage's schedule actions in order: ``F3`` receives micro-batch 3's inputs from the
  producing stages (point-to-point, along the plan's stage-DAG edges), runs the forward and sends
  the outputs to the consuming stages; ``B3`` receives the gradients of its outputs, runs the
  backward and sends the gradients of its inputs back;
- after the last action, the replicas of a stage all-reduce (sum) their gradients and every rank
  takes one optimizer step.

Stages may have different micro-batch sizes (GraphPipe allows it, thesis §3.6): transfers are
routed by *sample range*, so a consumer micro-batch is assembled (concatenated) from the pieces of
every producer micro-batch and replica holding its samples, and a producer's output is split into
the pieces its consumers need; gradients travel the same routes back. The simulator
(:mod:`tessera.planners.sim`) models the same dependencies.

Training semantics (shared with :func:`train_reference`, so a plan is checked against one process):

- data: :class:`TrainingData` — seeded synthetic inputs (floats ~ N(0, 1); integer ids uniform in
  ``[0, rows)`` of the smallest Gather table they index), or the arrays of an ``.npz`` file;
- loss: the sum over the model's floating-point outputs of the mean squared error to a target,
  ``Σ_o mean((o − t_o)²)`` over the whole mini-batch; the target is 0 (so the loss is the mean of
  squares of the outputs) unless the data file has an array ``target:<output>``;
- optimizer: plain SGD (no momentum, no weight decay) with learning rate ``lr``, one step per
  mini-batch. Each micro-batch and replica adds its share ``Σ (o − t)² / (B · elements per sample)``,
  so the summed gradients are the mini-batch gradient exactly (up to float rounding).

A tensor that crosses stages is *batched* (its first dimension holds ``f`` rows per sample — 1 for
``[batch, …]``, ``seq`` for a ``[batch·seq, …]`` reshape) or *batch-less* (it does not depend on
the inputs, e.g. a causal mask): the layout is found by loading the model at two batch sizes.
A batch-less tensor travels whole, once per consumer micro-batch, from the producer unit holding
that micro-batch's first sample.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from tessera.backends.torch_module import OnnxModule, check_supported, to_torch
from tessera.core.errors import InputError, LaunchError
from tessera.core.files import read_npz
from tessera.core.graph import Graph, load_graph
from tessera.core.plans import GppPlan
from tessera.executor.launcher import (
    WATCHDOG_FACTOR,
    LaunchOptions,
    Watchdog,
    choose_backend,
    inject_test_fault,
    launch_workers,
    memory_status,
    worker_setup,
)

# -- training semantics ------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainOptions:
    """What one training run does: ``steps`` SGD steps with learning rate ``lr`` on ``data``
    (an ``.npz`` file) or seeded synthetic data."""

    steps: int = 3
    lr: float = 0.01
    seed: int = 0
    data: str | None = None


class TrainingData:
    """The mini-batches of a run: ``batch(step)`` → (inputs, targets), numpy arrays by name.

    Synthetic data is drawn from ``numpy.random.default_rng([seed, step])``, so every rank and the
    reference draw the same mini-batch without talking. An ``.npz`` file holds one array per graph
    input (and optionally ``target:<output>``) with ``N`` rows, ``N`` a multiple of the mini-batch;
    step ``k`` takes rows ``[(k mod N/B)·B, …+B)``.
    """

    def __init__(self, graph: Graph, mini_batch: int, seed: int = 0, path: str | None = None) -> None:
        self.mini_batch = mini_batch
        self.seed = seed
        self.specs = {name: (info.shape or (1,), info.dtype) for name, info in graph.inputs.items()}
        self.id_range = {name: _id_range(graph, name) for name, (_, dtype) in self.specs.items()}
        self.arrays: dict[str, np.ndarray] | None = None
        if path is not None:
            self.arrays = _load_npz(path, graph, mini_batch)

    def batch(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        B = self.mini_batch
        if self.arrays is not None:
            n = next(iter(self.arrays.values())).shape[0] // B
            lo = (step % n) * B
            inputs = {k: v[lo : lo + B] for k, v in self.arrays.items() if not k.startswith("target:")}
            targets = {k[7:]: v[lo : lo + B] for k, v in self.arrays.items() if k.startswith("target:")}
            return inputs, targets
        rng = np.random.default_rng([self.seed, step])
        inputs: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in self.specs.items():
            full = (B, *shape[1:])
            if np.issubdtype(np.dtype(dtype), np.floating):
                inputs[name] = rng.standard_normal(full).astype(dtype)
            elif np.dtype(dtype) == np.bool_:
                inputs[name] = rng.integers(0, 2, full).astype(np.bool_)
            else:
                inputs[name] = rng.integers(0, self.id_range[name], full).astype(dtype)
        return inputs, {}


def _id_range(graph: Graph, name: str) -> int:
    """Rows of the smallest Gather table an integer input indexes (1 when it indexes none)."""
    rows = [
        graph.initializers[op.inputs[0]].shape[op.attributes.get("axis", 0)]
        for c in graph.consumers.get(name, ())
        if (op := graph.op(c)).op_type == "Gather"
        and len(op.inputs) > 1
        and op.inputs[1] == name
        and op.inputs[0] in graph.initializers
    ]
    return max(1, min(rows)) if rows else 1


def _load_npz(path: str, graph: Graph, mini_batch: int) -> dict[str, np.ndarray]:
    arrays = read_npz(path)
    missing = [n for n in graph.inputs if n not in arrays]
    if missing:
        raise InputError(f"no array for model input(s) {', '.join(missing)}", source=path)
    rows = {v.shape[0] if v.ndim else 0 for v in arrays.values()}
    if len(rows) != 1 or (n := rows.pop()) < mini_batch or n % mini_batch:
        raise InputError(
            f"every array needs the same number of rows, a multiple of the mini-batch {mini_batch}",
            source=path,
        )
    out: dict[str, np.ndarray] = {}
    for name, array in arrays.items():
        if name.startswith("target:"):
            if name[7:] not in graph.outputs:
                raise InputError(f"{name!r} names no model output", source=path)
            info, wants = graph.outputs[name[7:]], f"the model's output {name[7:]!r} has"
        elif name in graph.inputs:
            info, wants = graph.inputs[name], "the model wants"
        else:
            continue
        if info.shape is not None and tuple(array.shape[1:]) != tuple(info.shape[1:]):
            raise InputError(
                f"array {name!r} has sample shape {list(array.shape[1:])}, {wants} {list(info.shape[1:])}",
                source=path,
            )
        out[name] = array.astype(info.dtype)
    return out


def loss_term(output: Tensor, target: Tensor | None, samples: int, mini_batch: int) -> Tensor:
    """This piece's share of ``mean((o − t)²)`` over the mini-batch: ``Σ (o − t)² / (B · n)``,
    ``n`` the elements per sample. Summed over micro-batches and replicas it is the mean."""
    diff = output if target is None else output - target
    per_sample = output.numel() / max(samples, 1)
    return (diff * diff).sum() / (mini_batch * per_sample)


def _float_outputs(graph: Graph) -> list[str]:
    return [n for n, info in graph.outputs.items() if np.issubdtype(np.dtype(info.dtype), np.floating)]


@dataclass
class ReferenceRun:
    """The single-process run a plan must reproduce: loss per step (before its update) and the
    weights after the last step, by initializer name."""

    losses: list[float]
    weights: dict[str, np.ndarray]


def train_reference(
    model: str | os.PathLike[str] | bytes | onnx.ModelProto | Graph,
    steps: int,
    mini_batch: int,
    seed: int = 0,
    lr: float = 0.01,
    *,
    data: str | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> ReferenceRun:
    """Train ``model`` for ``steps`` SGD steps on whole mini-batches in this process (see the
    module docstring for data, loss and optimizer): the ground truth of a GPP run."""
    graph = model if isinstance(model, Graph) else load_graph(model, input_shapes=input_shapes)
    module = to_torch(graph.model, label=graph.source)
    params = [p for _, p in module.onnx_parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    source = TrainingData(graph, mini_batch, seed, data)
    outputs = _float_outputs(graph)
    losses: list[float] = []
    for step in range(steps):
        inputs, targets = source.batch(step)
        outs = module.run({k: torch.from_numpy(v) for k, v in inputs.items()})
        loss = sum(
            loss_term(outs[o], _tensor_or_none(targets.get(o)), mini_batch, mini_batch) for o in outputs
        )
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        losses.append(float(loss.detach()))  # type: ignore[union-attr]
    weights = {n: p.detach().numpy().copy() for n, p in module.onnx_parameters()}
    return ReferenceRun(losses, weights)


def _tensor_or_none(array: np.ndarray | None, device: torch.device | None = None) -> Tensor | None:
    return None if array is None else torch.from_numpy(array).to(device or "cpu")


# -- routing: which unit sends which rows of which tensor to which unit --------------------------


@dataclass(frozen=True)
class Unit:
    """One replica's share of one micro-batch of one stage."""

    stage: int
    replica: int
    micro_batch: int


@dataclass(frozen=True)
class Layout:
    """How a tensor holds samples: ``rows_per_sample`` rows of axis 0 per sample (None: batch-less)."""

    rows_per_sample: int | None
    tail: tuple[int, ...]  # the shape after axis 0 (batched) or the whole shape (batch-less)
    dtype: str

    def shape(self, samples: int) -> tuple[int, ...]:
        if self.rows_per_sample is None:
            return self.tail
        return (samples * self.rows_per_sample, *self.tail)

    @property
    def has_grad(self) -> bool:
        return np.issubdtype(np.dtype(self.dtype), np.floating)


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
    ranks: dict[tuple[int, int], int]  # (stage, replica) → rank
    devices: dict[int, str]  # rank → plan device id
    ranges: dict[int, list[list[tuple[int, int]]]]  # stage → [micro-batch][replica] → sample range
    stage_inputs: dict[int, list[str]]
    stage_outputs: dict[int, list[str]]
    loss_outputs: dict[int, list[str]]  # stage → graph outputs it scores
    layouts: dict[str, Layout]
    incoming: dict[Unit, list[Message]] = field(default_factory=dict)
    outgoing: dict[Unit, list[Message]] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def rank_of(self, unit: Unit) -> int:
        return self.ranks[(unit.stage, unit.replica)]


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
        elif (
            len(info.shape) == len(other.shape)
            and info.shape[1:] == other.shape[1:]
            and other.shape[0] == 2 * info.shape[0]
            and info.shape[0] % b1 == 0
        ):
            layouts[name] = Layout(info.shape[0] // b1, info.shape[1:], info.dtype)
    return layouts


def build_routing(plan: GppPlan, graph: Graph, layouts: Mapping[str, Layout]) -> Routing:
    """The transfers of one iteration of ``plan`` (see the module docstring). Raises LaunchError for
    a plan the executor cannot run (a batch the replicas cannot share, an unroutable tensor)."""
    B = plan.mini_batch_size
    cluster_rank: dict[str, int] = {}
    if plan.cluster:
        for d in plan.cluster.get("devices", []):
            cluster_rank[d["id"]] = d["rank"]
    replicas = [(st.id, q, dev) for st in plan.stages for q, dev in enumerate(st.devices)]
    order = sorted(range(len(replicas)), key=lambda i: (cluster_rank.get(replicas[i][2], i), i))
    ranks = {(replicas[i][0], replicas[i][1]): r for r, i in enumerate(order)}
    devices = {r: replicas[i][2] for r, i in enumerate(order)}

    stage_of = {n: st.id for st in plan.stages for n in st.nodes}
    ranges: dict[int, list[list[tuple[int, int]]]] = {}
    for st in plan.stages:
        b, d = st.micro_batch_size, len(st.devices)
        if B % b:
            raise InputError(f"stage {st.id}: micro-batch {b} does not divide the mini-batch {B}")
        _check_actions(st.id, st.schedule.actions, B // b)
        if b < d:
            raise LaunchError(
                f"stage {st.id}: micro-batch {b} is smaller than its {d} data-parallel replicas"
            )
        ranges[st.id] = [_split(j * b, (j + 1) * b, d) for j in range(B // b)]

    stage_inputs, stage_outputs, loss_outputs = {}, {}, {}
    float_outputs = set(_float_outputs(graph))
    for st in plan.stages:
        ins, outs = graph.boundary(st.nodes)
        stage_inputs[st.id], stage_outputs[st.id] = ins, outs
        loss_outputs[st.id] = [t for t in outs if t in float_outputs]
        for t in loss_outputs[st.id]:
            if layouts.get(t, Layout(None, (), "")).rows_per_sample is None:
                raise LaunchError(f"model output {t!r} does not hold one row per sample on axis 0")
    for t in graph.inputs:
        lay = layouts.get(t)
        if lay is None or lay.rows_per_sample != 1:
            raise LaunchError(f"model input {t!r} does not hold one row per sample on axis 0")

    declared = {(e.src, e.dst) for e in plan.edges}
    routing = Routing(B, ranks, devices, ranges, stage_inputs, stage_outputs, loss_outputs, dict(layouts))
    next_id = 0
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
                    f"tensor {t!r} (stage {src_stage} -> {st.id}) has no static shape, or its batch "
                    "is not on axis 0: cannot route it"
                )
            for j, per_replica in enumerate(ranges[st.id]):
                for q, (lo, hi) in enumerate(per_replica):
                    dst = Unit(st.id, q, j)
                    for i, src_replicas in enumerate(ranges[src_stage]):
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
                            msg = Message(
                                next_id,
                                t,
                                Unit(src_stage, r, i),
                                dst,
                                z - a,
                                src_rows,
                                dst_rows,
                                lay.has_grad,
                            )
                            next_id += 1
                            routing.incoming.setdefault(dst, []).append(msg)
                            routing.outgoing.setdefault(msg.src, []).append(msg)
    return routing


def _check_actions(stage: int, actions: Sequence[str], m: int) -> None:
    """A stage's schedule must run F0..F(m-1) and B0..B(m-1) once each, each F before its B."""
    done: set[int] = set()
    seen: set[str] = set()
    for a in actions:
        kind, j = a[0], int(a[1:])
        if a in seen or j >= m or (kind == "B" and j not in done):
            raise InputError(
                f"stage {stage}: schedule action {a!r} is repeated, out of range (m = {m}) "
                "or a backward before its forward"
            )
        seen.add(a)
        if kind == "F":
            done.add(j)
    if len(seen) != 2 * m:
        raise InputError(
            f"stage {stage}: the schedule has {len(seen)} actions, expected F and B for {m} micro-batches"
        )


# -- the worker ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank gets (picklable): the plan, the model file, the routing, the run options."""

    plan: dict[str, Any]
    model_path: str
    input_shapes: dict[str, list[int]]
    routing: Routing
    options: TrainOptions
    timeout_s: float
    backend: str  # gloo | nccl
    return_weights: bool = False


@dataclass
class _Saved:
    leaves: dict[int, Tensor]  # message id → received input piece (a leaf that collects its gradient)
    outputs: dict[str, Tensor]
    loss: Tensor | None
    activation_bytes: int  # what this in-flight micro-batch holds: saved tensors, inputs, outputs


def _storages(tensors: Iterable[Tensor], into: dict[int, int], skip: set[int]) -> None:
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            into[st.data_ptr()] = st.nbytes()


class StageWorker:
    """One rank: one replica of one stage, interpreting the stage's schedule every step."""

    def __init__(self, spec: WorkerSpec, rank: int, device: torch.device) -> None:
        self.spec = spec
        self.rank = rank
        self.device = device
        self.routing = routing = spec.routing
        plan = GppPlan.model_validate(spec.plan)
        self.stage_id, self.replica = next(k for k, r in routing.ranks.items() if r == rank)
        self.stage = next(st for st in plan.stages if st.id == self.stage_id)
        self.actions = [(a[0], int(a[1:])) for a in self.stage.schedule.actions]
        self.rss_base = memory_status("VmRSS")
        graph = load_graph(
            spec.model_path, input_shapes=spec.input_shapes or None, rewrites=plan.model.rewrites
        )
        if graph.sha256 != plan.model.sha256:
            raise LaunchError(
                f"rank {rank}: the model changed since the plan was made", source=spec.model_path
            )
        sub = graph.extract(self.stage.nodes, name=f"stage{self.stage_id}")
        self.module: OnnxModule = to_torch(sub, label=f"stage {self.stage_id}").to(device)
        self.params = [p for _, p in self.module.onnx_parameters()]
        # Activation recomputation (the stage's recompute): the forward keeps only its inputs and
        # outputs, and the backward runs it again (torch.utils.checkpoint).
        self.recompute = self.stage.recompute
        self.opt = torch.optim.SGD(self.params, lr=spec.options.lr) if self.params else None
        self.data = TrainingData(graph, routing.mini_batch, spec.options.seed, spec.options.data)
        self.graph_inputs = set(graph.inputs)
        # Data-parallel groups: created on every rank in the same order (torch.distributed's rule).
        self.dp_group = None
        for st in plan.stages:
            members = sorted(routing.ranks[(st.id, q)] for q in range(len(st.devices)))
            if len(members) > 1:
                group = dist.new_group(members)
                if st.id == self.stage_id:
                    self.dp_group = group
        self._sends: list[tuple[Any, Tensor]] = []
        # Tensor memory as the planner models it (Eq. 3.2): weights + gradients (plain SGD keeps no
        # optimizer state) + the activations of the micro-batches in flight, at their peak.
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self._param_storages = {p.untyped_storage().data_ptr() for p in self.params}
        self.peak_activation_bytes = 0

    # -- communication (tags: one per message, direction and step parity) --

    def _tag(self, msg: Message, backward: bool, step: int) -> int:
        return msg.id * 4 + (step % 2) * 2 + int(backward)

    def _send(self, tensor: Tensor, dst: int, tag: int) -> None:
        payload = tensor.detach().contiguous()
        self._sends.append((dist.isend(payload, dst, tag=tag), payload))

    def _recv(self, shape: tuple[int, ...], dtype: str, src: int, tag: int, what: str) -> Tensor:
        buf = torch.empty(shape, dtype=getattr(torch, np.dtype(dtype).name), device=self.device)
        try:
            dist.recv(buf, src, tag=tag)
        except Exception as exc:  # say what was awaited from whom: the peer is the likely culprit
            raise RuntimeError(f"waiting for {what} from rank {src}: {' '.join(str(exc).split())}") from exc
        return buf

    # -- the two actions --

    def forward(
        self, j: int, step: int, inputs: Mapping[str, np.ndarray], targets: Mapping[str, np.ndarray]
    ) -> None:
        unit = Unit(self.stage_id, self.replica, j)
        lo, hi = self.routing.ranges[self.stage_id][j][self.replica]
        by_tensor: dict[str, list[Message]] = {}
        for msg in self.routing.incoming.get(unit, []):
            by_tensor.setdefault(msg.tensor, []).append(msg)
        feeds: dict[str, Tensor] = {}
        leaves: dict[int, Tensor] = {}
        t0 = time.perf_counter()
        for t in self.routing.stage_inputs[self.stage_id]:
            if t in self.graph_inputs:
                feeds[t] = torch.from_numpy(inputs[t][lo:hi]).to(self.device)
                continue
            pieces = []
            for msg in sorted(by_tensor[t], key=lambda m: m.dst_rows or (0, 0)):
                lay = self.routing.layouts[t]
                buf = self._recv(
                    lay.shape(msg.samples),
                    lay.dtype,
                    self.routing.rank_of(msg.src),
                    self._tag(msg, False, step),
                    f"{t!r} of micro-batch {j} (step {step})",
                )
                if msg.grad:
                    buf.requires_grad_(True)
                leaves[msg.id] = buf
                pieces.append(buf)
            feeds[t] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        t1 = time.perf_counter()
        held: dict[int, int] = {}

        def pack(t: Tensor) -> Tensor:
            _storages([t], held, self._param_storages)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if self.recompute:
                # early_stop off: torch ends a recomputation early by raising through the
                # module, whose per-operator error reports would catch it.
                outputs = checkpoint(self.module.run, feeds, use_reentrant=False, early_stop=False)
            else:
                outputs = self.module.run(feeds)
        loss = None
        for o in self.routing.loss_outputs[self.stage_id]:
            target = targets.get(o)
            term = loss_term(
                outputs[o],
                None if target is None else torch.from_numpy(target[lo:hi]).to(self.device),
                hi - lo,
                self.routing.mini_batch,
            )
            loss = term if loss is None else loss + term
        if loss is not None:
            self.loss_sum += float(loss.detach())
        t2 = time.perf_counter()
        for msg in self.routing.outgoing.get(unit, []):
            out = outputs[msg.tensor]
            piece = out if msg.src_rows is None else out[msg.src_rows[0] : msg.src_rows[1]]
            self._send(piece, self.routing.rank_of(msg.dst), self._tag(msg, False, step))
        _storages([*leaves.values(), *outputs.values()], held, self._param_storages)
        self.saved[j] = _Saved(leaves, outputs, loss, sum(held.values()))
        live = sum(x.activation_bytes for x in self.saved.values())
        self.peak_activation_bytes = max(self.peak_activation_bytes, live)
        self.busy += t2 - t1
        self.wait += t1 - t0

    def backward(self, j: int, step: int) -> None:
        unit = Unit(self.stage_id, self.replica, j)
        saved = self.saved.pop(j)
        t0 = time.perf_counter()
        grads: dict[str, Tensor] = {}
        for msg in self.routing.outgoing.get(unit, []):
            if not msg.grad:
                continue
            out = saved.outputs[msg.tensor]
            piece = self._recv(
                tuple(out.shape)
                if msg.src_rows is None
                else (msg.src_rows[1] - msg.src_rows[0], *out.shape[1:]),
                self.routing.layouts[msg.tensor].dtype,
                self.routing.rank_of(msg.dst),
                self._tag(msg, True, step),
                f"the gradient of {msg.tensor!r} of micro-batch {j} (step {step})",
            )
            g = grads.get(msg.tensor)
            if g is None:
                g = grads[msg.tensor] = torch.zeros_like(out, requires_grad=False)
            if msg.src_rows is None:
                g += piece
            else:
                g[msg.src_rows[0] : msg.src_rows[1]] += piece
        t1 = time.perf_counter()
        roots: list[Tensor] = []
        root_grads: list[Tensor] = []
        if saved.loss is not None and saved.loss.requires_grad:
            roots.append(saved.loss)
            root_grads.append(torch.ones_like(saved.loss))
        for t, g in grads.items():
            if saved.outputs[t].requires_grad:
                roots.append(saved.outputs[t])
                root_grads.append(g)
        if roots:
            torch.autograd.backward(roots, root_grads)
        t2 = time.perf_counter()
        for msg in self.routing.incoming.get(unit, []):
            if msg.grad:
                leaf = saved.leaves[msg.id]
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self._send(g, self.routing.rank_of(msg.src), self._tag(msg, True, step))
        self.busy += t2 - t1
        self.wait += t1 - t0

    # -- one training step --

    def step(self, step: int) -> dict[str, float]:
        inject_test_fault(self.rank, step)
        start = time.perf_counter()
        self.busy = self.wait = self.loss_sum = 0.0
        self.saved: dict[int, _Saved] = {}
        inputs, targets = self.data.batch(step)
        for kind, j in self.actions:
            if kind == "F":
                self.forward(j, step, inputs, targets)
            else:
                self.backward(j, step)
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        t0 = time.perf_counter()
        if self.dp_group is not None and self.params:
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params]
            )
            dist.all_reduce(flat, group=self.dp_group)
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
        allreduce = time.perf_counter() - t0
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        total = torch.tensor([self.loss_sum], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)  # also the end-of-iteration synchronization of every rank
        return {
            "step": step,
            "loss": float(total.item()),
            "iteration_s": time.perf_counter() - start,
            "busy_s": self.busy,
            "wait_s": self.wait,
            "allreduce_s": allreduce,
        }


def gpp_worker(spec: WorkerSpec) -> dict[str, Any]:
    """The entry point of every rank (started by :func:`tessera.executor.launcher.launch_workers`):
    join the process group, build the stage replica, train ``spec.options.steps`` steps, and return
    the per-step reports (rank 0 returns every rank's, gathered)."""
    rank, device = worker_setup(spec.routing.world_size, spec.backend)
    stage, replica = next(k for k, r in spec.routing.ranks.items() if r == rank)
    # Collectives and receives give up after timeout_s with a descriptive error; the watchdog is the
    # backstop for a rank stuck elsewhere (a hung kernel), a little later so it does not pre-empt them.
    watchdog = Watchdog(WATCHDOG_FACTOR * spec.timeout_s, rank)
    try:
        watchdog.arm("start-up")
        dist.init_process_group(spec.backend, timeout=timedelta(seconds=spec.timeout_s))
        worker = StageWorker(spec, rank, device)
        steps = []
        for k in range(spec.options.steps):
            watchdog.arm(f"step {k}")
            steps.append(worker.step(k))
        watchdog.disarm()
        result: dict[str, Any] = {
            "rank": rank,
            "stage": stage,
            "replica": replica,
            "device": spec.routing.devices[rank],
            "steps": steps,
            "peak_rss_bytes": memory_status("VmHWM"),
            "weight_bytes": worker.weight_bytes,
            "gradient_bytes": worker.weight_bytes,
            "peak_activation_bytes": worker.peak_activation_bytes,
            "base_rss_bytes": worker.rss_base,
        }
        if device.type == "cuda":
            result["peak_device_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        if spec.return_weights and replica == 0:
            result["weights"] = {
                n: p.detach().cpu().numpy().copy() for n, p in worker.module.onnx_parameters()
            }
        gathered: list[Any] | None = [None] * spec.routing.world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if gathered is not None:
            result["all"] = gathered
        return result
    finally:
        watchdog.disarm()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


# -- the launch side -------------------------------------------------------------------------------


@dataclass
class GppRun:
    """What ``tessera launch`` reports for a GPP/SPP plan (``to_json`` is the ``--json`` output)."""

    plan_path: str
    kind: str
    backend: str
    world_size: int
    mini_batch_size: int
    options: TrainOptions
    steps: list[dict[str, Any]]
    stages: list[dict[str, Any]]
    measured: dict[str, float]
    predicted: dict[str, float]
    ratio: dict[str, float]
    weights: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        return [s["loss"] for s in self.steps]

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan_path,
            "kind": self.kind,
            "backend": self.backend,
            "world_size": self.world_size,
            "mini_batch_size": self.mini_batch_size,
            "training": {
                "steps": self.options.steps,
                "optimizer": f"SGD(lr={self.options.lr:g})",
                "loss": "sum over float outputs of mean((output - target)^2); target 0 unless the data gives one",
                "data": self.options.data or f"synthetic (seed {self.options.seed})",
            },
            "steps": self.steps,
            "stages": self.stages,
            "measured": self.measured,
            "predicted": self.predicted,
            "ratio": self.ratio,
        }


def run_gpp_plan(
    plan: GppPlan,
    graph: Graph,
    model_path: str,
    options: TrainOptions,
    launch: LaunchOptions | None = None,
    *,
    plan_path: str = "<plan>",
    return_weights: bool = False,
) -> GppRun:
    """Launch ``plan`` (checked against ``graph`` by the caller) on torch.distributed workers and
    report measured against predicted. Raises LaunchError (exit 4) when a worker fails."""
    launch = launch or LaunchOptions()
    if options.steps < 1:
        raise InputError(f"--steps {options.steps}: must be at least 1")
    check_supported(graph.model, model_path)  # refuse what the workers could not build, before they start
    if options.data is not None:
        _load_npz(options.data, graph, plan.mini_batch_size)  # refuse bad data before starting workers
    routing = build_routing(plan, graph, tensor_layouts(graph, model_path))
    backend = choose_backend(plan.cluster, [d for st in plan.stages for d in st.devices])
    spec = WorkerSpec(
        plan=plan.model_dump(mode="json"),
        model_path=str(Path(model_path).resolve()),
        input_shapes={k: list(v) for k, v in graph.input_shapes.items()},
        routing=routing,
        options=options,
        timeout_s=launch.timeout_s,
        backend=backend,
        return_weights=return_weights,
    )

    def describe(rank: int) -> str:
        stage, replica = next(k for k, r in routing.ranks.items() if r == rank)
        return f"rank {rank} (stage {stage}, replica {replica}, device {routing.devices[rank]})"

    results = launch_workers(gpp_worker, (spec,), routing.world_size, launch, describe_rank=describe)
    mine = results.get(0) or next(iter(results.values()))
    per_rank = mine.get("all") or list(results.values())
    return _report(plan, plan_path, backend, routing, options, per_rank)


def _report(
    plan: GppPlan,
    plan_path: str,
    backend: str,
    routing: Routing,
    options: TrainOptions,
    per_rank: list[dict[str, Any]],
) -> GppRun:
    # Step 0 pays for warm-up (allocator, first-touch pages): averages skip it when there are more.
    counted = list(range(1, options.steps)) if options.steps > 1 else [0]
    # On a node other than 0 of a multi-node launch only this node's ranks are known.
    present = [st for st in plan.stages if any(r["stage"] == st.id for r in per_rank)]
    steps = []
    for k in range(options.steps):
        row = [r["steps"][k] for r in per_rank]
        steps.append(
            {
                "step": k,
                "loss": row[0]["loss"],
                "iteration_s": max(s["iteration_s"] for s in row),
                "busy_s": {str(st.id): _stage_max(per_rank, st.id, k, "busy_s") for st in present},
            }
        )
    stages = []
    for st in present:
        mine = [r for r in per_rank if r["stage"] == st.id]
        busy = float(np.mean([_stage_max(per_rank, st.id, k, "busy_s") for k in counted]))
        peak = max(r["peak_rss_bytes"] for r in mine)
        growth = max(r["peak_rss_bytes"] - r["base_rss_bytes"] for r in mine)
        if mine and "peak_device_memory_bytes" in mine[0]:
            tensors = max(r["peak_device_memory_bytes"] for r in mine)
        else:
            tensors = max(r["weight_bytes"] + r["gradient_bytes"] + r["peak_activation_bytes"] for r in mine)
        p_busy = st.predicted.get("busy_s")
        p_mem = float(st.predicted.get("peak_memory_bytes", st.memory.peak))
        stages.append(
            {
                "id": st.id,
                "devices": st.devices,
                "ranks": sorted(r["rank"] for r in mine),
                "micro_batch_size": st.micro_batch_size,
                "recompute": st.recompute,
                "busy_s": busy,
                "predicted_busy_s": p_busy,
                "busy_ratio": busy / p_busy if p_busy else None,
                "peak_memory_bytes": tensors,
                "predicted_peak_memory_bytes": p_mem,
                "memory_ratio": tensors / p_mem if p_mem else None,
                "peak_activation_bytes": max(r["peak_activation_bytes"] for r in mine),
                "peak_rss_bytes": peak,
                "rss_growth_bytes": growth,
            }
        )
    iteration = float(np.mean([steps[k]["iteration_s"] for k in counted]))
    predicted_iteration = plan.predicted.get("iteration_time_s")
    measured = {
        "iteration_time_s": iteration,
        "throughput_samples_per_s": plan.mini_batch_size / iteration if iteration > 0 else 0.0,
        "final_loss": steps[-1]["loss"],
    }
    predicted = {
        k: float(plan.predicted[k])
        for k in ("iteration_time_s", "throughput_samples_per_s")
        if k in plan.predicted
    }
    ratio = {}
    if predicted_iteration:
        ratio["iteration_time"] = iteration / float(predicted_iteration)
    weights: dict[str, np.ndarray] = {}
    for r in per_rank:
        weights.update(r.get("weights", {}))
    return GppRun(
        plan_path=plan_path,
        kind=plan.kind,
        backend=backend,
        world_size=routing.world_size,
        mini_batch_size=plan.mini_batch_size,
        options=options,
        steps=steps,
        stages=stages,
        measured=measured,
        predicted=predicted,
        ratio=ratio,
        weights=weights,
    )


def _stage_max(per_rank: list[dict[str, Any]], stage: int, step: int, key: str) -> float:
    """A stage's value at a step: the slowest of its replicas (they advance in lockstep)."""
    return max(r["steps"][step][key] for r in per_rank if r["stage"] == stage)
