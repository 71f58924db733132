"""The composite (placed) model: run a placement's groups, each on its own backend, as one model.

Every group is extracted and compiled once; :meth:`CompositeModel.run` executes the groups in a
topological order, handing numpy arrays between them without copies where the runtimes allow, and drops
a tensor after its last reader. :func:`latencies` times several runnables interleaved in rounds, so every
contender sees the same machine state. References: Collage paper §4. Details: docs/backends.md.
"""

from __future__ import annotations

import logging
import math
import random
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np
from onnx import numpy_helper

from tessera.backends.base import Runnable, cpu_cores
from tessera.backends.native_output import caught
from tessera.backends.registry import BackendRegistry, default_registry
from tessera.core.errors import LaunchError
from tessera.core.graph import Graph, is_floating

log = logging.getLogger(__name__)

# Composite vs onnxruntime's full model, fp32: backends reorder reductions and fuse differently, and
# differences grow through deep models; values are of order 1.
VERIFY_RTOL, VERIFY_ATOL = 1e-3, 1e-4


@dataclass(frozen=True)
class Step:
    """One group as executed: its backend, compiled runnable, tensors in and out."""

    index: int
    backend: str
    nodes: frozenset[str]
    runnable: Runnable
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    release: tuple[str, ...]  # tensors nobody reads after this step


CompileCache = dict[tuple[str, frozenset[str]], Runnable]

# onnxruntime's intra-op threads spin after each run by default; next to another runtime's threads
# that spinning takes the cores the other runtime needs (measured: squeezenet in 11 alternating groups
# runs 1.6x slower). In a placement with several backends onnxruntime groups are built without it.
NO_SPIN = "/no-spin"
#: the backends that build ONNX Runtime sessions (and so spin)
ORT_BACKENDS = ("onnxruntime", "onnxruntime-int8")
# A small group runs on one thread: waking a thread pool costs more than such a group's work (measured:
# tiny mmt in 56 groups, 2.8 ms with pooled sessions, 0.9 ms with one thread each). Small = the tensors
# the group writes hold at most this many bytes.
SMALL_GROUP_BYTES = 256 * 1024
ONE_THREAD = "/1-thread"
# Idle time before each contender's turn in :func:`latencies`: onnxruntime's and OpenVINO's worker
# threads keep spinning for a while after a call and would take the cores from whoever runs next.
SETTLE_S = 0.02


def model_written_bytes(model: Any) -> int:
    """:func:`written_bytes` of an extracted sub-model (its outputs and internal tensors)."""
    from onnx.helper import tensor_dtype_to_np_dtype

    total = 0
    for vi in [*model.graph.value_info, *model.graph.output]:
        t = vi.type.tensor_type
        n = math.prod(d.dim_value if d.dim_value > 0 else 1 for d in t.shape.dim)
        total += n * (tensor_dtype_to_np_dtype(t.elem_type).itemsize if t.elem_type else 4)
    return total


class ComposedOnnxRuntime:
    """onnxruntime as a placement with several backends builds it (:func:`composite_variant`), for
    measuring candidates the way the composite model will run them."""

    def __init__(self, base: Any) -> None:
        self.base = base
        self.name = base.name + "+composite"
        self.version = base.version
        self.device = base.device

    def compile(self, model: Any) -> Runnable:
        small = model_written_bytes(model) <= SMALL_GROUP_BYTES
        return self.base.compile_threads(model, 1 if small else 0)


def written_bytes(graph: Graph, nodes: Iterable[str]) -> int:
    """Bytes of the tensors ``nodes`` write (what decides whether a group is small)."""
    total = 0
    for n in nodes:
        for t in graph.op(n).outputs:
            info = graph.tensors.get(t) if t else None
            total += info.nbytes if info is not None else 0
    return total


def composite_variant(graph: Graph, backend: str, nodes: Iterable[str], mixed: bool) -> str:
    """How a group is built in a composite model: the backend's name, with ``/no-spin`` (and
    ``/1-thread`` for a small group) for onnxruntime next to another backend."""
    if not mixed or backend not in ORT_BACKENDS:
        return backend
    small = written_bytes(graph, nodes) <= SMALL_GROUP_BYTES
    return backend + NO_SPIN + (ONE_THREAD if small else "")


def build_group(graph: Graph, variant: str, nodes: Iterable[str], registry: BackendRegistry) -> Runnable:
    """Compile ``nodes`` of ``graph`` as :func:`composite_variant` ``variant`` says (or, for a group
    running beside others, ``<backend>/threads=N``)."""
    sub = graph.extract(nodes)
    backend, _, how = variant.partition("/")
    with caught(backend):
        if how.startswith("threads="):
            return registry.backend(backend).compile_threads(sub, int(how.removeprefix("threads=")))
        if how:
            return registry.backend(backend).compile_threads(sub, 1 if ONE_THREAD in variant else 0)
        return registry.backend(backend).compile(sub)


def group_order(graph: Graph, groups: Sequence[Iterable[str]]) -> list[int]:
    """Indices of ``groups`` in an executable order (stable); raises when the groups form a cycle."""
    try:
        return list(nx.lexicographical_topological_sort(graph.quotient(groups)))
    except nx.NetworkXUnfeasible:
        raise LaunchError("the placement's groups depend on each other in a cycle") from None


class CompositeModel:
    """A placement compiled group by group (see the module docstring)."""

    def __init__(
        self,
        graph: Graph,
        groups: Sequence[tuple[str, Iterable[str]]],
        *,
        registry: BackendRegistry | None = None,
        cache: CompileCache | None = None,
        mixed: bool | None = None,
        concurrent: bool = False,
    ) -> None:
        """``mixed``: build the groups as in a placement with several backends (default: when it has).
        ``concurrent``: groups that do not depend on each other run at the same time, on threads, each
        built to use its share of the cores (:meth:`run`)."""
        self.graph = graph
        registry = registry or default_registry()
        members = [frozenset(nodes) for _, nodes in groups]
        covered = [n for m in members for n in m]
        if len(covered) != len(set(covered)) or set(covered) != set(graph.dag.nodes):
            raise LaunchError("the placement does not cover every operator exactly once")
        self.input_names = tuple(n for n in graph.inputs if n not in graph.initializers)
        self.output_names = tuple(graph.outputs)
        # A graph output may be a weight (an initializer): no group computes it, the model returns it.
        self._constant_outputs = {
            t.name: numpy_helper.to_array(t) for t in graph.model.graph.initializer if t.name in graph.outputs
        }
        steps: list[Step] = []
        order = group_order(graph, members)
        last_reader: dict[str, int] = {}
        boundaries = {}
        for pos, i in enumerate(order):
            ins, outs = graph.boundary(members[i])
            boundaries[i] = (ins, outs)
            for t in ins:
                last_reader[t] = pos
        if mixed is None:
            mixed = len({b for b, _ in groups}) > 1
        self.levels = _levels(graph, members, order) if concurrent else [[p] for p in range(len(order))]
        share = {
            p: max(1, cpu_cores() // len(level)) for level in self.levels if len(level) > 1 for p in level
        }
        for pos, i in enumerate(order):
            backend, nodes = groups[i][0], members[i]
            variant = f"{backend}/threads={share[pos]}" if pos in share else None
            key = (variant or composite_variant(graph, backend, nodes, mixed), nodes)
            runnable = cache.get(key) if cache is not None else None
            if runnable is None:
                try:
                    runnable = build_group(graph, key[0], nodes, registry)
                except Exception as exc:  # noqa: BLE001 - any runtime's failure is a launch failure
                    raise LaunchError(
                        f"group {i} ({len(nodes)} operators) does not build on {backend}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                if cache is not None:
                    cache[key] = runnable
            ins, outs = boundaries[i]
            release = tuple(t for t in ins if last_reader.get(t) == pos and t not in self.output_names)
            steps.append(Step(i, backend, nodes, runnable, tuple(ins), tuple(outs), release))
        self.steps = steps
        # What run() walks: bound methods and name tuples, so a call builds nothing but the feeds.
        self._program = [(s.runnable.run, s.inputs, s.outputs, s.release) for s in steps]
        self._pool: ThreadPoolExecutor | None = None
        if any(len(level) > 1 for level in self.levels):
            workers = min(cpu_cores(), max(len(level) for level in self.levels))
            self._pool = ThreadPoolExecutor(workers, "tessera-group")
            weakref.finalize(self, self._pool.shutdown, wait=False)
            # A tensor is dropped after the last level that reads it (positions do not order levels).
            last_level = {t: k for k, level in enumerate(self.levels) for p in level for t in steps[p].inputs}
            self._level_release = [
                [t for t, k in last_level.items() if k == level and t not in self.output_names]
                for level in range(len(self.levels))
            ]

    @property
    def concurrent(self) -> bool:
        """Whether some groups run at the same time."""
        return self._pool is not None

    @property
    def backends(self) -> list[str]:
        return sorted({s.backend for s in self.steps})

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs for ``feeds`` (one array per model input)."""
        env: dict[str, Any] = {name: feeds[name] for name in self.input_names}
        if self._pool is not None:
            self._run_levels(env)
        else:
            for run, inputs, outputs, release in self._program:
                results = run({t: env[t] for t in inputs})
                for t in outputs:
                    env[t] = results[t]
                for t in release:
                    env.pop(t, None)
        return {
            name: env[name] if name in env else self._constant_outputs[name] for name in self.output_names
        }

    def _run_levels(self, env: dict[str, Any]) -> None:
        """Level by level: the groups of a level run at the same time (the runtimes release the GIL)."""
        assert self._pool is not None
        for level, release in zip(self.levels, self._level_release, strict=True):
            calls = [(self._program[p][0], {t: env[t] for t in self._program[p][1]}) for p in level]
            if len(calls) == 1:
                results = [calls[0][0](calls[0][1])]
            else:
                results = list(self._pool.map(lambda call: call[0](call[1]), calls))
            for p, out in zip(level, results, strict=True):
                for t in self._program[p][2]:
                    env[t] = out[t]
            for t in release:
                env.pop(t, None)


def _levels(graph: Graph, members: Sequence[frozenset[str]], order: Sequence[int]) -> list[list[int]]:
    """Positions in ``order`` grouped by depth in the group graph: a level's groups depend only on
    earlier levels'."""
    quotient = graph.quotient(members)
    position = {i: pos for pos, i in enumerate(order)}
    depth: dict[int, int] = {}
    for i in order:
        depth[i] = 1 + max((depth[j] for j in quotient.predecessors(i)), default=-1)
    levels: dict[int, list[int]] = {}
    for i in order:
        levels.setdefault(depth[i], []).append(position[i])
    return [levels[d] for d in sorted(levels)]


def reference_outputs(
    graph: Graph, feeds: Mapping[str, np.ndarray], *, timeout_s: float | None = None
) -> dict[str, np.ndarray]:
    """onnxruntime's outputs of the full model (the reference ``--verify`` compares against);
    TimeoutError past ``timeout_s``."""
    from tessera.backends.onnxruntime import OnnxRuntimeBackend

    runnable = OnnxRuntimeBackend().compile(graph.extract(graph.order))
    return runnable.run(dict(feeds), timeout_s=timeout_s)


def output_error(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The one error measure of place, validate and launch: ``max_abs``, the largest ``|got − want|``
    over every output element, and ``max_rel``, the largest ``max |got − want| / max |want|`` over the
    outputs (each output relative to its own scale: what ``place --tolerance`` bounds). A NaN or an
    infinity where the reference has none (or another) is infinitely wrong, as is a shape mismatch;
    the same non-finite value in both agrees."""
    worst_abs = worst_rel = 0.0
    for name, expected in want.items():
        expected = np.asarray(expected, dtype=np.float64)
        actual = np.asarray(got[name], dtype=np.float64)
        if actual.shape != expected.shape:
            return {"max_abs": math.inf, "max_rel": math.inf}
        if not expected.size:
            continue
        finite = np.isfinite(expected) & np.isfinite(actual)
        same = (np.isnan(expected) & np.isnan(actual)) | (~np.isnan(expected) & (actual == expected))
        if not (finite | same).all():
            return {"max_abs": math.inf, "max_rel": math.inf}
        diff = float(np.abs(actual[finite] - expected[finite]).max(initial=0.0))
        scale = max(float(np.abs(expected[np.isfinite(expected)]).max(initial=0.0)), 1e-30)
        worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, diff / scale)
    return {"max_abs": worst_abs, "max_rel": worst_rel}


def relative_error(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> float:
    """:func:`output_error`'s ``max_rel``."""
    return output_error(got, want)["max_rel"]


def within_tolerance(
    got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], tolerance: float | None
) -> bool:
    """Whether :func:`relative_error` is at most ``tolerance`` (None: never: an exact run is asked for)."""
    return tolerance is not None and relative_error(got, want) <= tolerance


def verify_outputs(
    got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], tolerance: float | None
) -> dict[str, Any]:
    """:func:`compare_outputs`' report; a plan placed under a ``tolerance`` is ok when its
    :func:`relative_error` is within it (its reduced-precision groups are not fp32-exact)."""
    report = compare_outputs(got, want)
    if tolerance is not None:
        report.update(tolerance=tolerance, relative_error=relative_error(got, want))
        report["ok"] = report["relative_error"] <= tolerance
    return report


def compare_outputs(
    got: Mapping[str, np.ndarray],
    want: Mapping[str, np.ndarray],
    *,
    rtol: float = VERIFY_RTOL,
    atol: float = VERIFY_ATOL,
) -> dict[str, Any]:
    """Per-output max abs/rel difference and whether all outputs are within ``rtol``/``atol``."""
    report: dict[str, Any] = {"rtol": rtol, "atol": atol, "ok": True, "outputs": {}}
    for name, expected in want.items():
        actual = np.asarray(got[name])
        expected = np.asarray(expected)
        if actual.shape != expected.shape:
            report["outputs"][name] = {"shape": [list(actual.shape), list(expected.shape)], "ok": False}
            report["ok"] = False
            continue
        if expected.dtype.kind in "OSU":
            # Strings (and other non-numbers) have no tolerance: equal or not.
            ok = actual.dtype == expected.dtype and bool(np.array_equal(actual, expected))
            diff0 = 0.0 if ok else math.inf
            report["outputs"][name] = {"max_abs_diff": diff0, "max_rel_diff": diff0, "ok": ok}
            report["ok"] = report["ok"] and ok
            continue
        diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
        ok = bool(np.allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True))
        scale = np.maximum(np.abs(expected.astype(np.float64)), atol)
        report["outputs"][name] = {
            "max_abs_diff": float(diff.max()) if diff.size else 0.0,
            "max_rel_diff": float((diff / scale).max()) if diff.size else 0.0,
            "ok": ok,
        }
        report["ok"] = report["ok"] and ok
    return report


def latencies(
    runs: Mapping[str, Callable[[], Any]],
    *,
    rounds: int = 7,
    min_round_s: float = 0.05,
    warmup: int = 3,
    settle_s: float = SETTLE_S,
    min_rounds: int | None = None,
) -> dict[str, float]:
    """Median seconds per call of each runnable, timed interleaved: ``rounds`` rounds, each timing every
    contender for about ``min_round_s`` (whole calls) in a seeded order of its own, after ``settle_s``
    of idleness (the previous contender's threads stop spinning). A contender that raises gets ``inf``.

    With ``min_rounds``, timing stops after that many rounds once the ranking is clear: the fastest
    contender's slowest round beats every other contender's fastest round (close calls get all
    ``rounds``)."""
    alive = dict(runs)
    result: dict[str, float] = {}
    number: dict[str, int] = {}
    for name, run in list(alive.items()):
        try:
            for _ in range(warmup):
                run()
            start = time.perf_counter()
            run()
            first = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001
            log.warning("%s failed while timing: %s", name, exc)
            result[name] = math.inf
            alive.pop(name)
            continue
        number[name] = max(1, math.ceil(min_round_s / max(first, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in alive}
    for r in range(rounds):
        # A runtime's threads still spinning from its last call slow down whoever runs next: each round
        # times the contenders in its own (seeded) order, each after a pause and one untimed call.
        names = list(alive)
        random.Random(r).shuffle(names)
        for name in names:
            run = alive[name]
            if len(alive) > 1:
                time.sleep(settle_s)
            run()
            start = time.perf_counter()
            for _ in range(number[name]):
                run()
            samples[name].append((time.perf_counter() - start) / number[name])
        if min_rounds is not None and r + 1 >= min_rounds and ranking_is_clear(samples):
            break
    for name, values in samples.items():
        result[name] = float(np.median(values))
    return {name: result[name] for name in runs}


def ranking_is_clear(samples: Mapping[str, list[float]]) -> bool:
    """Whether the contender with the best median is faster in its slowest round than every other
    contender in its fastest one."""
    if len(samples) < 2:
        return True
    fastest = min(samples, key=lambda n: float(np.median(samples[n])))
    return all(max(samples[fastest]) < min(v) for n, v in samples.items() if n != fastest)


def random_feeds(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for the model: standard normal floats, zeros for integer (index) inputs."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, info in graph.inputs.items():
        if name in graph.initializers:
            continue
        dtype = np.dtype(info.dtype)
        shape = info.shape or ()
        if is_floating(dtype):
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[name] = np.ones(shape, dtype=dtype)
        else:
            feeds[name] = np.zeros(shape, dtype=dtype)
    return feeds


def load_feeds(graph: Graph, path: str) -> dict[str, np.ndarray]:
    """Inputs from an ``.npz`` with one array per model input (checked against the model)."""
    from tessera.core.errors import InputError
    from tessera.core.user_files import read_npz

    def wanted(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> bool:
        info = graph.inputs.get(name)
        if info is None or name in graph.initializers:
            return False  # never inflated
        expected = info.shape
        if expected is not None and shape != tuple(expected):
            raise InputError(
                f"input {name!r} has shape {list(shape)}, the model expects {list(expected)}", source=path
            )
        return True

    arrays = read_npz(path, "inputs", wanted=wanted)
    feeds = {}
    for name, info in graph.inputs.items():
        if name in graph.initializers:
            continue
        if name not in arrays:
            raise InputError(f"no array for model input {name!r}", source=path)
        feeds[name] = arrays[name].astype(info.dtype, copy=False)
    return feeds
