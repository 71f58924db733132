"""ONNX Runtime on the CPU (``CPUExecutionProvider``): always available, the reference backend.

Capability comes from ONNX Runtime's own kernel registry (``get_all_opkernel_def``): the op types,
opset ranges and tensor types the CPU provider has kernels for.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from functools import cached_property
from typing import Any

import numpy as np
import onnx

from tessera.backends.base import Backend, BuildError, Capability, Feeds, model_io
from tessera.core.graph import Graph

log = logging.getLogger(__name__)

_ORT_TYPES = {
    "float": "float32", "double": "float64", "float16": "float16", "bfloat16": "bfloat16",
    "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "bool": "bool",
}  # fmt: skip


def kernel_table(provider: str) -> dict[str, list[tuple[int, int, frozenset[str]]]]:
    """ONNX Runtime's registered kernels of ``provider`` for the default domain.

    Op type → list of (first opset, last opset, tensor dtypes of any type constraint).
    """
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    table: dict[str, list[tuple[int, int, frozenset[str]]]] = {}
    for k in C.get_all_opkernel_def():
        if k.provider != provider or k.domain not in ("", "ai.onnx"):
            continue
        dtypes = {
            _ORT_TYPES[t[7:-1]]
            for types in k.type_constraints.values()
            for t in types
            if t.startswith("tensor(") and t[7:-1] in _ORT_TYPES
        }
        start, end = k.version_range
        table.setdefault(k.op_name, []).append((int(start), int(end), frozenset(dtypes)))
    return table


def default_opset(graph: Graph) -> int:
    return next((o.version for o in graph.model.opset_import if o.domain in ("", "ai.onnx")), 17)


class OrtRunnable:
    """An ``InferenceSession`` over one sub-model.

    Inputs: C-contiguous numpy arrays of the right dtype are handed to ONNX Runtime without a copy
    (it wraps their memory); others are converted once. Outputs: the arrays ONNX Runtime allocates
    are returned as they are (no further copy).
    """

    def __init__(self, session: Any, providers: list[Any]) -> None:
        self.session = session
        self.providers = providers
        self.input_names = tuple(i.name for i in session.get_inputs())
        self.output_names = tuple(o.name for o in session.get_outputs())
        self._dtypes = {i.name: _ort_input_dtype(i.type) for i in session.get_inputs()}

    def run(self, feeds: Feeds, *, timeout_s: float | None = None) -> dict[str, np.ndarray]:
        """The outputs for ``feeds``; with ``timeout_s``, a run still going then is stopped (ONNX
        Runtime's terminate flag, checked between kernels and loop iterations) and raises
        :class:`TimeoutError`: a Loop of 2^62 iterations ends instead of hanging."""
        inputs = {
            name: np.ascontiguousarray(feeds[name], dtype=self._dtypes.get(name)) for name in self.input_names
        }
        if timeout_s is None:
            outputs = self.session.run(list(self.output_names), inputs)
            return dict(zip(self.output_names, outputs, strict=True))
        import onnxruntime as ort

        options = ort.RunOptions()
        options.log_severity_level = 4  # the stop is reported here, not as ORT's error log
        timer = threading.Timer(timeout_s, lambda: setattr(options, "terminate", True))
        timer.start()
        try:
            outputs = self.session.run(list(self.output_names), inputs, options)
        except Exception:
            if options.terminate:
                raise TimeoutError(f"the run took more than {timeout_s:g} s and was stopped") from None
            raise
        finally:
            timer.cancel()
        return dict(zip(self.output_names, outputs, strict=True))


def _ort_input_dtype(type_str: str) -> str | None:
    return _ORT_TYPES.get(type_str[7:-1]) if type_str.startswith("tensor(") else None


# ORT prefixes its messages with the C++ source line and function signature: noise to a user.
_ORT_SOURCE = re.compile(r"/onnxruntime_src/\S+:\d+ [^()]*\([^()]*\) ")


def ort_message(exc: BaseException) -> str:
    """ORT's exception as one line, without the C++ source location it carries."""
    return _ORT_SOURCE.sub("", " ".join(str(exc).split()))


def quiet_native_log() -> None:
    """Keep ORT's own logger off stderr: every failure it logs also comes back as an exception."""
    import onnxruntime as ort

    ort.set_default_logger_severity(4)


def make_session(
    model: onnx.ModelProto,
    providers: list[Any],
    *,
    cpu_fallback: bool = True,
    threads: int = 0,
    spin: bool = True,
) -> Any:
    """An ``InferenceSession`` of ``model``: ``threads`` intra-op threads (0: ORT's default), which
    spin between runs unless ``spin`` is False (a group sharing the cores with other runtimes)."""
    import onnxruntime as ort

    quiet_native_log()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 4  # failures come back as exceptions; ORT would also print them
    if threads:
        options.intra_op_num_threads = threads
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not cpu_fallback:
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:
        return ort.InferenceSession(
            model.SerializeToString(deterministic=True), sess_options=options, providers=providers
        )
    except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
        raise BuildError(
            f"onnxruntime could not build the subgraph: {type(exc).__name__}: {ort_message(exc)}"
        ) from exc


class OnnxRuntimeBackend(Backend):
    """ONNX Runtime's CPU execution provider."""

    name = "onnxruntime"
    distribution = "onnxruntime"
    provider = "CPUExecutionProvider"

    def available(self) -> tuple[bool, str]:
        try:
            import onnxruntime as ort
        except ImportError:
            return False, "onnxruntime not installed"
        if self.provider not in ort.get_available_providers():
            return False, f"onnxruntime {ort.__version__} has no {self.provider}"
        return True, ""

    @property
    def version(self) -> str | None:
        # onnxruntime-gpu installs the same module under another distribution name.
        try:
            import onnxruntime as ort
        except ImportError:
            return None
        return str(ort.__version__)

    @cached_property
    def kernels(self) -> dict[str, list[tuple[int, int, frozenset[str]]]]:
        self.require()
        return kernel_table(self.provider)

    def capability(self) -> Capability:
        dtypes = frozenset().union(*(d for ks in self.kernels.values() for _, _, d in ks))
        return Capability(frozenset(self.kernels), dtypes, f"onnxruntime kernel registry ({self.provider})")

    def supports(self, graph: Graph, nodes: Iterable[str]) -> bool:
        if not self.available()[0]:
            return False
        opset = default_opset(graph)
        for name in nodes:
            op = graph.op(name)
            if op.domain not in ("", "ai.onnx"):
                return False
            if op.op_type == "Constant":  # folded into an initializer when a session loads: no kernel
                continue
            kernels = [d for lo, hi, d in self.kernels.get(op.op_type, ()) if lo <= opset <= hi]
            if not kernels:
                return False
            dtypes = frozenset().union(*kernels)
            for t in (*op.inputs, *op.outputs):
                info = graph.tensors.get(t) if t else None
                if info is not None and info.dtype not in dtypes and info.dtype != "int64":
                    # int64 shape/index operands (Reshape's shape, Gather's indices) are typed apart.
                    return False
        return True

    def prepared(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """The model the session runs (a subclass transforms it: ``onnxruntime-int8`` quantizes)."""
        return model

    def compile(self, model: onnx.ModelProto) -> OrtRunnable:
        return self._compile(model, threads=0, spin=True)

    def compile_threads(self, model: onnx.ModelProto, threads: int) -> OrtRunnable:
        return self._compile(model, threads=threads, spin=False)

    def _compile(self, model: onnx.ModelProto, *, threads: int, spin: bool) -> OrtRunnable:
        self.require()
        model = self.prepared(model)
        session = make_session(model, [self.provider], threads=threads, spin=spin)
        runnable = OrtRunnable(session, [self.provider])
        ins, outs = model_io(model)
        if runnable.input_names != ins or runnable.output_names != outs:  # pragma: no cover
            log.debug("onnxruntime reordered the sub-model's inputs/outputs")
        return runnable
