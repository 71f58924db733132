"""What every backend provides: availability, capability, and compiling a sub-ONNX model to run.

A backend is one module under ``tessera/backends/`` with one :class:`Backend` subclass. It reports,
before anything is compiled, whether it can run here (:meth:`Backend.available`: the package, the
device, the version) and what it can run (:meth:`Backend.capability`, from the runtime's own
op-support query where it has one). :meth:`Backend.supports` answers for a node set of a graph;
:meth:`Backend.compile` turns the standalone model from :meth:`~tessera.core.graph.Graph.extract`
into a :class:`Runnable`.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx

from tessera.core.errors import TesseraError
from tessera.core.graph import Graph

log = logging.getLogger(__name__)

Feeds = Mapping[str, np.ndarray]


class BackendUnavailable(TesseraError):
    """A backend was asked to compile or run while it is unavailable here (the reason is the message)."""


class BuildError(TesseraError):
    """A backend failed to build a subgraph it claimed to support (measured as infinite cost)."""


class Runnable(Protocol):
    """A compiled subgraph: named inputs in, named outputs out (numpy arrays on the host)."""

    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class Capability:
    """What a backend can run, known up front.

    ``op_types``: ONNX op types of the default domain (``None`` when the backend answers per
    subgraph through ``query``); ``dtypes``: numpy dtype names of tensors it accepts; ``source``: where
    the answer comes from (the runtime's kernel registry, its frontend's converter table, …).
    """

    op_types: frozenset[str] | None
    dtypes: frozenset[str]
    source: str
    query: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "op_types": sorted(self.op_types) if self.op_types is not None else None,
            "dtypes": sorted(self.dtypes),
            "source": self.source,
            "query": self.query,
        }


class Backend(ABC):
    """One execution backend (see the module docstring)."""

    name: str = ""
    #: the Python distribution whose version is the backend's version
    distribution: str = ""
    #: False for a backend that computes in a lower precision than the model (``place`` uses it only
    #: under ``--tolerance``); its name says the precision (``openvino-bf16``)
    exact: bool = True
    #: False for a backend whose compiles take seconds per subgraph (TVM): ``place`` measures it only
    #: when ``--backends`` names it, so that a default run stays within minutes
    by_default: bool = True

    @abstractmethod
    def available(self) -> tuple[bool, str]:
        """(True, "") when the backend can run here, else (False, one-line reason naming what is missing)."""

    @property
    def version(self) -> str | None:
        return distribution_version(self.distribution) if self.distribution else None

    @property
    def device(self) -> str:
        """The device the backend runs on, in words (``"cpu: Intel Xeon (2 cores)"``, ``"cuda:0 …"``)."""
        return f"cpu: {cpu_model()} ({cpu_cores()} cores)"

    @abstractmethod
    def capability(self) -> Capability:
        """Op types and dtypes the backend runs (raises :class:`BackendUnavailable` when unavailable)."""

    def supports(self, graph: Graph, nodes: Iterable[str]) -> bool:
        """Whether the backend can run ``nodes`` of ``graph`` as one subgraph (answered up front)."""
        if not self.available()[0]:
            return False
        members = list(nodes)
        cap = self.capability()
        for name in members:
            op = graph.op(name)
            if op.domain not in ("", "ai.onnx"):
                return False
            if cap.op_types is not None and op.op_type not in cap.op_types:
                return False
            for t in (*op.inputs, *op.outputs):
                info = graph.tensors.get(t) if t else None
                if info is not None and info.dtype not in cap.dtypes:
                    return False
        # A backend that answers per subgraph (cap.query) is asked about the extracted sub-model.
        return cap.query is None or self.supports_model(graph.extract(members))

    def supports_model(self, model: onnx.ModelProto) -> bool:
        """The runtime's own answer for a standalone sub-model (backends whose capability has a query)."""
        raise NotImplementedError(f"{self.name}: capability names a query but supports_model is missing")

    @abstractmethod
    def compile(self, model: onnx.ModelProto) -> Runnable:
        """Build ``model`` (a standalone sub-model) into a :class:`Runnable`; raises :class:`BuildError`."""

    def compile_threads(self, model: onnx.ModelProto, threads: int) -> Runnable:
        """:meth:`compile` for a group that shares the cores with other groups or runtimes: at most
        ``threads`` threads (0: the runtime's default count), not spinning between runs, where the
        runtime lets that be set (this default ignores it)."""
        return self.compile(model)

    def calibrate(self, values: Any) -> None:  # noqa: B027 - a hook: most backends have no use for it
        """Hand over the values the model's tensors take on the calibration inputs
        (:class:`~tessera.backends.onnxruntime_int8.TensorValues`), for a backend that quantizes on
        them (``onnxruntime-int8``)."""

    def describe(self) -> dict[str, Any]:
        ok, reason = self.available()
        return {
            "name": self.name,
            "available": ok,
            "reason": reason or None,
            "version": self.version,
            "device": self.device if ok else None,
        }

    def require(self) -> None:
        ok, reason = self.available()
        if not ok:
            raise BackendUnavailable(f"backend {self.name!r} is unavailable: {reason}")

    def __repr__(self) -> str:
        return f"<backend {self.name} {self.version or '(not installed)'}>"


# --- facts about this machine ------------------------------------------------------------------


def distribution_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model string (``/proc/cpuinfo``'s model name, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown cpu"


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` while the block runs (None: left as they are), then
    put back."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@lru_cache(maxsize=1)
def nvidia_gpus() -> tuple[str, ...]:
    """Names of the NVIDIA GPUs the CUDA driver sees (empty without a driver or a GPU)."""
    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            cuda = ctypes.CDLL(lib)
            break
        except OSError:
            continue
    else:
        return ()
    try:
        if cuda.cuInit(0) != 0:
            return ()
        count = ctypes.c_int(0)
        if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return ()
        names = []
        for i in range(count.value):
            device = ctypes.c_int(0)
            buf = ctypes.create_string_buffer(256)
            if cuda.cuDeviceGet(ctypes.byref(device), i) == 0 and cuda.cuDeviceGetName(buf, 256, device) == 0:
                names.append(buf.value.decode(errors="replace"))
            else:
                names.append(f"cuda:{i}")
        return tuple(names)
    except (AttributeError, OSError):  # pragma: no cover - a broken driver install
        return ()


def onnx_dtype(elem_type: int) -> str:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).name


def model_io(model: onnx.ModelProto) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Input names (initializers excluded) and output names of a model."""
    inits = {t.name for t in model.graph.initializer}
    ins = tuple(v.name for v in model.graph.input if v.name not in inits)
    return ins, tuple(v.name for v in model.graph.output)


def default_cache_dir() -> Path:
    """tessera's cache folder: ``$TESSERA_CACHE_DIR``, else ``$XDG_CACHE_HOME/tessera`` or ``~/.cache/tessera``."""
    explicit = os.environ.get("TESSERA_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root).expanduser() / "tessera"


def runs_on(backend_device: str, device: str) -> bool:
    """Whether a backend's device (``"cpu: Intel …"``, ``"cuda:0 …"``) is of kind ``device``
    (``cpu``, ``cuda``; ``gpu`` names ``cuda``)."""
    kind = backend_device.split(":")[0].strip()
    return kind == device or (device == "gpu" and kind == "cuda")
