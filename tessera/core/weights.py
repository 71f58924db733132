"""Deterministic weights, eager or lazy, and the lazy-weight representation.

Every zoo parameter is drawn from its own generator, seeded by the model seed and its name, so it is the
same whether built eagerly or later by :func:`materialize`. Lazy parameters (paper-size models) are ONNX
external-data tensors whose location is ``#tessera-lazy`` (:data:`LAZY_LOCATION`) and whose
``external_data`` entries say how to generate them (``tessera.init``, ``.std``, ``.seed``, ``.slice``).
Load a saved lazy model with ``onnx.load(path, load_external_data=False)`` and check the proto, not the
path. Format: docs/core.md.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto

LAZY_LOCATION = "#tessera-lazy"
"""The external-data ``location`` of a lazily generated parameter."""

_INIT_KEY = "tessera.init"
_STD_KEY = "tessera.std"
_SEED_KEY = "tessera.seed"
_SLICE_KEY = "tessera.slice"


@dataclass(frozen=True)
class Init:
    """How a parameter's values are drawn: ``normal`` (mean 0, ``std``), ``ones`` or ``zeros``."""

    kind: Literal["normal", "ones", "zeros"]
    std: float = 0.0

    @staticmethod
    def normal(std: float) -> Init:
        return Init("normal", float(std))


ONES = Init("ones")
ZEROS = Init("zeros")


def generate(name: str, shape: tuple[int, ...], init: Init, seed: int) -> np.ndarray:
    """The fp32 values of parameter ``name``: a function of (name, shape, init, seed) only."""
    if init.kind == "ones":
        return np.ones(shape, dtype=np.float32)
    if init.kind == "zeros":
        return np.zeros(shape, dtype=np.float32)
    # One generator per parameter, keyed by its name, so generation order does not matter.
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(init.std)
    return values


def lazy_tensor(name: str, shape: tuple[int, ...], init: Init, seed: int) -> TensorProto:
    """An fp32 initializer with real dims whose values :func:`materialize` generates later."""
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (
        ("location", LAZY_LOCATION),
        (_INIT_KEY, init.kind),
        (_STD_KEY, repr(init.std)),
        (_SEED_KEY, str(seed)),
    ):
        tensor.external_data.add(key=key, value=value)
    return tensor


def lazy_slice(tensor: TensorProto, name: str, axis: int, start: int, stop: int) -> TensorProto:
    """Rows (``axis`` 0) or columns (``axis`` 1) ``start:stop`` of the lazy 2-D parameter
    ``tensor``, named ``name``: :func:`materialize` gives it exactly the values of that range of
    ``tensor`` materialized."""
    entries = {entry.key: entry.value for entry in tensor.external_data}
    if _SLICE_KEY in entries:
        raise ValueError(f"{tensor.name} is a slice already")
    dims = [int(d) for d in tensor.dims]
    part = TensorProto()
    part.CopyFrom(tensor)
    part.name = name
    part.dims[axis] = stop - start
    origin = ",".join(map(str, dims))
    part.external_data.add(key=_SLICE_KEY, value=f"{tensor.name};{origin};{axis};{start};{stop}")
    return part


def is_lazy_tensor(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL and any(
        entry.key == "location" and entry.value == LAZY_LOCATION for entry in tensor.external_data
    )


def is_lazy(model: onnx.ModelProto) -> bool:
    """Whether any initializer of ``model`` is a lazily generated parameter."""
    return any(is_lazy_tensor(tensor) for tensor in model.graph.initializer)


def materialize(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every lazy parameter filled with its deterministic values.

    The result is byte-identical to building the same model eagerly. Paper-size models get large
    (GPT-2-like: ~0.65 GB, DLRM: ~5 GB); only materialize one that must actually run.
    """
    result = onnx.ModelProto()
    result.CopyFrom(model)
    for tensor in result.graph.initializer:
        if not is_lazy_tensor(tensor):
            continue
        values = lazy_values(tensor)
        del tensor.external_data[:]
        tensor.ClearField("data_location")
        tensor.raw_data = values.tobytes()
    return result


def lazy_values(tensor: TensorProto) -> np.ndarray:
    """The values of the lazy parameter ``tensor`` (:func:`is_lazy_tensor`), generated."""
    entries = {entry.key: entry.value for entry in tensor.external_data}
    init = Init(entries[_INIT_KEY], float(entries[_STD_KEY]))  # type: ignore[arg-type]
    name, dims = tensor.name, tuple(tensor.dims)
    cut = entries.get(_SLICE_KEY)
    if cut is not None:
        name, origin, axis, start, stop = cut.split(";")
        dims = tuple(int(d) for d in origin.split(","))
    values = generate(name, dims, init, int(entries[_SEED_KEY]))
    if cut is not None:
        span = slice(int(start), int(stop))
        values = np.ascontiguousarray(values[span] if axis == "0" else values[:, span])
    return values
