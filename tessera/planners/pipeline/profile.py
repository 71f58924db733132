"""Measured operator costs for the pipeline planners (``tessera plan --profile``): every operator's
forward and backward timed on this machine through the ONNX→torch runtime, cached in the profile
cache, as :class:`MeasuredCosts` the cost model reads instead of the roofline's.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tessera.backends.base import torch_threads
from tessera.core.errors import InputError
from tessera.core.graph import Graph, OpNode
from tessera.core.specs import DeviceType

if TYPE_CHECKING:
    import torch

    from tessera.backends.profile_cache import ProfileCache

FORWARD_BACKEND = "torch-train.forward"
BACKWARD_BACKEND = "torch-train.backward"
_SMALL_CONSTANT = 4096  # float constants up to this many elements keep their real values


@dataclass(frozen=True)
class ProfileOptions:
    """How hard to measure (see the module docstring)."""

    max_samples: int = 8  # the largest second sample count
    budget_s: float = 0.2  # timed runs per operator and sample count stop after this long …
    min_repeats: int = 3  # … and at least this many, unless they take over slow_s
    slow_s: float = 1.0
    max_repeats: int = 25
    warmup: int = 1


@dataclass(frozen=True)
class OpLine:
    """Forward and backward seconds of one operator, affine in the samples from 1 sample on."""

    forward_1: float  # at 1 sample
    forward_slope: float  # per extra sample
    backward_1: float
    backward_slope: float

    def at(self, samples: float) -> tuple[float, float]:
        if samples < 1:
            return self.forward_1 * samples, self.backward_1 * samples
        extra = samples - 1
        return self.forward_1 + extra * self.forward_slope, self.backward_1 + extra * self.backward_slope


@dataclass
class ProfileReport:
    """What one profiling run did (for people: not part of the plan, it differs cold vs warm)."""

    operators: int = 0  # operators that read activations
    distinct: int = 0  # distinct (type, attributes, shapes) among them
    measurements: int = 0  # (operator, sample count) pairs measured in this run
    cache_hits: int = 0  # (operator, sample count) pairs found in the cache
    seconds: float = 0.0


class MeasuredCosts:
    """Measured operator times of one graph (an :class:`~tessera.core.cost.OpTimes`).

    ``times(op, samples)`` is O(1): the operator's :class:`OpLine` at ``samples``; None for
    operators without a measurement (the cost model's roofline answers for them).
    """

    def __init__(
        self,
        graph: Graph,
        lines: dict[str, OpLine],
        fallback: dict[str, str],
        source: dict[str, Any],
        report: ProfileReport | None = None,
    ) -> None:
        self._lines = {name: (graph.op(name), line) for name, line in lines.items()}
        self.fallback = dict(fallback)  # operator name → why it has no measurement
        self.source = dict(source)
        self.report = report or ProfileReport()

    def times(self, op: OpNode, samples: float) -> tuple[float, float] | None:
        got = self._lines.get(op.name)
        if got is None or got[0] is not op:  # another graph's operator of the same name
            return None
        return got[1].at(samples)

    def line(self, name: str) -> OpLine | None:
        got = self._lines.get(name)
        return None if got is None else got[1]

    @property
    def measured_operators(self) -> int:
        return len(self._lines)

    def roofline_types(self) -> dict[str, int]:
        """Operator types (with counts) that fell back to the roofline, constants excluded."""
        counts = Counter(
            reason.split(":", 1)[0] for reason in self.fallback.values() if not reason.startswith("constant")
        )
        return dict(sorted(counts.items()))

    def to_json(self) -> dict[str, Any]:
        """The plan's ``predicted.cost_model``: where and how the times were measured."""
        return {
            **self.source,
            "measured_operators": self.measured_operators,
            "roofline_operators": sum(self.roofline_types().values()),
            "roofline_by_type": self.roofline_types(),
        }


class _Unsupported(Exception):
    """This operator keeps the roofline (the message says why)."""


def torch_device_for(device_type: DeviceType) -> str:
    """``cuda`` when the cluster's devices are GPUs and torch sees one, else ``cpu``."""
    import torch

    return "cuda" if device_type.kind == "gpu" and torch.cuda.is_available() else "cpu"


def open_cache(path: str | Path | None) -> ProfileCache:
    """The profile cache at ``path`` (default: ``tessera place``'s), opened now: a path that cannot
    hold the cache is an :class:`InputError` (exit 2) before any profiling."""
    import sqlite3

    from tessera.backends.profile_cache import ProfileCache, default_profile_path

    where = Path(path) if path is not None else default_profile_path()
    if where.exists() and not where.is_file():
        raise InputError("--cache: not a file (the profile cache is one SQLite file)", source=where)
    for folder in where.parents:
        if folder.exists():
            if not folder.is_dir():
                raise InputError(f"--cache: {str(folder)!r} is not a folder", source=where)
            break
    cache = ProfileCache(where)
    try:
        cache.count()
    except (OSError, sqlite3.Error) as exc:
        raise InputError(f"--cache: cannot open the profile cache: {exc}", source=where) from None
    return cache


def profile_graph(
    graph: Graph,
    device_type: DeviceType,
    *,
    cache: ProfileCache,
    precision: str = "mixed",
    options: ProfileOptions | None = None,
    device: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> MeasuredCosts:
    """Measure every activation-reading operator of ``graph`` (see the module docstring).

    ``device``: the torch device (default :func:`torch_device_for`); ``progress(done, total)`` is
    called after every distinct operator. Raises :class:`InputError` when torch is not installed.
    """
    try:
        import torch  # noqa: F401
    except ImportError:
        raise InputError("--profile runs operators through torch: pip install 'tessera[launch]'") from None
    profiler = _Profiler(graph, device_type, cache, precision, options or ProfileOptions(), device)
    return profiler.run(progress)


class _Profiler:
    def __init__(
        self,
        graph: Graph,
        device_type: DeviceType,
        cache: ProfileCache,
        precision: str,
        options: ProfileOptions,
        device: str | None,
    ) -> None:
        import torch

        from tessera.backends.profile_cache import device_fingerprint

        self.graph, self.cache, self.options = graph, cache, options
        self.device = device or torch_device_for(device_type)
        self.dtype = (
            torch.float16 if self.device.startswith("cuda") and precision == "mixed" else torch.float32
        )
        self.threads = (
            int(device_type.cores)
            if self.device == "cpu" and device_type.kind == "cpu" and device_type.cores
            else torch.get_num_threads()
        )
        label = (
            f"cuda ({torch.cuda.get_device_name(self.device)})"
            if self.device.startswith("cuda")
            else f"cpu, {self.threads} thread{'' if self.threads == 1 else 's'}"
        )
        self.fingerprint = device_fingerprint(f"torch {label}")
        self.version = str(torch.__version__)
        self.report = ProfileReport()
        self._nodes = {n.name: n for n in graph.model.graph.node}
        self._initializers = {t.name: t for t in graph.model.graph.initializer}
        self._constants: dict[str, np.ndarray | None] = {}

    # -- the run ---------------------------------------------------------------------------------

    def run(self, progress: Callable[[int, int], None] | None) -> MeasuredCosts:
        started = time.perf_counter()
        g = self.graph
        lines: dict[str, OpLine] = {}
        fallback: dict[str, str] = {}
        groups: dict[str, list[OpNode]] = {}
        for name in g.order:
            op = g.op(name)
            if name in g.constant_nodes:
                fallback[name] = f"constant: {op.op_type}"
                continue
            self.report.operators += 1
            try:
                groups.setdefault(self._signature(op), []).append(op)
            except _Unsupported as exc:
                fallback[name] = f"{op.op_type}: {exc}"
        self.report.distinct = len(groups)
        with torch_threads(self.threads):
            if groups:
                self._warm_up()
            for i, (sig, ops) in enumerate(groups.items()):
                try:
                    line = self._line(sig, ops[0])
                except _Unsupported as exc:
                    for op in ops:
                        fallback[op.name] = f"{op.op_type}: {exc}"
                else:
                    for op in ops:
                        lines[op.name] = line
                if progress is not None:
                    progress(i + 1, len(groups))
        self.report.seconds = time.perf_counter() - started
        source = {
            "kind": "measured",
            "device": self.fingerprint,
            "torch": self.version,
            "dtype": str(self.dtype).removeprefix("torch."),
            "method": (
                "torch autograd forward and backward of each operator on random inputs, median of "
                f"repeats after a warm-up, at 1 and up to {self.options.max_samples} samples, affine in "
                "the samples; memory analytical; roofline for the operators counted here"
            ),
            "operators": self.report.operators,
        }
        return MeasuredCosts(g, lines, fallback, source, self.report)

    def _warm_up(self) -> None:
        """Start torch's thread pool and autograd engine, so the first operator is not charged."""
        import torch

        x = torch.rand(64, 64, dtype=self.dtype, device=self.device, requires_grad=True)
        for _ in range(3):
            torch.autograd.grad([(x @ x).softmax(-1).sum()], [x])

    def _line(self, sig: str, op: OpNode) -> OpLine:
        """Measure (or look up) ``op`` at 1 sample and at a larger count; fit the affine line."""
        fw1, bw1 = self._times(sig, op, 1)
        one = fw1 + bw1
        hi = 1
        while hi * 2 <= self.options.max_samples and hi * 2 * one <= self.options.budget_s:
            hi *= 2
        if hi == 1:
            return OpLine(fw1, fw1, bw1, bw1)  # proportional: t(s) = t(1) · s
        fwh, bwh = self._times(sig, op, hi)
        return OpLine(fw1, max(0.0, (fwh - fw1) / (hi - 1)), bw1, max(0.0, (bwh - bw1) / (hi - 1)))

    def _times(self, sig: str, op: OpNode, samples: int) -> tuple[float, float]:
        """(forward, backward) seconds of ``op`` at ``samples``: from the cache, else measured."""
        from tessera.backends.profile_cache import Profile

        key = digest([sig, samples])
        fw = self.cache.get(FORWARD_BACKEND, self.version, self.fingerprint, key)
        bw = self.cache.get(BACKWARD_BACKEND, self.version, self.fingerprint, key)
        if fw is not None and bw is not None:
            self.report.cache_hits += 1
            if not (fw.ok and bw.ok):
                raise _Unsupported(fw.error or bw.error or "failed before")
            return fw.median_s, bw.median_s
        self.report.measurements += 1
        error: str | None = None
        try:
            fw_runs, bw_runs = self._measure(op, samples)
        except _Unsupported as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure of the converter or torch: the roofline
            error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
        if error is not None:
            for backend in (FORWARD_BACKEND, BACKWARD_BACKEND):
                self.cache.put(
                    Profile(backend, self.version, self.fingerprint, key, math.inf, math.inf, 0, None, error)
                )
            raise _Unsupported(error)
        rows = []
        for backend, runs in ((FORWARD_BACKEND, fw_runs), (BACKWARD_BACKEND, bw_runs)):
            rows.append(
                Profile(
                    backend,
                    self.version,
                    self.fingerprint,
                    key,
                    statistics.median(runs),
                    _iqr(runs),
                    len(runs),
                )
            )
            self.cache.put(rows[-1])
        return rows[0].median_s, rows[1].median_s

    # -- one operator ----------------------------------------------------------------------------

    def _signature(self, op: OpNode) -> str:
        """A digest of everything the operator's time depends on (not names, not weight values)."""
        from tessera.backends.torch_ops import OPS

        if op.domain not in ("", "ai.onnx") or op.op_type not in OPS:
            raise _Unsupported("no torch converter for this operator")
        roles = []
        for i, t in enumerate(op.inputs):
            if not t:
                roles.append(None)
                continue
            kind = self._role(op, i, t)
            info = self.graph.tensors.get(t)
            if info is None or info.shape is None:
                raise _Unsupported(f"input {t!r} has an unknown shape")
            entry: list[Any] = [kind, list(info.shape), info.dtype]
            if kind == "const":
                value = self._constant_value(t)
                entry.append(None if value is None else hashlib.sha256(value.tobytes()).hexdigest())
            roles.append(entry)
        return digest(
            [op.op_type, op.domain, sorted(op.attributes.items()), roles, len(op.outputs), str(self.dtype)]
        )

    def _role(self, op: OpNode, position: int, tensor: str) -> str:
        """``act`` (an activation: scaled by the samples), ``weight`` (a trained leaf) or ``const``."""
        from tessera.backends.torch_module import FROZEN_INPUTS

        g = self.graph
        if tensor not in g.initializers and g.producer.get(tensor) not in g.constant_nodes:
            return "act"
        info = g.tensors.get(tensor)
        floating = info is not None and info.floating
        if (
            op.params > 0
            and floating
            and info is not None
            and info.shape
            and (op.op_type, position) not in FROZEN_INPUTS
        ):
            return "weight"
        return "const"

    def _constant_value(self, tensor: str) -> np.ndarray | None:
        """The real value of a constant input when it is small enough and known (else None)."""
        if tensor in self._constants:
            return self._constants[tensor]
        g = self.graph
        info = g.tensors[tensor]
        value: np.ndarray | None = None
        floating = info.floating
        if not floating or info.numel <= _SMALL_CONSTANT:
            if tensor in g.initializers:
                proto = self._initializers.get(tensor)
                if proto is not None and proto.data_location != TensorProto.EXTERNAL:
                    value = numpy_helper.to_array(proto)
            else:
                value = self._evaluate_constant(tensor)
        self._constants[tensor] = value
        return value

    def _evaluate_constant(self, tensor: str) -> np.ndarray | None:
        """Run the constant operators that compute ``tensor`` (a Constant, a shape computation)."""
        import networkx as nx
        import torch

        from tessera.backends.torch_module import to_torch

        g = self.graph
        producer = g.producer[tensor]
        members = {producer} | nx.ancestors(g.dag, producer)
        try:
            module = to_torch(g.extract(members), label=f"constant {tensor}")
            with torch.no_grad():
                outputs = module.run({})
        except Exception:  # noqa: BLE001 - an unknown value: the operator falls back to the roofline
            return None
        got = outputs.get(tensor)
        return None if got is None else got.detach().cpu().numpy()

    def _measure(self, op: OpNode, samples: int) -> tuple[list[float], list[float]]:
        """Forward and backward seconds of every timed run of ``op`` at ``samples``."""
        import torch

        from tessera.backends.torch_module import to_torch

        node = self._nodes[op.name]
        names = list(dict.fromkeys(t for t in node.input if t))
        feeds, leaves = [], []
        for name in names:
            position = list(node.input).index(name)
            tensor = self._input_tensor(op, position, name, samples)
            feeds.append(tensor)
            if tensor.requires_grad:
                leaves.append(tensor)
        if not leaves:
            raise _Unsupported("no float input to differentiate")
        model = helper.make_model(
            helper.make_graph(
                [node],
                "op",
                [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names],
                [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in node.output if o],
            )
        )
        module = to_torch(model, label=op.name)
        sync: Callable[[], None] = torch.cuda.synchronize if self.device.startswith("cuda") else _no_sync
        grads: list[torch.Tensor] = []

        def run() -> tuple[float, float]:
            start = time.perf_counter()
            outputs = module(*feeds)
            sync()
            mid = time.perf_counter()
            diff = [o for o in outputs if o.requires_grad]
            if not diff:
                raise _Unsupported("no differentiable output")
            if not grads:
                grads.extend(torch.ones_like(o) for o in diff)
            torch.autograd.grad(diff, leaves, grads, allow_unused=True)
            sync()
            return mid - start, time.perf_counter() - mid

        for _ in range(max(1, self.options.warmup)):
            run()
        fw_runs: list[float] = []
        bw_runs: list[float] = []
        spent = 0.0
        o = self.options
        while not fw_runs or (
            (len(fw_runs) < o.min_repeats and spent < o.slow_s)
            or (spent < o.budget_s and len(fw_runs) < o.max_repeats)
        ):
            fw, bw = run()
            fw_runs.append(fw)
            bw_runs.append(bw)
            spent += fw + bw
        return fw_runs, bw_runs

    def _input_tensor(self, op: OpNode, position: int, name: str, samples: int) -> torch.Tensor:
        import torch

        info = self.graph.tensors[name]
        shape = list(info.shape or ())
        role = self._role(op, position, name)
        floating = info.floating
        if role == "const":
            value = self._constant_value(name)
            if value is not None:
                from tessera.backends.torch_ops import from_numpy

                t = from_numpy(value)
                return (t.to(self.dtype) if floating else t).to(self.device)
            if not floating:
                raise _Unsupported(f"the value of constant {name!r} is unknown")
        elif role == "act" and shape:
            shape[0] *= samples
        if not floating:  # integer or boolean activations: zeros are valid indices and masks
            return torch.zeros(shape, dtype=torch_dtype_of(info.dtype), device=self.device)
        # Positive values: safe for Sqrt, Log, Pow and variances, and no denormals.
        t = torch.rand(shape, dtype=self.dtype, device=self.device) + 0.5
        return t.requires_grad_(role in ("act", "weight"))


def torch_dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a numpy dtype name (``bool`` included)."""
    import torch

    if name == "bool":
        return torch.bool
    if name == "bfloat16":
        return torch.bfloat16
    return torch.from_numpy(np.zeros(0, dtype=np.dtype(name))).dtype


def _no_sync() -> None:
    return None


def _iqr(runs: Sequence[float]) -> float:
    if len(runs) < 2:
        return 0.0
    q = statistics.quantiles(runs, n=4)
    return q[2] - q[0]


def digest(obj: Any) -> str:
    """A cache key: the sha256 of ``obj`` as compact JSON (what JSON cannot write, as its str)."""
    return hashlib.sha256(json.dumps(obj, separators=(",", ":"), default=str).encode()).hexdigest()
