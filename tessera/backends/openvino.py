"""OpenVINO on the CPU plugin.

Capability is OpenVINO's own answer per subgraph: the sub-model is read by OpenVINO's ONNX frontend
and ``Core.query_model(model, "CPU")`` lists the operations the CPU plugin runs; a subgraph is
supported when the frontend converts every operator and the plugin runs every resulting operation.
"""

from __future__ import annotations

import hashlib
import logging
from functools import cached_property
from typing import Any

import numpy as np
import onnx

from tessera.backends.base import Backend, BuildError, Capability, Feeds, model_io

log = logging.getLogger(__name__)

DEVICE = "CPU"
_STRUCTURAL_OPS = frozenset({"Parameter", "Result", "Constant"})
DTYPES = frozenset({"float32", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool"})


class OpenVinoRunnable:
    """A compiled model and one infer request.

    Inputs are wrapped as OpenVINO tensors sharing the numpy arrays' memory (no copy for C-contiguous
    arrays of the right dtype). Outputs: a fresh numpy array per output and run is set as the request's
    output tensor, so the plugin writes the result straight into memory the caller owns.
    """

    def __init__(self, compiled: Any, input_names: tuple[str, ...], output_names: tuple[str, ...]) -> None:
        import openvino as ov

        self._ov = ov
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.input_names = input_names
        self.output_names = output_names
        self._inputs = [compiled.input(n) for n in input_names]
        self._outputs = [compiled.output(n) for n in output_names]
        self._out_specs = [
            (tuple(int(d) for d in o.get_shape()), np.dtype(o.get_element_type().to_dtype()))
            for o in self._outputs
        ]

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]:
        ov = self._ov
        for port, name in zip(self._inputs, self.input_names, strict=True):
            array = np.ascontiguousarray(feeds[name], dtype=port.get_element_type().to_dtype())
            self.request.set_tensor(port, ov.Tensor(array, shared_memory=True))
        results: dict[str, np.ndarray] = {}
        for port, name, (shape, dtype) in zip(self._outputs, self.output_names, self._out_specs, strict=True):
            out = np.empty(shape, dtype=dtype)
            self.request.set_tensor(port, ov.Tensor(out, shared_memory=True))
            results[name] = out
        self.request.infer()
        return results


class OpenVinoBackend(Backend):
    """OpenVINO's CPU plugin."""

    name = "openvino"
    distribution = "openvino"

    def __init__(self, precision: str = "f32") -> None:
        # The CPU plugin defaults to bf16 on CPUs with native bf16 (AMX, AVX512-BF16); fp32 models
        # keep fp32 semantics unless asked otherwise: ``openvino`` is f32, ``openvino-bf16`` bf16.
        self.precision = precision
        if precision != "f32":
            self.name, self.exact = f"openvino-{precision}", False

    def available(self) -> tuple[bool, str]:
        try:
            import openvino as ov
        except ImportError:
            return False, "openvino not installed"
        try:
            devices = self.core.available_devices
        except Exception as exc:  # noqa: BLE001 - a broken plugin install
            return False, f"openvino {ov.get_version()} cannot start: {exc}"
        if DEVICE not in devices:
            return False, f"openvino has no {DEVICE} plugin (devices: {', '.join(devices) or 'none'})"
        if self.precision != "f32":
            native = self.core.get_property(DEVICE, "OPTIMIZATION_CAPABILITIES")
            if self.precision.upper() not in native:
                return (
                    False,
                    f"this CPU has no native {self.precision} (OpenVINO's CPU plugin: {', '.join(native)})",
                )
        return True, ""

    @cached_property
    def core(self) -> Any:
        import openvino as ov

        return ov.Core()

    @property
    def device(self) -> str:
        try:
            name = self.core.get_property(DEVICE, "FULL_DEVICE_NAME")
        except Exception:  # noqa: BLE001
            return super().device
        return f"cpu: {name} (openvino {DEVICE} plugin, {self.precision})"

    def capability(self) -> Capability:
        self.require()
        return Capability(None, DTYPES, "openvino CPU plugin", query="Core.query_model on the sub-model")

    @cached_property
    def _query_cache(self) -> dict[str, bool]:
        return {}

    def supports_model(self, model: onnx.ModelProto) -> bool:
        """OpenVINO's own answer for a standalone model: frontend conversion + ``query_model``."""
        data = model.SerializeToString(deterministic=True)
        key = hashlib.sha256(data).hexdigest()
        if key not in self._query_cache:
            self._query_cache[key] = self._query(data)
        return self._query_cache[key]

    def _query(self, data: bytes) -> bool:
        try:
            ov_model = self.core.read_model(data, b"")
            supported = self.core.query_model(ov_model, DEVICE)
        except Exception as exc:  # noqa: BLE001 - the frontend rejects unsupported ONNX ops
            log.debug("openvino does not take the subgraph: %s", " ".join(str(exc).split())[:200])
            return False
        return all(
            op.get_friendly_name() in supported
            for op in ov_model.get_ops()
            if op.get_type_name() not in _STRUCTURAL_OPS
        )

    def compile(self, model: onnx.ModelProto) -> OpenVinoRunnable:
        return self.compile_threads(model, 0)

    def compile_threads(self, model: onnx.ModelProto, threads: int) -> OpenVinoRunnable:
        self.require()
        ins, outs = model_io(model)
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": self.precision}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        try:
            ov_model = self.core.read_model(model.SerializeToString(deterministic=True), b"")
            compiled = self.core.compile_model(ov_model, DEVICE, config)
            return OpenVinoRunnable(compiled, ins, outs)
        except Exception as exc:  # noqa: BLE001 - openvino raises RuntimeError with multi-line text
            raise BuildError(
                f"openvino could not build the subgraph: {' '.join(str(exc).split())[:300]}"
            ) from exc
