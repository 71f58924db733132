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
from typing import Any, Literal

import numpy as np
import onnx
from onnx import TensorProto

LAZY_LOCATION = "#tessera-lazy"
"""The external-data ``location`` of a lazily generated parameter."""
UNREAD_LOCATION = "#tessera-unread"
"""The external-data ``location`` of a part of a weight that was not read (shapes only)."""

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


@dataclass(frozen=True)
class LazySpec:
    """What a lazy parameter's markers say, checked: its values are those of ``source`` (of
    ``dims``) generated with ``init`` and ``seed``, then ``cut`` = (axis, start, stop) taken."""

    source: str
    dims: tuple[int, ...]
    init: Init
    seed: int
    cut: tuple[int, int, int] | None


def lazy_spec(tensor: TensorProto) -> LazySpec:
    """The markers of the lazy parameter ``tensor``, each checked where it is parsed: a ValueError
    naming the marker for an unknown init, a std that is not a finite number ≥ 0, a seed that is no
    integer, or a slice that does not fit its source or the tensor's dims. Nothing is defaulted."""
    entries = {entry.key: entry.value for entry in tensor.external_data}
    missing = [k for k in (_INIT_KEY, _STD_KEY, _SEED_KEY) if k not in entries]
    if missing:
        raise ValueError(f"lazy parameter {tensor.name!r} lacks {', '.join(missing)}")
    if tensor.data_type != TensorProto.FLOAT:
        raise ValueError(f"lazy parameter {tensor.name!r} is not float32 (data_type {tensor.data_type})")
    kind, std = entries[_INIT_KEY], _number(tensor.name, _STD_KEY, entries[_STD_KEY], float)
    if kind not in ("normal", "ones", "zeros"):
        raise ValueError(f"lazy parameter {tensor.name!r}: {_INIT_KEY} {kind!r} is not normal, ones or zeros")
    if not (np.isfinite(std) and std >= 0):
        raise ValueError(f"lazy parameter {tensor.name!r}: {_STD_KEY} {std!r} is not a finite number >= 0")
    seed = _number(tensor.name, _SEED_KEY, entries[_SEED_KEY], int)
    if not 0 <= seed < 2**63:
        raise ValueError(f"lazy parameter {tensor.name!r}: {_SEED_KEY} {seed} is outside 0..2^63-1")
    dims = tuple(int(d) for d in tensor.dims)
    if _SLICE_KEY not in entries:
        return LazySpec(tensor.name, dims, Init(kind, std), seed, None)  # type: ignore[arg-type]
    parts = entries[_SLICE_KEY].split(";")
    try:
        source, origin_text, *numbers = parts
        origin = tuple(int(d) for d in origin_text.split(","))
        axis, start, stop = (int(n) for n in numbers)
    except ValueError:
        raise ValueError(
            f"lazy parameter {tensor.name!r}: {_SLICE_KEY} {entries[_SLICE_KEY][:60]!r} is not "
            "SOURCE;D0,D1;AXIS;START;STOP"
        ) from None
    fits = len(origin) == 2 and axis in (0, 1) and 0 <= start < stop <= origin[axis]
    if not fits or tuple(stop - start if i == axis else d for i, d in enumerate(origin)) != dims:
        raise ValueError(
            f"lazy parameter {tensor.name!r}: {_SLICE_KEY} cuts {start}:{stop} on axis {axis} of "
            f"{list(origin)}, which is not its dims {list(dims)}"
        )
    return LazySpec(source, origin, Init(kind, std), seed, (axis, start, stop))  # type: ignore[arg-type]


def _number(name: str, key: str, text: str, kind: type) -> Any:
    try:
        return kind(text)
    except (ValueError, OverflowError):
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"lazy parameter {name!r}: {key} {text[:40]!r} is not {what}") from None


def lazy_values(tensor: TensorProto) -> np.ndarray:
    """The values of the lazy parameter ``tensor`` (:func:`is_lazy_tensor`), generated."""
    spec = lazy_spec(tensor)
    values = generate(spec.source, spec.dims, spec.init, spec.seed)
    if spec.cut is not None:
        axis, start, stop = spec.cut
        values = np.ascontiguousarray(values[start:stop] if axis == 0 else values[:, start:stop])
    return values
