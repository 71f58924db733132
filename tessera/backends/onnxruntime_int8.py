"""ONNX Runtime in int8 (``onnxruntime-int8``): a reduced-precision backend ``place`` uses only under
``--tolerance``.

Each group is quantized statically with ONNX Runtime's own quantizer (``quantize_static``: QDQ format,
per-channel int8 weights, uint8 activations, MinMax ranges) on the values its inputs take on the
calibration inputs, then run by the CPU provider, which fuses the QDQ pairs into integer kernels.
The values come from :class:`TensorValues` (onnxruntime's fp32 run of the whole model), given to the
backend with :meth:`~tessera.backends.base.Backend.calibrate`. A group with no Conv, MatMul or Gemm
has nothing to quantize and is not this backend's to run. Details: docs/backends.md.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper

from tessera.backends.base import BuildError, model_io
from tessera.backends.onnxruntime import OnnxRuntimeBackend, ort_message
from tessera.core.graph import Graph

#: the operators that make a group worth quantizing (the quantizer then takes every operator it can,
#: so that Relu, MaxPool and Concat between them stay in int8 too)
QUANTIZABLE = frozenset({"Conv", "MatMul", "Gemm"})
#: left in fp32: per-channel quantization of their scale fails at run time in ORT 1.32 (BatchNormalization)
#: or costs accuracy for nothing (the normalizations run in fp32 kernels anyway)
KEPT_FP32 = frozenset({"BatchNormalization", "InstanceNormalization", "LayerNormalization"})
RECIPE = "qdq.3"  # QDQ u8s8 per-channel MinMax (7-bit weights without VNNI), normalizations fp32; bump with any change of quantize()


class TensorValues:
    """The values every tensor of ``graph`` takes on ``feeds``, from onnxruntime in fp32: computed
    on the first request, in one run of the whole model with every tensor as an output."""

    def __init__(self, graph: Graph | None, feeds: Mapping[str, np.ndarray]) -> None:
        self.graph, self.feeds_given = graph, dict(feeds)
        self._values: dict[str, np.ndarray] | None = None

    def constants(self, model: onnx.ModelProto) -> dict[str, np.ndarray]:
        """The tensors of ``model`` (a sub-model of the graph) that the graph computes from weights
        alone (an exporter's shared bias behind an Identity), with their values: weights to the
        quantizer, not activations."""
        if self.graph is None:
            return {}
        produced = (t for n in model.graph.node for t in n.output)
        names = [
            t
            for t in (*model_io(model)[0], *produced)
            if self.graph.producer.get(t) in self.graph.constant_nodes
        ]
        values = self._all()
        return {t: values[t] for t in names if t in values}

    def feeds(self, model: onnx.ModelProto) -> dict[str, np.ndarray]:
        """Calibration inputs of ``model``: the values its inputs take, or, for a tensor the graph does
        not have at that shape (a timing probe's), seeded standard-normal values of its shape."""
        values = self._all()
        rng = np.random.default_rng(0)
        feeds = {}
        for v in model.graph.input:
            dims = tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
            known = values.get(v.name)
            if known is not None and known.shape == dims:
                feeds[v.name] = known
            elif dims and all(dims) and v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
                feeds[v.name] = rng.standard_normal(dims).astype(np.float32)
            else:
                raise BuildError(f"no calibration values for {v.name!r} (not a float tensor of known shape)")
        return feeds

    def _all(self) -> dict[str, np.ndarray]:
        if self._values is None:
            self._values = {**self.feeds_given, **self._run_all()} if self.graph is not None else {}
        return self._values

    def _run_all(self) -> dict[str, np.ndarray]:
        from tessera.backends.onnxruntime import make_session

        assert self.graph is not None
        model = self.graph.extract(self.graph.order)
        known = {v.name for v in model.graph.output}
        for node in model.graph.node:
            for t in node.output:
                info = self.graph.tensors.get(t)
                if t and t not in known and info is not None and info.dtype:
                    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
                    model.graph.output.append(onnx.helper.make_tensor_value_info(t, elem, None))
                    known.add(t)
        session = make_session(model, ["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, self.feeds_given), strict=True))


class _Reader:
    """``quantize_static``'s calibration data reader over one set of feeds."""

    def __init__(self, feeds: dict[str, np.ndarray]) -> None:
        self._feeds: dict[str, np.ndarray] | None = feeds

    def get_next(self) -> dict[str, np.ndarray] | None:
        feeds, self._feeds = self._feeds, None
        return feeds

    def rewind(self) -> None:  # pragma: no cover - called by some calibrators, not MinMax
        pass


class OnnxRuntimeInt8Backend(OnnxRuntimeBackend):
    """ONNX Runtime's CPU provider on statically quantized groups (see the module docstring)."""

    name = "onnxruntime-int8"
    exact = False

    def __init__(self) -> None:
        self.calibration: TensorValues | None = None

    def available(self) -> tuple[bool, str]:
        ok, reason = super().available()
        if not ok:
            return ok, reason
        try:
            import onnxruntime.quantization  # noqa: F401
        except ImportError as exc:  # pragma: no cover - part of every onnxruntime wheel
            return False, f"onnxruntime.quantization does not import: {exc}"
        return True, ""

    @property
    def version(self) -> str | None:
        # The quantization recipe is part of what is measured: profile-cache keys carry it.
        base = super().version
        return base and f"{base}+{RECIPE}"

    def calibrate(self, values: TensorValues) -> None:
        self.calibration = values

    def supports(self, graph: Graph, nodes: Iterable[str]) -> bool:
        members = list(nodes)
        return any(graph.op(n).op_type in QUANTIZABLE for n in members) and super().supports(graph, members)

    def prepared(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """``model`` as this backend runs it: its constant tensors made weights, quantized on the
        calibration values of its inputs (seeded ones for a probe's; see :class:`TensorValues`)."""
        if not any(n.op_type in QUANTIZABLE for n in model.graph.node):
            return model  # nothing to quantize: fp32 as it is
        calibration = self.calibration or TensorValues(None, {})
        model = _with_weights(model, calibration.constants(model))
        return quantize(model, calibration.feeds(model))


@functools.cache
def _vnni() -> bool:
    """Whether this x86 CPU has VNNI (AVX512-VNNI, AVX-VNNI or AMX). Without it onnxruntime's u8s8
    products use ``vpmaddubsw``, whose 16-bit sums saturate: weights then take 7 bits
    (``reduce_range``), as onnxruntime's quantization guide advises (a CNN group: 18% error
    against 0.9% on an AVX2-only AMD EPYC)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def quantize(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` quantized by ONNX Runtime's static quantizer (QDQ, per-channel int8 weights, uint8
    activations) with its activation ranges measured on ``feeds``."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.registry import QDQRegistry

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the quantizer warns through the root logger, on every subgraph
    with tempfile.TemporaryDirectory(prefix="tessera-int8-") as tmp:
        out = Path(tmp) / "quantized.onnx"
        try:
            quantize_static(
                model, out, _Reader(feeds), quant_format=QuantFormat.QDQ, per_channel=True,  # type: ignore[arg-type]
                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                calibrate_method=CalibrationMethod.MinMax, op_types_to_quantize=sorted(set(QDQRegistry) - KEPT_FP32),
                extra_options={"CalibTensorRangeSymmetric": False}, reduce_range=not _vnni(),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the quantizer's many refusals of a model
            raise BuildError(
                f"onnxruntime's quantizer could not quantize the subgraph: {ort_message(exc)}"
            ) from exc
        finally:
            logging.disable(previous)
        return onnx.load(str(out))


def _with_weights(model: onnx.ModelProto, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with the tensors in ``weights`` made initializers of those values (the nodes that
    computed them dropped), and without the graph inputs that only name initializers: the quantizer
    would take both for activations and leave the Conv biases among them in fp32."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    kept_nodes = [n for n in copy.graph.node if not all(t in weights for t in n.output)]
    del copy.graph.node[:]
    copy.graph.node.extend(kept_nodes)
    copy.graph.initializer.extend(onnx.numpy_helper.from_array(v, n) for n, v in sorted(weights.items()))
    inits = {t.name for t in copy.graph.initializer}
    kept = [v for v in copy.graph.input if v.name not in inits]
    del copy.graph.input[:]
    copy.graph.input.extend(kept)
    return copy
