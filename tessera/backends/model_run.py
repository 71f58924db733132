"""Runs an ONNX model on this CPU to read what it computes (the decoder recognizer's probes).

onnxruntime runs it; where onnxruntime has no CPU kernel for one of its operators at its element types
(bf16: ``Where``, ``MatMul``, … have none), tessera's own torch executor (``backends/torch_module``), which
decodes and trains those graphs, runs it instead. Arrays in and out are numpy; bf16 ones are
ml_dtypes' ``bfloat16`` (what onnx's numpy_helper uses).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx


class ModelRun:
    """One model, loaded once, run many times: ``run(names, feeds)`` gives the named tensors (graph
    outputs). ``runtime`` says which ran it: ``onnxruntime`` or ``torch``."""

    def __init__(self, model: onnx.ModelProto, *, threads: int = 0) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 4  # failures come back as exceptions; ORT would also print them
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        self._session: Any = None
        self._module: Any = None
        try:
            self._session = ort.InferenceSession(
                model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # noqa: BLE001 - only a missing kernel falls back; the rest is raised
            if "NOT_IMPLEMENTED" not in str(exc):
                raise
            from tessera.backends.torch_module import OnnxModule

            self._module = OnnxModule(model, label="<probe>")

    @property
    def runtime(self) -> str:
        return "onnxruntime" if self._session is not None else "torch"

    @property
    def output_names(self) -> list[str]:
        if self._session is not None:
            return [o.name for o in self._session.get_outputs()]
        return list(self._module.output_names)

    def run(self, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        if self._session is not None:
            return list(self._session.run(list(names), dict(feeds)))
        import torch

        from tessera.backends.torch_ops import from_numpy, to_numpy

        with torch.no_grad():
            out = self._module.run({k: from_numpy(v) for k, v in feeds.items()}, tensors=list(names))
        return [to_numpy(out[n]) for n in names]
