"""Sparse initializers (``graph.sparse_initializer``) made dense when a model is read: every
backend, the interpreter and the planners see one kind of weight. Indices are checked against the
dense shape, and the dense size is bounded before anything is allocated."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import numpy_helper

from tessera.core.errors import InputError

# The largest dense weight a sparse one may expand to (ONNX's 2 GiB protobuf limit for inline data).
MAX_DENSE_BYTES = 2**31 - 1


def densify(model: onnx.ModelProto, *, label: str) -> onnx.ModelProto:
    """``model`` with each sparse initializer replaced by the dense initializer it stands for;
    InputError naming it for indices outside its shape or a dense size past 2 GiB."""
    graph = model.graph
    if not graph.sparse_initializer:
        return model
    for sparse in graph.sparse_initializer:
        graph.initializer.append(_dense(sparse, label))
    del graph.sparse_initializer[:]
    return model


def _dense(sparse: onnx.SparseTensorProto, label: str) -> onnx.TensorProto:
    name, dims = sparse.values.name, tuple(int(d) for d in sparse.dims)
    try:
        values = numpy_helper.to_array(sparse.values).reshape(-1)
        indices = numpy_helper.to_array(sparse.indices).astype(np.int64, copy=False)
    except (ValueError, TypeError) as exc:
        raise InputError(f"sparse initializer {name!r} is unreadable: {exc}", source=label) from None
    size = math.prod(dims)
    if any(d < 0 for d in dims) or size * values.dtype.itemsize > MAX_DENSE_BYTES:
        raise InputError(
            f"sparse initializer {name!r} has dims {list(dims)}: its dense form would exceed 2 GiB",
            source=label,
        )
    if indices.ndim == 2 and indices.shape[1] == len(dims) and indices.size:  # [NNZ, rank] coordinates
        if (indices < 0).any() or (indices >= np.array(dims)).any():
            raise InputError(
                f"sparse initializer {name!r} has indices outside its dims {list(dims)}", source=label
            )
        flat = np.ravel_multi_index(indices.T, dims)
    elif indices.ndim == 1 or not indices.size:  # linear positions
        flat = indices.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= size):
            raise InputError(
                f"sparse initializer {name!r} has indices outside its {size} elements", source=label
            )
    else:
        raise InputError(
            f"sparse initializer {name!r} has indices of shape {list(indices.shape)}", source=label
        )
    if flat.shape[0] != values.shape[0]:
        raise InputError(
            f"sparse initializer {name!r} has {values.shape[0]} values for {flat.shape[0]} indices",
            source=label,
        )
    dense = np.zeros(size, dtype=values.dtype)
    dense[flat] = values
    return numpy_helper.from_array(dense.reshape(dims), name)
