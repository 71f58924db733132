"""Stages measured as the executor runs them (``tessera plan --profile``): each stage of the chosen
pipeline built as the stage workers build it (the program of ``Graph.extract``) and run step after
step as a rank runs it: the mini-batch's data drawn, the stage's schedule of forwards and backwards
at its replicas' micro-batch with the device's threads, the optimizer step; a tensor-parallel
stage as its ``t`` ranks run it (gloo processes, each with its block of the split). Cached in the
profile cache, so a warm run predicts the same. Why: docs/executor.md ("Fidelity").
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from tessera.backends.base import cpu_cores, torch_threads
from tessera.core.cost import per_device_samples
from tessera.core.data import TrainingData
from tessera.core.graph import Graph
from tessera.core.schedule import gpipe
from tessera.core.specs import ClusterSpec, DeviceType
from tessera.planners.pipeline.profile import digest, torch_device_for
from tessera.planners.pipeline.stage_ranks import SplitJob, SplitStage, run_ranks, split_measurable
from tessera.planners.pipeline.stage_step import StageProfileOptions, StageRun, one_step, stage_run
from tessera.planners.pipeline.tensor_parallel import group_devices
from tessera.planners.pipeline.types import Pipeline, PipelineStage

if TYPE_CHECKING:
    import onnx
    import torch

    from tessera.backends.profile_cache import ProfileCache
    from tessera.backends.torch_module import OnnxModule

# A tensor-parallel stage's rows: its ranks' processes, a step's part the slowest rank's.
SPLIT_RECIPE = "on its ranks, each step's slowest"
# A stage measured beside its replicas' ranks (each a whole copy): a step's part the slowest replica's.
BESIDE_RECIPE = "at once, each step's slowest"
STAGE_BACKENDS = ("torch-train.stage.forward", "torch-train.stage.backward", "torch-train.stage.step")
# In the cache key: rows measured another way are not reused.
RECIPE = "in context: the data drawn, the schedule's actions, the optimizer step (fused where it can be)"


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one replica: forward and backward of one micro-batch (the mean over a step's),
    and the step's own work (drawing the data, the optimizer step)."""

    forward: float
    backward: float
    step: float


def stages_measurable(device_type: DeviceType) -> bool:
    """Whether this machine can run stages as ``device_type`` would: a CPU, or a GPU torch sees."""
    return device_type.kind == "cpu" or torch_device_for(device_type) == "cuda"


class StageProfiler:
    """``refine(pipe)``: ``pipe`` with every stage's forward, backward and step times measured."""

    def __init__(
        self,
        graph: Graph,
        device_type: DeviceType,
        cache: ProfileCache,
        options: StageProfileOptions | None = None,
        *,
        cluster: ClusterSpec | None = None,
        optimizer: str = "sgd",
        loss: str = "mse",
        max_grad_norm: float | None = None,
    ) -> None:
        import torch

        from tessera.backends.profile_cache import device_fingerprint

        self.graph, self.cache = graph, cache
        self.action_overhead = device_type.action_overhead
        self.contention = device_type.contention_overhead
        self.replica_contention = device_type.replica_contention
        self.cluster = cluster  # where the plan's devices are (the node each rank shares)
        self.options = options or StageProfileOptions()
        self.optimizer = optimizer  # whose step each measured step takes (torch_optim)
        self.loss = loss  # "ce": the model's outputs scored by cross-entropy, as launch --loss ce
        self.max_grad_norm = max_grad_norm  # each step clips its gradients' norm, as launch --max-grad-norm
        # A GPU cluster's stages run on this machine's GPU (fp32, as the workers train), timed to
        # the end of their kernels; a CPU cluster's with the device type's threads.
        self.device = torch_device_for(device_type)
        self.threads = int(device_type.cores) if device_type.kind == "cpu" and device_type.cores else None
        threads = self.threads or torch.get_num_threads()
        label = (
            f"cuda ({torch.cuda.get_device_name(self.device)})"
            if self.device == "cuda"
            else f"cpu, {threads} thread{'' if threads == 1 else 's'}"
        )
        self.fingerprint = device_fingerprint(f"torch {label}")
        self.version = str(torch.__version__)
        self.measured = 0  # stages timed in this run (the others came from the cache)
        self._model: OnnxModule | None = None  # the whole model, computing stages' inputs

    def refine(self, pipe: Pipeline, tensor_parallel: int = 1) -> Pipeline:
        return self.refine_all([pipe], tensor_parallel)[0]

    def refine_all(self, pipes: Sequence[Pipeline], tensor_parallel: int = 1) -> list[Pipeline]:
        """``pipes`` with their stages measured together, their bursts in turns
        (:meth:`_times`): pipelines a planner compares (a plan and its sequential rival, a
        benchmark's plans of one model) take the host's drift alike, so it cannot order them.
        ``tensor_parallel`` t > 1: ``pipes`` are planned on t-device groups (each stage device a
        group, :func:`~tessera.planners.pipeline.tensor_parallel.group_cluster`), and each stage is
        measured on t ranks; unchanged where this machine cannot run t ranks of the device (fewer
        GPUs than t)."""
        if tensor_parallel > 1 and not split_measurable(self.device, tensor_parallel):
            return list(pipes)
        t = tensor_parallel
        placed = [(p, *self._sharing(p, t)) for p in pipes]
        requests = [
            self._request(st, p.mini_batch_size, t, self._beside(replicas.get(st.id, 1), t))
            for p, _, replicas in placed
            for st in p.stages
        ]
        measured = iter(zip(requests, self._times(requests), strict=True))
        # A stage is measured alone, or with its replicas that share a node beside it where this
        # machine runs them (each on cores of its own, in lockstep): their contention for the
        # caches and memory is in its times then, and depends on the stage (-7% to +8% for
        # compute-bound products, +21-31% for memory-bound ones on a 2-core VM). Measured alone, a rank
        # that shares its node with other ranks of the plan computes each action slower by the
        # device's contention_overhead, and replicas on a node by its replica_contention, a
        # fraction of the action (docs/executor.md).
        refined = []
        for pipe, sharing, replicas in placed:
            stages = []
            for st in pipe.stages:
                request, times = next(measured)
                added = (0.0, 0.0) if request.replicas > 1 else self._contention(st.id, sharing, replicas)
                stages.append(self._refined(st, times, *added))
            refined.append(dataclasses.replace(pipe, stages=stages))
        return refined

    def _beside(self, replicas: int, t: int) -> int:
        """The replicas a stage is measured with (itself included): all of a node's, where this
        machine's cores run them at once at the device's threads (a CPU stage, not tensor-parallel),
        else 1."""
        fits = self.device == "cpu" and t == 1 and replicas * (self.threads or 1) <= cpu_cores()
        return replicas if replicas > 1 and fits else 1

    def _sharing(self, pipe: Pipeline, t: int) -> tuple[set[int], dict[int, int]]:
        """The stages with a rank on a node where another rank of ``pipe`` runs, and those with
        two replicas or more on one node, each with the most replicas a node holds (none without
        the cluster, which says where each device is); ``t`` > 1: ``pipe``'s devices are t-device
        groups, each on its first device's node."""
        if self.cluster is None:
            return set(), {}
        node = {
            d: self.cluster.device(d if t == 1 else group_devices([d], t)[0]).node
            for st in pipe.stages
            for d in st.devices
        }
        ranks = Counter(node.values())
        sharing = {st.id for st in pipe.stages if any(ranks[node[d]] > 1 for d in st.devices)}
        most = {st.id: max(Counter(node[d] for d in st.devices).values()) for st in pipe.stages}
        return sharing, {stage: n for stage, n in most.items() if n > 1}

    def _contention(self, stage: int, sharing: set[int], replicated: Container[int]) -> tuple[float, float]:
        """What ``stage``'s actions add: (seconds, fraction of the action). A spec calibrated
        before replica_contention was measured charges replicas the per-action seconds."""
        if stage in replicated and self.replica_contention:
            return 0.0, self.replica_contention
        return (self.contention if stage in sharing else 0.0), 0.0

    def _refined(self, st: PipelineStage, t: StageTimes, contention: float, fraction: float) -> PipelineStage:
        backward = t.backward + (t.forward if st.recompute else 0.0)
        return dataclasses.replace(
            st,
            forward_time=t.forward * (1 + fraction) + contention,
            backward_time=backward * (1 + fraction) + contention,
            step_time=t.step,
            action_overhead=self.action_overhead,
        )

    def _request(self, st: PipelineStage, mini_batch: int, t: int, replicas: int = 1) -> _Request:
        samples = per_device_samples(st.micro_batch_size, len(st.devices))
        actions = tuple(st.schedule or gpipe(mini_batch // st.micro_batch_size))
        return _Request(tuple(st.nodes), samples, actions, mini_batch, t, replicas)

    def times(self, nodes: list[str], samples: int, actions: tuple[str, ...], mini_batch: int) -> StageTimes:
        """The stage of ``nodes`` running ``actions`` (``F0``, ``B0``, … a step) at ``samples``
        samples per micro-batch, drawing a ``mini_batch`` of data each step: cached, else measured."""
        return self._times([_Request(tuple(nodes), samples, actions, mini_batch)])[0]

    def _key(self, request: _Request) -> str:
        nodes, samples, actions, mini_batch, t, replicas = request
        recipe = RECIPE + "".join(f" ({x})" for x in (self.optimizer, self.loss) if x not in ("sgd", "mse"))
        recipe += " (clipped)" if self.max_grad_norm is not None else ""
        recipe += f" (tensor-parallel {t}: {SPLIT_RECIPE})" if t > 1 else ""
        recipe += f" ({replicas} replicas: {BESIDE_RECIPE})" if replicas > 1 else ""
        return digest([self._model_key(), sorted(nodes), samples, list(actions), mini_batch, recipe])

    def _cached(self, request: _Request) -> StageTimes | None:
        key = self._key(request)
        cached = [self.cache.get(b, self.version, self.fingerprint, key) for b in STAGE_BACKENDS]
        if all(c is not None and c.ok for c in cached):
            return StageTimes(*(c.median_s for c in cached))  # type: ignore[union-attr]
        return None

    def _times(self, requests: list[_Request]) -> list[StageTimes]:
        """Each request's times: from the cache, else measured, the missing ones' bursts taken in
        turns (stage 0's first burst, stage 1's, …, then the second round). A shared host's speed
        drifts over seconds (a stage measured 8.7 to 11.5 ms a step within one second): turns
        spread each stage's bursts over the whole measurement and give a plan's stages the same
        drift, so their balance is measured fairly."""
        from tessera.backends.profile_cache import Profile

        found = {r: self._cached(r) for r in requests}
        missing = [r for r, t in found.items() if t is None]
        whole = [r for r in missing if r.tensor_parallel == r.replicas == 1]
        split = [r for r in missing if r.tensor_parallel > 1]  # on their ranks (one t per call)
        beside = sorted({r.replicas for r in missing if r.replicas > 1})  # on their replicas' ranks
        groups = [[r for r in missing if r.replicas == n] for n in beside]
        taken = (self._measure(whole) if whole else []) + (self._measure_split(split) if split else [])
        taken += [b for group in groups for b in self._measure_beside(group)]
        for request, measured in zip(whole + split + [r for g in groups for r in g], taken, strict=True):
            self.measured += 1
            seconds = [statistics.median(statistics.median(b[part]) for b in measured) for part in range(3)]
            repeats = sum(len(b[0]) for b in measured)
            key = self._key(request)
            for backend, value in zip(STAGE_BACKENDS, seconds, strict=True):
                self.cache.put(Profile(backend, self.version, self.fingerprint, key, value, 0.0, repeats))
            found[request] = StageTimes(*seconds)
        return [found[r] for r in requests]  # type: ignore[misc]

    def _model_key(self) -> list[object]:
        """What the model's stages depend on: its bytes, the shapes given and the rewrites applied."""
        g = self.graph
        return [g.sha256, sorted((k, list(v)) for k, v in g.input_shapes.items()), list(g.rewrites)]

    def _measure(self, requests: list[_Request]) -> list[list[tuple[list[float], ...]]]:
        """Per request, per burst, the seconds of each timed step: (forwards, backwards, own parts)."""
        runs = [self._runner(r) for r in requests]
        bursts: list[list[tuple[list[float], ...]]] = [[] for _ in runs]
        with torch_threads(self.threads):
            for burst in range(self.options.bursts):
                for run, taken in zip(runs, bursts, strict=True):
                    taken.append(self._burst(run, warmup=self.options.warmup if burst == 0 else 0))
        return bursts

    def _measure_split(self, requests: list[_Request]) -> list[list[tuple[list[float], ...]]]:
        """Per request, per burst, the seconds of each timed step of its stage run by its ``t``
        tensor-parallel ranks (a step's part: the slowest rank's), each rank a process with the
        device's threads, its collectives over gloo (NCCL on GPUs). The same ranks run every
        request's stage, their bursts in turns (as :meth:`_times` takes whole stages')."""
        from tessera.core.tensor_parallel import tensor_parallel
        from tessera.core.tp_program import local_model

        t = requests[0].tensor_parallel
        whole = tensor_parallel(self.graph, t)
        return self._on_ranks(
            requests,
            t,
            lambda nodes: [local_model(self.graph, nodes, whole.restrict(nodes), i) for i in range(t)],
        )

    def _measure_beside(self, requests: list[_Request]) -> list[list[tuple[list[float], ...]]]:
        """As :meth:`_measure_split`, each request's stage whole on each of its ``replicas`` ranks
        (a step's part: the slowest replica's; the ranks meet after every step, as replicas do at
        their gradients' all-reduce, which the plan's all-reduce time counts)."""
        n = requests[0].replicas
        return self._on_ranks(requests, n, lambda nodes: [self.graph.extract(list(nodes))] * n)

    def _on_ranks(
        self,
        requests: list[_Request],
        ranks: int,
        models_of: Callable[[tuple[str, ...]], list[onnx.ModelProto]],
    ) -> list[list[tuple[list[float], ...]]]:
        """Per request, per burst, each timed step's parts (the slowest rank's) of its stage run
        on ``ranks`` processes at once, rank i running ``models_of(nodes)[i]``."""
        stages = []
        for nodes, samples, actions, mini_batch, *_ in requests:
            models = models_of(nodes)
            kept = {i.name for i in models[0].graph.initializer}
            names = tuple(i.name for i in models[0].graph.input if i.name not in kept)
            values = [x.detach().cpu() for x in self._inputs(names, samples)]
            serialized = {id(m): m.SerializeToString() for m in models}  # a copy each serialized once
            stages.append(
                SplitStage(
                    models=[serialized[id(m)] for m in models],
                    feeds=dict(zip(names, values, strict=True)),
                    grads=frozenset(n for n in names if n not in self.graph.inputs),
                    actions=actions,
                    data=TrainingData(self.graph, mini_batch),
                )
            )
        job = SplitJob(
            stages=stages,
            scored=self._scored_outputs(),
            optimizer=self.optimizer,
            max_grad_norm=self.max_grad_norm,
            threads=self.threads or 1,
            device=self.device,
            options=self.options,
        )
        per_rank = run_ranks(job, ranks)
        return [
            [
                tuple(
                    [max(steps) for steps in zip(*(r[k][b][part] for r in per_rank), strict=True)]
                    for part in range(3)
                )
                for b in range(self.options.bursts)
            ]
            for k in range(len(requests))
        ]

    def _runner(self, request: _Request) -> StageRun:
        from tessera.backends.torch_module import to_torch

        nodes, samples, actions, mini_batch, *_ = request
        module = to_torch(self.graph.extract(list(nodes)), label="stage").to(self.device)
        return stage_run(
            module,
            self._inputs(module.input_names, samples),
            actions,
            TrainingData(self.graph, mini_batch),
            optimizer=self.optimizer,
            scored_outputs=self._scored_outputs(),
            max_grad_norm=self.max_grad_norm,
            device=self.device,
        )

    def _scored_outputs(self) -> frozenset[str]:
        """The outputs the loss scores by cross-entropy: the model's, with launch --loss ce."""
        return frozenset(self.graph.outputs) if self.loss == "ce" else frozenset()

    def _burst(self, run: StageRun, warmup: int) -> tuple[list[float], ...]:
        """Steps of ``run`` until the budget is spent (at least ``min_repeats``), the first
        ``warmup`` left out."""
        o = self.options
        times: tuple[list[float], list[float], list[float]] = ([], [], [])
        spent = 0.0
        while o.more(len(times[0]), spent, warmup):
            start = time.perf_counter()
            draw = functools.partial(run.data.batch, run.step)
            parts = one_step(run, draw)
            spent, run.step = spent + time.perf_counter() - start, run.step + 1
            for values, value in zip(times, parts, strict=True):
                values.append(value)
        return tuple(values[warmup:] for values in times)

    def _inputs(self, names: tuple[str, ...], samples: int) -> list[torch.Tensor]:
        """The stage's inputs at ``samples`` samples, computed by the whole model from the first
        mini-batch the workers train on (:class:`~tessera.core.data.TrainingData`: token ids
        spread over the embedding's rows, as in training, not all one row)."""
        import torch

        from tessera.backends.torch_module import to_torch

        if self._model is None:
            self._model = to_torch(self.graph.model, label=self.graph.source)
        drawn, _ = TrainingData(self.graph, samples).batch(0)
        feeds = {name: torch.from_numpy(drawn[name]) for name in self._model.input_names}
        with torch.no_grad():
            values = self._model.run(feeds, tensors=names)
        # As in a worker: the model's own inputs (data) need no gradient, received activations do.
        return [
            v.detach()
            .to(self.device, copy=True)
            .requires_grad_(v.is_floating_point() and name not in self.graph.inputs)
            for name, v in values.items()
        ]


class _Request(NamedTuple):
    nodes: tuple[str, ...]
    samples: int
    actions: tuple[str, ...]
    mini_batch: int
    tensor_parallel: int = 1
    replicas: int = 1  # measured with this many replicas at once (itself included)


class RefineFn(Protocol):
    """Pipelines with their stages measured together (:meth:`StageProfiler.refine_all`); with
    ``tensor_parallel`` t > 1, pipelines of t-device groups, each stage measured on its t ranks."""

    def __call__(self, pipes: Sequence[Pipeline], tensor_parallel: int = 1) -> list[Pipeline]: ...
