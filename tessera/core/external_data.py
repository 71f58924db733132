"""External data of a model read into it when it may be: locations inside the model's folder
only, lazy markers checked, and nothing read when the model with its weights would pass protobuf's
2 GiB (it is then planned from its shapes)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import onnx
from onnx import external_data_helper

from tessera.core.errors import InputError
from tessera.core.weights import LAZY_LOCATION, is_lazy_tensor, lazy_spec

log = logging.getLogger(__name__)

# A model and the external data read into it are one protobuf message: past 2 GiB it cannot be
# serialized (the checker, shape inference and every runtime session serialize it).
MAX_INLINE_BYTES = 2**31 - 2**20
SMALL_BYTES = 64 * 2**10


def load_present_external_data(model: onnx.ModelProto, base_dir: Path, label: str) -> None:
    """Read into ``model`` the external data found in ``base_dir``; InputError naming the tensor for a
    location outside the folder, a bad lazy marker or length, or unreadable data."""
    present = []
    for tensor in external_data_helper._get_all_tensors(model):
        if not external_data_helper.uses_external_data(tensor):
            continue
        entries = {e.key: e.value for e in tensor.external_data}
        relative = entries.get("location", "")
        # ONNX requires a location inside the model's folder; refuse others before touching them.
        if os.path.isabs(relative) or ".." in relative.replace("\\", "/").split("/"):
            raise InputError(
                f"external data of {tensor.name!r} has location {relative!r}, outside the model's folder "
                "(ONNX requires a relative path without '..')",
                source=label,
            )
        if relative == LAZY_LOCATION:
            try:
                lazy_spec(tensor)  # checked where it is read, not in a worker after planning
            except ValueError as exc:
                raise InputError(str(exc), source=label) from None
            continue
        location = base_dir / relative
        if location.is_file():  # else missing weights: shapes still plan, execution will say
            length = entries.get("length", "")
            if length and not length.isdigit():
                raise InputError(f"external data of {tensor.name!r} has length {length[:20]!r}", source=label)
            present.append((tensor, int(length or location.stat().st_size)))
    if model.ByteSize() + sum(size for _, size in present) > MAX_INLINE_BYTES:
        # Small tensors (shapes, indices: what shape inference reads) are read all the same.
        large = sum(size for _, size in present if size > SMALL_BYTES)
        present = [(t, size) for t, size in present if size <= SMALL_BYTES]
        log.warning(
            "%s: its weights larger than %s KiB (%s bytes of external data) are left on disk: with them "
            "the model passes protobuf's 2 GiB, so it is planned from their shapes and cannot be run here",
            label,
            SMALL_BYTES // 1024,
            f"{large:,}",
        )
    for tensor, _ in present:
        try:
            external_data_helper.load_external_data_for_tensor(tensor, str(base_dir))
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            raise InputError(f"external data of {tensor.name!r} unreadable: {exc}", source=label) from None
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]


def unread_weights(model: onnx.ModelProto) -> str | None:
    """Why ``model`` cannot run here for want of weights (external data missing, or left on disk by
    :func:`load_present_external_data`), naming the first; None when every weight is in memory or
    lazily generated."""
    unread = [
        t
        for t in model.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL and not is_lazy_tensor(t)
    ]
    if not unread:
        return None
    where = next((e.value for e in unread[0].external_data if e.key == "location"), "?")
    return (
        f"{len(unread)} weight(s) are not in memory, first {unread[0].name!r} (external data {where!r}: "
        "missing, or left on disk because the model with them passes protobuf's 2 GiB)"
    )
