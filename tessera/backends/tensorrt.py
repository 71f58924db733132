"""NVIDIA TensorRT through its Python API: an engine built from the sub-ONNX model.

Needs the ``tensorrt`` package, an NVIDIA GPU, and torch with CUDA (for device buffers and the
stream). Capability is TensorRT's own ONNX parser: ``OnnxParser.supports_model_v2`` (or
``supports_model`` on older releases) on the sub-model. Engines are serialized to
``<cache>/tensorrt/<sha256 of model, TensorRT version, GPU>.engine`` and reused.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tessera.backends.base import Backend, BuildError, Capability, Feeds, default_cache_dir, nvidia_gpus
from tessera.core.files import write_atomic

log = logging.getLogger(__name__)

DTYPES = frozenset({"float32", "float16", "bfloat16", "int8", "int32", "int64", "bool", "uint8"})
WORKSPACE_BYTES = 1 << 30


class TensorRtRunnable:
    """A TensorRT execution context over one engine.

    Inputs are host numpy arrays copied to the GPU once each (host-to-device); outputs are written to
    GPU buffers and copied back once (device-to-host). Nothing else is copied.
    """

    def __init__(self, engine: Any, input_names: tuple[str, ...], output_names: tuple[str, ...]) -> None:
        import tensorrt as trt
        import torch

        self._torch = torch
        self.engine = engine
        self.context = engine.create_execution_context()
        self.input_names = input_names
        self.output_names = output_names
        self._out_specs = {
            name: (tuple(engine.get_tensor_shape(name)), np.dtype(trt.nptype(engine.get_tensor_dtype(name))))
            for name in output_names
        }
        self.stream = torch.cuda.Stream()

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]:
        torch = self._torch
        keep = []
        for name in self.input_names:
            tensor = torch.from_numpy(np.ascontiguousarray(feeds[name])).to("cuda", non_blocking=False)
            keep.append(tensor)
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for name, (shape, dtype) in self._out_specs.items():
            out = torch.empty(shape, dtype=getattr(torch, dtype.name), device="cuda")
            outputs[name] = out
            self.context.set_tensor_address(name, out.data_ptr())
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise BuildError("tensorrt failed to execute the engine")
        self.stream.synchronize()
        return {name: out.cpu().numpy() for name, out in outputs.items()}


class TensorRtBackend(Backend):
    """TensorRT on GPU 0, engines cached on disk by content hash."""

    name = "tensorrt"
    distribution = "tensorrt"

    def __init__(self, cache_dir: str | Path | None = None) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "tensorrt"

    def available(self) -> tuple[bool, str]:
        missing = []
        if importlib.util.find_spec("tensorrt") is None:
            missing.append("tensorrt not installed")
        if not nvidia_gpus():
            missing.append("no NVIDIA GPU")
        if not missing:
            try:
                import torch

                if not torch.cuda.is_available():
                    missing.append(f"torch {torch.__version__} has no CUDA (needed for TensorRT buffers)")
            except ImportError:
                missing.append("torch not installed (needed for TensorRT buffers)")
        return (not missing), "; ".join(missing)

    @property
    def version(self) -> str | None:
        if importlib.util.find_spec("tensorrt") is None:
            return None
        try:
            import tensorrt as trt

            return str(trt.__version__)
        except Exception:  # noqa: BLE001 - a wheel without its native libraries
            return None

    @property
    def device(self) -> str:
        gpus = nvidia_gpus()
        return f"cuda:0 {gpus[0]}" if gpus else "cuda:0 (no NVIDIA GPU)"

    @cached_property
    def _logger(self) -> Any:
        import tensorrt as trt

        return trt.Logger(trt.Logger.WARNING)

    def capability(self) -> Capability:
        self.require()
        return Capability(
            None, DTYPES, "tensorrt ONNX parser", query="OnnxParser.supports_model_v2 on the sub-model"
        )

    def supports_model(self, model: onnx.ModelProto) -> bool:
        import tensorrt as trt

        data = model.SerializeToString(deterministic=True)
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, self._logger)
        if hasattr(parser, "supports_model_v2"):
            return bool(parser.supports_model_v2(data))
        ok, _subgraphs = parser.supports_model(data)
        return bool(ok)

    def engine_path(self, data: bytes) -> Path:
        gpu = (nvidia_gpus() or ("no-gpu",))[0]
        key = hashlib.sha256(data + f"|{self.version}|{gpu}".encode()).hexdigest()
        return self.cache_dir / f"{key}.engine"

    def build_engine(self, model: onnx.ModelProto) -> bytes:
        """The serialized engine of ``model``, from the engine cache or built now (and cached)."""
        import tensorrt as trt

        data = model.SerializeToString(deterministic=True)
        path = self.engine_path(data)
        if path.is_file():
            return path.read_bytes()
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse(data):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise BuildError(f"tensorrt could not parse the subgraph: {errors[:300]}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise BuildError("tensorrt could not build an engine for the subgraph")
        engine = bytes(serialized)
        write_atomic(path, engine)
        return engine

    def compile(self, model: onnx.ModelProto) -> TensorRtRunnable:
        self.require()
        import tensorrt as trt

        from tessera.backends.base import model_io

        try:
            engine = trt.Runtime(self._logger).deserialize_cuda_engine(self.build_engine(model))
        except BuildError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise BuildError(f"tensorrt failed: {type(exc).__name__}: {exc}") from exc
        if engine is None:
            raise BuildError("tensorrt could not deserialize the engine")
        ins, outs = model_io(model)
        return TensorRtRunnable(engine, ins, outs)
