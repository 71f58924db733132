"""Stages measured as the executor runs them (``tessera plan --profile``): each stage of the chosen
pipeline built as the stage workers build it (the program of ``Graph.extract``), timed forward and
backward at its replicas' micro-batch with the device's threads, and its optimizer step; cached in
the profile cache, so a warm run predicts the same. Why: docs/executor.md ("Fidelity").
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.core.cost import per_device_samples
from tessera.core.data import TrainingData
from tessera.core.graph import Graph
from tessera.core.specs import DeviceType
from tessera.planners.pipeline.profile import digest
from tessera.planners.pipeline.types import Pipeline, PipelineStage

if TYPE_CHECKING:
    import torch

    from tessera.backends.profile_cache import ProfileCache
    from tessera.backends.torch_module import OnnxModule

STAGE_BACKENDS = ("torch-train.stage.forward", "torch-train.stage.backward", "torch-train.stage.step")
DATA_BACKEND = "torch-train.data"
RECIPE = "inputs: the training data"  # in the cache key: rows measured another way are not reused


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one replica: forward and backward of one micro-batch, and the optimizer step."""

    forward: float
    backward: float
    step: float


@dataclass(frozen=True)
class StageProfileOptions:
    budget_s: float = 0.3  # timed runs per stage stop after this long …
    min_repeats: int = 5  # … and at least this many
    max_repeats: int = 50
    warmup: int = 2


class StageProfiler:
    """``refine(pipe)``: ``pipe`` with every stage's forward, backward and step times measured."""

    def __init__(
        self,
        graph: Graph,
        device_type: DeviceType,
        cache: ProfileCache,
        options: StageProfileOptions | None = None,
    ) -> None:
        import torch

        from tessera.backends.profile_cache import device_fingerprint

        self.graph, self.cache = graph, cache
        self.action_overhead = device_type.action_overhead
        self.options = options or StageProfileOptions()
        self.threads = int(device_type.cores) if device_type.kind == "cpu" and device_type.cores else None
        threads = self.threads or torch.get_num_threads()
        self.fingerprint = device_fingerprint(f"torch cpu, {threads} thread{'' if threads == 1 else 's'}")
        self.version = str(torch.__version__)
        self.measured = 0  # stages timed in this run (the others came from the cache)
        self._model: OnnxModule | None = None  # the whole model, computing stages' inputs

    def refine(self, pipe: Pipeline) -> Pipeline:
        data = self.data_seconds(pipe.mini_batch_size)
        stages = [self._refined(st, data) for st in pipe.stages]
        return dataclasses.replace(pipe, stages=stages)

    def _refined(self, st: PipelineStage, data: float) -> PipelineStage:
        samples = per_device_samples(st.micro_batch_size, len(st.devices))
        t = self.times(st.nodes, samples)
        backward = t.backward + (t.forward if st.recompute else 0.0)
        step = t.step + data
        return dataclasses.replace(
            st,
            forward_time=t.forward,
            backward_time=backward,
            step_time=step,
            action_overhead=self.action_overhead,
        )

    def data_seconds(self, mini_batch: int) -> float:
        """Drawing a mini-batch of synthetic inputs as every rank does each step
        (:class:`~tessera.core.data.TrainingData`), cached like the stages."""
        from tessera.backends.profile_cache import Profile

        key = digest([self._model_key(), "data", mini_batch])
        got = self.cache.get(DATA_BACKEND, self.version, self.fingerprint, key)
        if got is not None and got.ok:
            return got.median_s
        runs = []
        data = TrainingData(self.graph, mini_batch)
        for step in range(self.options.warmup + self.options.min_repeats):
            start = time.perf_counter()
            data.batch(step)
            runs.append(time.perf_counter() - start)
        seconds = statistics.median(runs[self.options.warmup :])
        self.cache.put(Profile(DATA_BACKEND, self.version, self.fingerprint, key, seconds, 0.0, len(runs)))
        return seconds

    def times(self, nodes: list[str], samples: int) -> StageTimes:
        """The stage of ``nodes`` at ``samples`` samples per micro-batch: cached, else measured."""
        from tessera.backends.profile_cache import Profile

        key = digest([self._model_key(), sorted(nodes), samples, RECIPE])
        cached = [self.cache.get(b, self.version, self.fingerprint, key) for b in STAGE_BACKENDS]
        if all(c is not None and c.ok for c in cached):
            return StageTimes(*(c.median_s for c in cached))  # type: ignore[union-attr]
        runs = self._measure(nodes, samples)
        self.measured += 1
        for backend, values in zip(STAGE_BACKENDS, runs, strict=True):
            self.cache.put(
                Profile(
                    backend, self.version, self.fingerprint, key, statistics.median(values), 0.0, len(values)
                )
            )
        return StageTimes(*(statistics.median(values) for values in runs))

    def _model_key(self) -> list[object]:
        """What the model's stages depend on: its bytes, the shapes given and the rewrites applied."""
        g = self.graph
        return [g.sha256, sorted((k, list(v)) for k, v in g.input_shapes.items()), list(g.rewrites)]

    def _measure(self, nodes: list[str], samples: int) -> tuple[list[float], list[float], list[float]]:
        import torch

        from tessera.backends.torch_module import to_torch

        module = to_torch(self.graph.extract(nodes), label="stage")
        feeds = self._inputs(module.input_names, samples)
        params = [p for _, p in module.onnx_parameters()]
        optimizer = torch.optim.SGD(params, lr=1e-9) if params else None
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            runs: tuple[list[float], list[float], list[float]] = ([], [], [])
            spent, o = 0.0, self.options
            while len(runs[0]) < o.warmup + o.min_repeats or (
                spent < o.budget_s and len(runs[0]) < o.warmup + o.max_repeats
            ):
                times = _one_step(module, feeds, optimizer)
                spent += sum(times)
                for values, value in zip(runs, times, strict=True):
                    values.append(value)
        finally:
            torch.set_num_threads(before)
        return runs[0][o.warmup :], runs[1][o.warmup :], runs[2][o.warmup :]

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
            v.detach().clone().requires_grad_(v.is_floating_point() and name not in self.graph.inputs)
            for name, v in values.items()
        ]


def _one_step(
    module: torch.nn.Module, feeds: list[torch.Tensor], optimizer: object
) -> tuple[float, float, float]:
    """Forward (with a squared-error loss of the outputs, as the last stage's), backward and the
    SGD step, as a stage runs them."""
    t0 = time.perf_counter()
    outputs = [o for o in module(*feeds) if o.requires_grad]
    loss = sum((o * o).sum() / o.numel() for o in outputs) if outputs else None
    if loss is not None:
        float(loss.detach())  # the worker reads the loss in its forward
    t1 = time.perf_counter()
    if loss is not None:
        loss.backward()
    t2 = time.perf_counter()
    if optimizer is not None:
        optimizer.step()  # type: ignore[attr-defined]
        optimizer.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    for x in feeds:
        x.grad = None
    return t1 - t0, t2 - t1, time.perf_counter() - t2


RefineFn = Callable[[Pipeline], Pipeline]
