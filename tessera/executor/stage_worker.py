"""The GPP stage worker: one rank runs one replica of one stage and interprets its schedule.

:func:`~tessera.executor.gpp_worker.gpp_worker` is every rank's entry point. :class:`StageWorker` builds the stage's module
from the plan's subgraph, executes the stage's ``F``/``B`` actions in order (receiving and sending
along the :class:`~tessera.executor.routing.Routing`), all-reduces the replicas' gradients and
takes one SGD step per mini-batch. See docs/executor.md ("GPP stage workers").
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from tessera.backends.torch_module import OnnxModule, to_torch
from tessera.backends.torch_optim import global_norm_clip
from tessera.core.errors import LaunchError
from tessera.core.graph import load_graph
from tessera.core.plans import GppPlan
from tessera.core.tensor_parallel import tensor_parallel
from tessera.core.tp_program import local_model
from tessera.executor.checkpoint import CheckpointSpec
from tessera.executor.gradients import GradBucket
from tessera.executor.launcher import (
    inject_test_fault,
    memory_status,
    own_cores,
)
from tessera.executor.progress import beat
from tessera.executor.routing import Message, Routing, Unit
from tessera.executor.tensor_parallel import tp_group
from tessera.executor.timeline import ALLREDUCE, COMPUTE, WAIT, Timeline
from tessera.executor.training import TrainingData, TrainOptions, labelled, loss_term, make_optimizer
from tessera.executor.zero import ZeroShard, zero_shards
from tessera.planners.pipeline.profile import torch_dtype_of


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
    checkpoint: CheckpointSpec | None = None
    trace: bool = False  # keep a timeline of every action and message (launch --trace)


@dataclass(frozen=True)
class _Receive:
    """One packed message a step receives from rank ``src``: the pieces of ``messages``, in order,
    at ``shapes`` of ``dtypes`` (``sizes`` bytes each)."""

    src: int
    messages: list[Message]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    sizes: list[int]


@dataclass(frozen=True)
class _Posted:
    """A :class:`_Receive` posted for one step: its request and the buffer it fills."""

    work: Any
    flat: Tensor
    receive: _Receive


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
        self.stage_id, self.replica, self.tp_index = routing.place(rank)
        t = routing.tensor_parallel
        self.stage = next(st for st in plan.stages if st.id == self.stage_id)
        self.actions = [(a[0], int(a[1:])) for a in self.stage.schedule.actions]
        self.rss_base = memory_status("VmRSS")
        self.timeline = Timeline() if spec.trace else None
        self.stage_of = {r + i: st for (st, _), r in routing.ranks.items() for i in range(t)}  # rank -> stage
        self.step_index = 0
        graph = load_graph(
            spec.model_path, input_shapes=spec.input_shapes or None, rewrites=plan.model.rewrites
        )
        if graph.sha256 != plan.model.sha256:
            raise LaunchError(
                f"rank {rank}: the model changed since the plan was made", source=spec.model_path
            )
        # Tensor parallelism: this rank's blocks of the stage's split products (executor/tensor_parallel.py).
        self.tp_split = tensor_parallel(graph, t).restrict(self.stage.nodes)
        self.tp_group = tp_group(routing, rank) if t > 1 else None
        sub = local_model(graph, self.stage.nodes, self.tp_split, self.tp_index)
        self.module: OnnxModule = to_torch(
            sub, label=f"stage {self.stage_id}", precision=spec.options.precision
        ).to(device)
        if spec.options.compile:
            self.module.compile_program()
        self.params = [p for _, p in self.module.onnx_parameters()]
        # Activation recomputation (the stage's recompute): the forward keeps only its inputs and
        # outputs, and the backward runs it again (torch.utils.checkpoint).
        self.recompute = self.stage.recompute
        self.data = TrainingData(
            graph, routing.mini_batch, spec.options.seed, spec.options.data, spec.options.loss
        )
        self.graph_inputs = set(graph.inputs)
        # Data-parallel groups: created on every rank in the same order (torch.distributed's rule);
        # with tensor parallelism, one per tensor-parallel index (the replicas' i-th ranks).
        self.dp_group = None
        replicas = {st.id: [routing.ranks[(st.id, q)] for q in range(st.replicas)] for st in plan.stages}
        for i, st in ((i, st) for i in range(t) for st in plan.stages):
            members = sorted(r + i for r in replicas[st.id])
            if len(members) > 1:
                group = dist.new_group(members)
                if st.id == self.stage_id and i == self.tp_index:
                    self.dp_group = group
        # Weights read by several stages (a tied embedding and LM head): every copy's gradient is
        # the sum over all ranks of all those stages, by one all-reduce instead of the stage's
        # data-parallel one, so the copies take the same SGD steps (Megatron's embedding group).
        # Groups are made in the same order on every rank; the all-reduces run in that order.
        shared = graph.shared_weights([st.nodes for st in plan.stages])
        ids = [st.id for st in plan.stages]
        members_of = {w: tuple(sorted(r for i in idx for r in replicas[ids[i]])) for w, idx in shared.items()}
        mine = dict(self.module.onnx_parameters())
        self.shared_groups: list[tuple[Any, list[Tensor]]] = []
        for i, members in ((i, m) for i in range(t) for m in sorted(set(members_of.values()))):
            group = dist.new_group([r + i for r in members])
            if rank - i in members and i == self.tp_index:
                params = [mine[w] for w, m in members_of.items() if m == members and w in mine]
                if params:
                    self.shared_groups.append((group, params))
        tied = {id(p) for _, params in self.shared_groups for p in params}
        # The global gradient norm counts each weight once: on replica 0 of its stage (a split
        # weight on every tensor-parallel rank, a whole one on the first), and a weight several
        # stages hold on the first of them.
        first = {w: ids[min(idx)] for w, idx in shared.items()}
        blocks = self.tp_split.weights
        self.norm_params = [
            p
            for w, p in mine.items()
            if self.replica == 0
            and first.get(w, self.stage_id) == self.stage_id
            and (self.tp_index == 0 or w in blocks)
        ]
        self.dp_params = [p for p in self.params if id(p) not in tied]
        # ZeRO-1 (the stage's zero): the replicas shard the optimizer state of the weights they
        # sum over the data-parallel group; a tied weight keeps its whole state (executor/zero.py).
        self.zeros: list[ZeroShard] = []
        self.sharded: list[tuple[str, Tensor]] = []  # checkpoints keep a shard's state by its name
        if self.stage.zero and self.dp_group is not None and self.dp_params:
            named, counted = zero_shards(
                self.dp_params,
                {id(p) for w, p in mine.items() if w in blocks} if t > 1 else None,
                self.dp_group,
                self.tp_index,
                f"zero/stage{self.stage_id}/replica{self.replica}",
                spec.timeout_s,
            )
            self.zeros = [z for _, z in named]
            self.sharded = [(n, z.shard) for n, z in named]
            self.norm_params = [*counted, *(p for p in self.norm_params if id(p) in tied)]
        stepped = (
            [*(z.shard for z in self.zeros), *(p for p in self.params if id(p) in tied)]
            if self.zeros
            else self.params
        )
        self.stepped = stepped  # what the optimizer steps (and the clip scales)
        self.opt, self.schedule = make_optimizer(stepped, spec.options) if stepped else (None, None)
        dp_summed = self.dp_group is not None and self.dp_params and not self.zeros
        groups = [(self.dp_group, self.dp_params)] if dp_summed else []
        # A rank on cores of its own spins (yielding) on its all-reduces rather than sleeping in
        # them (GradBucket.all_reduce).
        gloo_yields = spec.backend == "gloo" and hasattr(os, "sched_yield")
        self.buckets = [
            GradBucket(params, group, gloo_yields and own_cores())
            for group, params in [*groups, *self.shared_groups]
        ]
        # Gradients go over connections of their own, activations over the default group's: over
        # one gloo connection, two ranks sending to each other at once (an activation one way, a
        # gradient the other) both stalled in isend for 2-5 ms, until a scheduler tick (GPT-2's
        # two-stage plans: a step in two; docs/executor.md, "Fidelity"). Made on every rank.
        self.backward_group = (
            dist.new_group(list(range(dist.get_world_size())))
            if spec.backend == "gloo" and len(plan.stages) > 1
            else None
        )
        self._sends: list[tuple[Any, Tensor]] = []
        self._posted: dict[tuple[int, bool], list[_Posted]] = {}  # (micro-batch, backward) → receives
        self.receives = self._receives()
        self._next_posted: dict[tuple[int, bool], list[_Posted]] | None = None
        self.sends = {(j, kind == "B"): self._sends_of(j, kind == "B") for kind, j in self.actions}
        self.sent = sum(len(v) for v in self.sends.values())  # messages per step
        self.messages = len(self.receives) + self.sent
        # A rank that exchanges messages over gloo yields its core to gloo's thread (_let_gloo_run).
        self.yields = gloo_yields and self.messages > 0
        # Tensor memory as the planner models it (Eq. 3.2): weights + gradients (plain SGD keeps no
        # optimizer state) + the activations of the micro-batches in flight, at their peak.
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self._param_storages = {p.untyped_storage().data_ptr() for p in self.params}
        self.peak_activation_bytes = 0

    # -- communication (tags: one per message, direction and step parity) --

    def _tag(self, msg: Message, backward: bool, step: int) -> int:
        return msg.id * 4 + (step % 2) * 2 + int(backward)

    def _group(self, backward: bool) -> Any:
        """The process group of a message: the gradients' own, or (activations) the default."""
        return self.backward_group if backward else None

    def _axis(self, tensor: str) -> int:
        """The axis of ``tensor`` whose rows the messages carry (its batch axis)."""
        return self.routing.layouts[tensor].axis

    def _packed(self, j: int, backward: bool, *, sending: bool) -> dict[Unit, list[Message]]:
        """The messages micro-batch ``j``'s forward or backward sends (``sending``) or receives, by
        peer unit, in the order they are packed (:meth:`Routing.packs`). A forward receives along its
        incoming edges and sends along its outgoing ones; a backward, gradients the other way."""
        unit = Unit(self.stage_id, self.replica, j)
        inbound = sending == backward
        msgs = (self.routing.incoming if inbound else self.routing.outgoing).get(unit, [])
        if backward:
            msgs = [m for m in msgs if m.grad]
        return self.routing.packs(msgs, inbound)

    def _sends_of(self, j: int, backward: bool) -> list[tuple[int, Message, list[Message]]]:
        """What micro-batch ``j``'s forward (its outputs) or backward (its inputs' gradients) sends:
        (peer rank, the message that tags it, the messages packed in it), what :meth:`_receives`
        expects. The same every step."""
        return [
            (self.routing.rank_of(other, self.tp_index), members[0], members)
            for other, members in self._packed(j, backward, sending=True).items()
        ]

    def _send(self, j: int, backward: bool, step: int, piece: Callable[[Message], Tensor]) -> None:
        """Send micro-batch ``j``'s messages to each peer packed into one buffer of bytes
        (:meth:`_sends_of`; ``piece``: a message's tensor), whatever their dtypes, since every
        message costs its ends' time and a latency that a pipeline pays on its critical path
        (docs/executor.md, "Fidelity"). A message of one contiguous piece goes without a copy."""
        for rank, first, members in self.sends[(j, backward)]:
            flat = [piece(m).detach().reshape(-1).contiguous().view(torch.uint8) for m in members]
            payload = flat[0] if len(flat) == 1 else torch.cat(flat)
            t0 = time.perf_counter()
            work = dist.isend(
                payload, rank, tag=self._tag(first, backward, step), group=self._group(backward)
            )
            self._sends.append((work, payload))
            if self.timeline is not None:
                name, stream = _transfer(backward, j, f"send → stage {self.stage_of[rank]}")
                self.timeline.add(
                    step, stream, name, t0, time.perf_counter(), (step, backward, j, self.rank, rank)
                )
        if self.sends[(j, backward)]:
            self._let_gloo_run()

    def _let_gloo_run(self) -> None:
        """Give this rank's core to gloo's thread for a moment. gloo sends a message once that
        thread has read the receiver's "ready to receive", and with a core per rank it waits for
        the compute thread to be preempted — up to a scheduler tick (4 ms here): a message sent
        while this rank went on computing left only when it next waited, and one step in three of a
        two-stage plan took 3–5 ms more (docs/executor.md, "Fidelity"). Yielding after the sends
        and before each action costs a system call when nothing else is runnable."""
        if self.yields:
            os.sched_yield()

    def _receives(self) -> list[tuple[tuple[int, bool], _Receive]]:
        """Every packed message (one per :meth:`_send`) this rank receives in a step, in the order
        of its actions: ((micro-batch, backward), what to post). The same every step."""
        found = []
        for kind, j in self.actions:
            backward = kind == "B"
            for other, members in self._packed(j, backward, sending=False).items():
                shapes = [self.routing.layouts[m.tensor].shape(m.samples) for m in members]
                dtypes = [torch_dtype_of(self.routing.layouts[m.tensor].dtype) for m in members]
                sizes = [
                    int(np.prod(shape)) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)
                ]
                receive = _Receive(self.routing.rank_of(other, self.tp_index), members, shapes, dtypes, sizes)
                found.append(((j, backward), receive))
        return found

    def _post_receives(self, step: int) -> dict[tuple[int, bool], list[_Posted]]:
        """Post every receive of ``step`` (``irecv``, one per packed message :meth:`_send` sends)
        before its first action, so each message is copied in as it arrives while this rank
        computes, not when its action asks for it: gloo writes a message once its receive is
        posted, and a sender that must wait for that wakes for it between its own computations."""
        posted: dict[tuple[int, bool], list[_Posted]] = {key: [] for key, _ in self.receives}
        for key, r in self.receives:
            flat = torch.empty((sum(r.sizes),), dtype=torch.uint8, device=self.device)
            work = dist.irecv(
                flat, r.src, tag=self._tag(r.messages[0], key[1], step), group=self._group(key[1])
            )
            posted[key].append(_Posted(work, flat, r))
        return posted

    def _wait_received(self, j: int, backward: bool, what: str) -> dict[int, Tensor]:
        """Micro-batch ``j``'s posted receives (its inputs, or with ``backward`` its outputs'
        gradients), waited for and cut where :meth:`_send` joined them: message id → piece (a view)."""
        got: dict[int, Tensor] = {}
        for p in self._posted.pop((j, backward), []):
            r = p.receive
            t0 = time.perf_counter()
            try:
                p.work.wait()
            except Exception as exc:  # say what was awaited from whom: the peer is the likely culprit
                names = ", ".join(repr(m.tensor) for m in r.messages)
                raise RuntimeError(
                    f"waiting for {what} of {names} from rank {r.src}: {' '.join(str(exc).split())}"
                ) from exc
            if self.timeline is not None:
                name, stream = _transfer(backward, j, f"receive ← stage {self.stage_of[r.src]}")
                key = (self.step_index, backward, j, r.src, self.rank)
                self.timeline.add(self.step_index, stream, name, t0, time.perf_counter(), key)
            pieces = p.flat.split(r.sizes)
            for m, piece, dtype, shape in zip(r.messages, pieces, r.dtypes, r.shapes, strict=True):
                got[m.id] = piece.view(dtype).view(shape)
        return got

    # -- the two actions --

    def _received(
        self, unit: Unit, inputs: Mapping[str, np.ndarray], rows: tuple[int, int], step: int
    ) -> tuple[dict[str, Tensor], dict[int, Tensor]]:
        """The stage's inputs of micro-batch ``unit``: rows of the data, or received from producers
        (leaves that need a gradient back, by message id)."""
        lo, hi = rows
        j = unit.micro_batch
        by_tensor: dict[str, list[Message]] = {}
        for msg in self.routing.incoming.get(unit, []):
            by_tensor.setdefault(msg.tensor, []).append(msg)
        feeds: dict[str, Tensor] = {}
        leaves: dict[int, Tensor] = {}
        got = self._wait_received(j, False, f"micro-batch {j} (step {step})")
        for t in self.routing.stage_inputs[self.stage_id]:
            if t in self.graph_inputs:
                feeds[t] = torch.from_numpy(inputs[t][lo:hi]).to(self.device)
                continue
            pieces = []
            for msg in sorted(by_tensor[t], key=lambda m: m.dst_rows or (0, 0)):
                buf = got[msg.id].detach()  # a leaf of its own (its gradient goes back); no copy:
                # each step receives into buffers of its own
                if msg.grad:
                    buf.requires_grad_(True)
                leaves[msg.id] = buf
                pieces.append(buf)
            feeds[t] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self._axis(t))
        return feeds, leaves

    def forward(
        self, j: int, step: int, inputs: Mapping[str, np.ndarray], targets: Mapping[str, np.ndarray]
    ) -> None:
        unit = Unit(self.stage_id, self.replica, j)
        lo, hi = self.routing.ranges[self.stage_id][j][self.replica]
        t0 = time.perf_counter()
        feeds, leaves = self._received(unit, inputs, (lo, hi), step)
        t1 = time.perf_counter()
        held: dict[int, int] = {}
        # Activation memory is counted in the first step only (every step holds the same): the
        # hook costs a Python call per saved tensor, which later steps' busy time should not carry.
        counting = step == 0

        def pack(t: Tensor) -> Tensor:
            _storages([t], held, self._param_storages)
            return t

        hooks = (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            if counting
            else contextlib.nullcontext()
        )
        with hooks:
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
                kind=self.spec.options.loss,
                labels=self.labels,
            )
            if term is not None:
                loss = term if loss is None else loss + term
        if loss is not None:
            self.loss_sum += float(loss.detach())
        t2 = time.perf_counter()
        self._send(j, False, step, lambda m: _rows(outputs[m.tensor], m.src_rows, self._axis(m.tensor)))
        if counting:
            _storages([*leaves.values(), *outputs.values()], held, self._param_storages)
        self.saved[j] = _Saved(leaves, outputs, loss, sum(held.values()))
        if counting:
            live = sum(x.activation_bytes for x in self.saved.values())
            self.peak_activation_bytes = max(self.peak_activation_bytes, live)
        self.busy += t2 - t1
        self.forward_busy += t2 - t1
        self.wait += t1 - t0
        self._record(step, f"F{j}", t0, t1, t2)

    def backward(self, j: int, step: int) -> None:
        unit = Unit(self.stage_id, self.replica, j)
        saved = self.saved.pop(j)
        t0 = time.perf_counter()
        grads: dict[str, Tensor] = {}
        back = [m for m in self.routing.outgoing.get(unit, []) if m.grad]
        got = self._wait_received(j, True, f"the gradients of micro-batch {j} (step {step})")
        copied: set[str] = set()  # gradients accumulated in a buffer of their own
        for msg in back:
            out = saved.outputs[msg.tensor]
            piece = got[msg.id]
            axis = self._axis(msg.tensor)
            whole = msg.src_rows is None or msg.src_rows == (0, out.shape[axis])
            if whole and msg.tensor not in grads:
                grads[msg.tensor] = piece.view_as(out)  # the whole gradient in one message: no copy
                continue
            if msg.tensor not in copied:
                first = grads.get(msg.tensor)
                grads[msg.tensor] = torch.zeros_like(out) if first is None else first.clone()
                copied.add(msg.tensor)
            g = grads[msg.tensor]
            if msg.src_rows is None:
                g += piece
            else:
                _rows(g, msg.src_rows, axis).add_(piece)
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
        # The micro-batch's autograd graph goes with its outputs, here: freeing it is the
        # backward's work (as the stage profiler counts it), not the executor's overhead.
        del roots, root_grads, grads
        saved.outputs.clear()
        saved.loss = None
        t2 = time.perf_counter()
        self._send(j, True, step, lambda m: _grad(saved.leaves[m.id]))
        self.busy += t2 - t1
        self.wait += t1 - t0
        self._record(step, f"B{j}", t0, t1, t2)

    def _record(self, step: int, action: str, t0: float, t1: float, t2: float) -> None:
        """An action's wait for its inputs (``t0``-``t1``) and its compute (``t1``-``t2``)."""
        if self.timeline is not None:
            self.timeline.add(step, WAIT, "wait", t0, t1)
            self.timeline.add(step, COMPUTE, action, t1, t2)

    # -- one training step --

    def step(self, step: int, *, more: bool = False) -> dict[str, float]:
        """Train on mini-batch ``step``; ``more``: another step follows (its receives are posted
        as soon as this step's last action is done, before the next step's first message leaves)."""
        inject_test_fault(self.rank, step)
        start = time.perf_counter()
        self.step_index = step
        self.busy = self.forward_busy = self.wait = self.loss_sum = 0.0
        self.saved: dict[int, _Saved] = {}
        inputs, targets = self.data.batch(step)
        self.labels = labelled(targets)  # a cross-entropy's divisor: the whole mini-batch's labels
        t0 = time.perf_counter()
        self._posted = self._next_posted if self._next_posted is not None else self._post_receives(step)
        self._next_posted = None
        # The time the actions spend on neither compute nor waiting (the messages' handling, the
        # bookkeeping around them) and posting receives: the executor's overhead, which
        # `tessera calibrate` measures per message from these numbers.
        overhead = time.perf_counter() - t0
        for kind, j in self.actions:
            t0, busy, wait = time.perf_counter(), self.busy, self.wait
            beat()
            self._let_gloo_run()
            if kind == "F":
                self.forward(j, step, inputs, targets)
            else:
                self.backward(j, step)
            overhead += time.perf_counter() - t0 - (self.busy - busy) - (self.wait - wait)
        if more:
            t0 = time.perf_counter()
            self._next_posted = self._post_receives(step + 1)
            overhead += time.perf_counter() - t0
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        allreduce = self._update(step)
        # No end-of-step barrier: a stage starts its next step as soon as its own is done (its
        # next inputs wait on their producers anyway); the losses are summed once, after the run.
        return {
            "step": step,
            "loss": self.loss_sum,  # this rank's part (summed over the ranks by :func:`_total_losses`)
            "iteration_s": time.perf_counter() - start,
            "busy_s": self.busy,
            "forward_busy_s": self.forward_busy,  # the forwards' part of busy_s
            "wait_s": self.wait,
            "overhead_s": overhead,
            "messages": self.messages,
            "messages_sent": self.sent,
            "actions": len(self.actions),
            "allreduce_s": allreduce,
        }

    def _update(self, step: int) -> float:
        """Sum the gradients (reduce-scatter a ZeRO shard's), clip, step the optimizer, gather a
        ZeRO shard's weights; the seconds spent in collectives."""
        t0 = time.perf_counter()
        for z in self.zeros:
            z.reduce_scatter()
        for bucket in self.buckets:
            bucket.all_reduce()
        allreduce = time.perf_counter() - t0
        t1 = time.perf_counter()
        if self.spec.options.max_grad_norm is not None:  # every rank joins: the norm is global
            global_norm_clip(self.norm_params, self.stepped, self.spec.options.max_grad_norm)
        if self.opt is not None and self.schedule is not None:
            self.opt.step()
            self.schedule.step()
            # Buckets' and shards' gradient views stay, zeroed.
            self.opt.zero_grad(set_to_none=not self.buckets and not self.zeros)
        t2 = time.perf_counter()
        for z in self.zeros:
            z.all_gather()
            z.zero_grad()
        allreduce += time.perf_counter() - t2
        if self.timeline is not None:
            if self.buckets or self.zeros:
                name = "reduce-scatter" if self.zeros else "all-reduce"
                self.timeline.add(step, ALLREDUCE, name, t0, t1)
            self.timeline.add(step, COMPUTE, "optimizer step", t1, t2)
            if self.zeros:
                self.timeline.add(step, ALLREDUCE, "all-gather", t2, time.perf_counter())
        return allreduce


def _rows(t: Tensor, rows: tuple[int, int] | None, axis: int = 0) -> Tensor:
    """Rows ``[lo, hi)`` of ``t``'s batch ``axis`` as a view (None: the whole tensor)."""
    return t if rows is None else t.narrow(axis, rows[0], rows[1] - rows[0])


def _grad(leaf: Tensor) -> Tensor:
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def _transfer(backward: bool, j: int, stream: str) -> tuple[str, str]:
    return f"{'gradients' if backward else 'activations'} {j}", stream
