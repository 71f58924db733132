"""The trained model out (``launch --save-model OUT.onnx``): the graph the stages trained, with the
run's final weights in place of its initializers, written atomically; weights past 1 GiB go to one
external-data file beside it (``OUT.onnx.data``), which onnxruntime, ``inspect`` and ``place`` read.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

from tessera.core.errors import InputError
from tessera.core.graph import write_model
from tessera.core.weights import is_lazy, materialize

__all__ = ["save_trained_model", "trained_model"]

EXTERNAL_BYTES = 1 << 30  # weights beyond this are written as external data (protobuf stops at 2 GiB)


def trained_model(model: onnx.ModelProto, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with each initializer named in ``weights`` replaced by its trained value (in the
    initializer's own dtype); InputError when a trained weight is missing or of another shape."""
    out = materialize(model) if is_lazy(model) else onnx.ModelProto.FromString(model.SerializeToString())
    inits = {t.name: t for t in out.graph.initializer}
    unknown = sorted(set(weights) - set(inits))
    if unknown:
        raise InputError(f"trained weight(s) {', '.join(unknown[:5])} are not initializers of the model")
    for name, value in weights.items():
        t = inits[name]
        if tuple(value.shape) != tuple(t.dims):
            raise InputError(
                f"trained weight {name!r} has shape {list(value.shape)}, the model's {list(t.dims)}"
            )
        t.CopyFrom(numpy_helper.from_array(value.astype(helper.tensor_dtype_to_np_dtype(t.data_type)), name))
    return out


def save_trained_model(model: onnx.ModelProto, path: str | os.PathLike[str]) -> list[Path]:
    """Write ``model`` to ``path`` atomically (readers see the old file or the whole new one); past
    1 GiB of weights, with its initializers in ``<path>.data`` (written, then the model). Returns
    the files written."""
    path = Path(path)
    weights = sum(t.ByteSize() for t in model.graph.initializer)
    if weights <= EXTERNAL_BYTES:
        return [write_model(model, path)]
    data = path.with_name(path.name + ".data")
    external_data_helper.convert_model_to_external_data(
        model, all_tensors_to_one_file=True, location=data.name, size_threshold=1024
    )
    try:
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
            staged = Path(tmp) / path.name
            onnx.save_model(model, staged)  # writes the data beside it, under data.name
            os.replace(Path(tmp) / data.name, data)
            os.replace(staged, path)
    except OSError as exc:
        raise InputError(f"cannot write: {exc.strerror or exc}", source=str(path)) from exc
    return [path, data]
