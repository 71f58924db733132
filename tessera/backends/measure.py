"""The measurer: compile a candidate subgraph on its backend and time it (Collage's 𝓜 and ε).

``Measurer.measure(backend, graph, nodes)`` looks the subgraph's canonical hash up in the profile cache,
else compiles, warms up and times it (median and interquartile range, cached); a failed build or run
costs infinity and is cached as such. ``Measurer.context_switch(src, dst, nbytes)`` measures ε, the extra
time of handing a tensor between two runtimes, on this machine.

References: Collage thesis §2.4.2, Eq. 2.2 (paper Eq. 2). Details: docs/backends.md.
"""

from __future__ import annotations

import collections
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from tessera.backends.base import Backend, BuildError, Runnable
from tessera.backends.native_output import caught
from tessera.backends.profile_cache import Profile, ProfileCache, device_fingerprint, subgraph_hash
from tessera.core.graph import Graph, is_floating

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measurement:
    """A candidate's cost on one backend: median and IQR of a run in seconds (``inf`` if it failed)."""

    backend: str
    nodes: frozenset[str]
    subgraph: str
    median_s: float
    iqr_s: float
    runs: int
    compile_s: float | None
    cached: bool
    error: str | None = None

    @property
    def cost(self) -> float:
        return self.median_s

    @property
    def ok(self) -> bool:
        return math.isfinite(self.median_s)


@dataclass(frozen=True)
class Timing:
    median_s: float
    iqr_s: float
    runs: int


def time_runs(
    run: Callable[[], Any], *, warmup: int = 3, repeat: int = 15, min_sample_s: float = 2e-4
) -> Timing:
    """Warm up, then time ``repeat`` samples; a sample averages enough calls to last ``min_sample_s``."""
    for _ in range(warmup):
        run()
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    number = max(1, math.ceil(min_sample_s / first)) if first > 0 else 1
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            run()
        samples.append((time.perf_counter() - start) / number)
    q1, median, q3 = np.percentile(samples, [25, 50, 75])
    return Timing(float(median), float(q3 - q1), repeat * number)


class Measurer:
    """Measures candidates and caches what it measured (see the module docstring).

    ``progress`` shows a rich progress bar in :meth:`measure_many` (only when stderr is a terminal).
    """

    def __init__(
        self,
        cache: ProfileCache | None = None,
        *,
        warmup: int = 3,
        repeat: int = 15,
        seed: int = 0,
        progress: bool = False,
    ) -> None:
        self.cache = cache if cache is not None else ProfileCache()
        self.warmup = warmup
        self.repeat = repeat
        self.seed = seed
        self.progress = progress
        self._constants: dict[tuple[int, str], Any] = {}  # tensor values; "integers": a dict of them
        self.tried: collections.Counter[str] = collections.Counter()  # subgraphs per backend
        self.failed: dict[str, list[str]] = {}  # backend -> why each failed subgraph failed

    # -- candidates -----------------------------------------------------------------------------

    def measure(self, backend: Backend, graph: Graph, nodes: Iterable[str]) -> Measurement:
        """The cost of running ``nodes`` of ``graph`` as one subgraph on ``backend``."""
        members = frozenset(nodes)
        model = graph.extract(members)
        key = subgraph_hash(model)
        version = backend.version or "unknown"
        device = device_fingerprint(backend.device)
        hit = self.cache.get(backend.name, version, device, key)
        self.tried[backend.name] += 1
        if hit is not None:
            if hit.error is not None:
                self.failed.setdefault(backend.name, []).append(hit.error)
            return Measurement(
                backend.name, members, key, hit.median_s, hit.iqr_s, hit.runs, hit.compile_s, True, hit.error
            )
        feeds = self.feeds(graph, model)
        compile_s: float | None = None
        try:
            with caught(backend.name):
                start = time.perf_counter()
                runnable = backend.compile(model)
                compile_s = time.perf_counter() - start
                timing = time_runs(lambda: runnable.run(feeds), warmup=self.warmup, repeat=self.repeat)
        except Exception as exc:  # noqa: BLE001 - any failure is an infinite cost, never a crash
            error = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
            log.info("%s failed on a %d-node subgraph: %s", backend.name, len(members), error)
            self.failed.setdefault(backend.name, []).append(error)
            profile = Profile(backend.name, version, device, key, math.inf, math.inf, 0, compile_s, error)
            self.cache.put(profile)
            return Measurement(backend.name, members, key, math.inf, math.inf, 0, compile_s, False, error)
        self.cache.put(
            Profile(backend.name, version, device, key, timing.median_s, timing.iqr_s, timing.runs, compile_s)
        )
        return Measurement(
            backend.name, members, key, timing.median_s, timing.iqr_s, timing.runs, compile_s, False
        )

    def failures(self) -> list[str]:
        """One line per backend that failed on some subgraphs (the search placed them elsewhere):
        how many of those it was given, and the most frequent reason (``-v`` shows each)."""
        lines = []
        for name, errors in sorted(self.failed.items()):
            reason, count = collections.Counter(errors).most_common(1)[0]
            reason = reason if len(reason) <= 200 else reason[:199] + "…"
            lines.append(
                f"{name} failed on {len(errors)} of the {self.tried[name]} subgraph(s) it was given "
                f"(-v shows each); most often ({count}×): {reason}"
            )
        return lines

    def measure_many(
        self, candidates: Sequence[tuple[Backend, Iterable[str]]], graph: Graph
    ) -> list[Measurement]:
        """Measure each (backend, nodes) candidate in order, with a progress bar if asked."""
        results: list[Measurement] = []
        with _progress(self.progress, len(candidates)) as advance:
            for backend, nodes in candidates:
                results.append(self.measure(backend, graph, nodes))
                advance(backend.name)
        return results

    def feeds(self, graph: Graph, model: onnx.ModelProto) -> dict[str, np.ndarray]:
        """Inputs for a sub-model: random activations (seeded), and the real values of tensors that
        constant-computing operators produce (shapes, masks), evaluated once with onnxruntime."""
        rng = np.random.default_rng(self.seed)
        inits = {t.name for t in model.graph.initializer}
        feeds: dict[str, np.ndarray] = {}
        for vi in model.graph.input:
            if vi.name in inits:
                continue
            producer = graph.producer.get(vi.name)
            if producer is not None and producer in graph.constant_nodes:
                feeds[vi.name] = self._constant_value(graph, vi.name)
                continue
            info = graph.tensors[vi.name]
            shape = info.shape or ()
            dtype = np.dtype(info.dtype)
            if is_floating(dtype):
                feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
            elif (real := self._integer_values(graph).get(vi.name)) is not None and real.shape == shape:
                feeds[vi.name] = real  # a computed shape, index or mask: its value, not a stand-in
            elif dtype == np.bool_:
                feeds[vi.name] = np.ones(shape, dtype=dtype)
            else:  # indices: zero is always in range
                feeds[vi.name] = np.zeros(shape, dtype=dtype)
        return feeds

    def _integer_values(self, graph: Graph) -> dict[str, np.ndarray]:
        """The integer and boolean tensors the model computes from its inputs (Reshape targets from
        ``Shape``, gathered indices, masks), from one onnxruntime run of the whole model on seeded
        inputs: a sub-model fed zeros there would reshape to nonsense and fail. Empty if it cannot run."""
        key = (id(graph), "integers")
        if key not in self._constants:
            from tessera.backends.composite import random_feeds
            from tessera.backends.onnxruntime import OnnxRuntimeBackend

            wanted = [
                t
                for t, info in graph.tensors.items()
                if t in graph.producer and t not in graph.outputs and not info.floating
            ]
            values: dict[str, np.ndarray] = {}
            if wanted:
                model = onnx.ModelProto()
                model.CopyFrom(graph.model)
                model.graph.output.extend(graph._value_info(t) for t in wanted)
                try:
                    outputs = OnnxRuntimeBackend().compile(model).run(random_feeds(graph, self.seed))
                    values = {t: np.asarray(outputs[t]) for t in wanted if t in outputs}
                except Exception:  # noqa: BLE001 - a model onnxruntime cannot run whole: stand-ins
                    values = {}
            self._constants[key] = values
        return self._constants[key]

    def _constant_value(self, graph: Graph, tensor: str) -> np.ndarray:
        key = (id(graph), tensor)
        if key not in self._constants:
            import networkx as nx

            from tessera.backends.onnxruntime import OnnxRuntimeBackend

            producer = graph.producer[tensor]
            nodes = {producer} | (nx.ancestors(graph.dag, producer) & set(graph.constant_nodes))
            sub = graph.extract(nodes)
            del sub.graph.output[:]
            sub.graph.output.append(graph._value_info(tensor))
            self._constants[key] = OnnxRuntimeBackend().compile(sub).run({})[tensor]
        return self._constants[key]

    # -- context switches (Collage's ε) ----------------------------------------------------------

    def context_switch(self, src: Backend, dst: Backend, nbytes: int = 1 << 16) -> float:
        """ε for handing an fp32 tensor of about ``nbytes`` from ``src`` to ``dst`` (seconds, ≥ 0).

        Two one-operator kernels (``Relu``) are built on each backend. ε is the median time of
        ``src`` then ``dst`` with the first output fed to the second, minus the mean of the same
        chain kept within ``src`` and within ``dst`` (so the kernels' own work cancels out).
        """
        versions = f"{src.version}|{dst.version}"
        device = device_fingerprint(f"{src.device} -> {dst.device}")
        cached = self.cache.get_switch(src.name, dst.name, versions, device, nbytes)
        if cached is not None:
            return cached
        n = max(1, nbytes // 4)
        model = _relu_model(n)
        x = np.random.default_rng(self.seed).standard_normal(n).astype(np.float32)
        try:
            with caught(src.name):
                a = src.compile(model)
            with caught(dst.name):
                b = dst.compile(model) if dst is not src else a
        except (BuildError, Exception) as exc:  # noqa: BLE001
            log.warning("cannot measure the %s -> %s switch: %s", src.name, dst.name, exc)
            return math.inf

        def chain(first: Runnable, second: Runnable) -> Callable[[], Any]:
            return lambda: second.run({"x": first.run({"x": x})["y"]})

        across = time_runs(chain(a, b), warmup=self.warmup, repeat=self.repeat).median_s
        within_src = time_runs(chain(a, a), warmup=self.warmup, repeat=self.repeat).median_s
        within_dst = time_runs(chain(b, b), warmup=self.warmup, repeat=self.repeat).median_s
        epsilon = max(0.0, across - (within_src + within_dst) / 2)
        self.cache.put_switch(src.name, dst.name, versions, device, nbytes, epsilon)
        return epsilon


def _relu_model(n: int) -> onnx.ModelProto:
    node = helper.make_node("Relu", ["x"], ["y"], name="relu")
    graph = helper.make_graph(
        [node],
        "context_switch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _progress(enabled: bool, total: int) -> Any:
    """A context giving ``advance(label)``: a rich progress bar on a terminal, else a no-op."""
    if not enabled or not sys.stderr.isatty():
        return nullcontext(lambda label: None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    class _Bar:
        def __enter__(self) -> Callable[[str], None]:
            self.bar = Progress(
                TextColumn("profiling {task.description}", markup=False),  # labels name user nodes
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(file=sys.stderr),
                transient=True,
            )
            self.bar.__enter__()
            task = self.bar.add_task("", total=total)
            return lambda label: self.bar.update(task, advance=1, description=label)

        def __exit__(self, *exc: Any) -> None:
            self.bar.__exit__(*exc)

    return _Bar()
