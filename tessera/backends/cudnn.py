"""cuDNN (and cuBLAS) through ONNX Runtime's CUDA execution provider.

Needs ``onnxruntime-gpu`` (it replaces ``onnxruntime``; the CPU build has no CUDA provider) and an
NVIDIA GPU. Capability is ONNX Runtime's kernel registry for ``CUDAExecutionProvider``; sessions are
built with CPU fallback disabled, so a subgraph either runs entirely on the GPU or fails to build
(and is costed as infinite).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from tessera.backends.base import Feeds, nvidia_gpus
from tessera.backends.onnxruntime import OnnxRuntimeBackend, make_session


class CudaRunnable:
    """An ONNX Runtime CUDA session run through IO binding.

    Inputs are host numpy arrays: ONNX Runtime copies them to the GPU (one host-to-device copy per
    input, unavoidable for host memory). Outputs are bound to GPU memory and copied back once
    (``copy_outputs_to_cpu``).
    """

    def __init__(self, session: Any) -> None:
        self.session = session
        self.input_names = tuple(i.name for i in session.get_inputs())
        self.output_names = tuple(o.name for o in session.get_outputs())

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]:
        binding = self.session.io_binding()
        for name in self.input_names:
            binding.bind_cpu_input(name, np.ascontiguousarray(feeds[name]))
        for name in self.output_names:
            binding.bind_output(name, "cuda")
        self.session.run_with_iobinding(binding)
        outputs = binding.copy_outputs_to_cpu()
        return dict(zip(self.output_names, outputs, strict=True))


class CudnnBackend(OnnxRuntimeBackend):
    """ONNX Runtime's CUDA execution provider (cuDNN convolutions, cuBLAS GEMMs) on GPU 0."""

    name = "cudnn"
    distribution = "onnxruntime-gpu"
    provider = "CUDAExecutionProvider"

    def available(self) -> tuple[bool, str]:
        missing = []
        try:
            import onnxruntime as ort

            if self.provider not in ort.get_available_providers():
                missing.append(
                    f"onnxruntime-gpu not installed (onnxruntime {ort.__version__} has no {self.provider})"
                )
        except ImportError:
            missing.append("onnxruntime-gpu not installed")
        if not nvidia_gpus():
            missing.append("no NVIDIA GPU")
        return (not missing), "; ".join(missing)

    @property
    def version(self) -> str | None:
        from tessera.backends.base import distribution_version

        return distribution_version(self.distribution)

    @property
    def device(self) -> str:
        gpus = nvidia_gpus()
        return f"cuda:0 {gpus[0]}" if gpus else "cuda:0 (no NVIDIA GPU)"

    def compile(self, model: onnx.ModelProto) -> CudaRunnable:  # type: ignore[override]
        self.require()
        providers = [(self.provider, {"device_id": 0, "cudnn_conv_algo_search": "EXHAUSTIVE"})]
        return CudaRunnable(make_session(model, providers, cpu_fallback=False))
