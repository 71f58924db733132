"""Reading a plan file's JSON: what is not a plan (an ONNX model, a binary, YAML, a huge file) and
what Python's reader would take but JSON is not (duplicate keys, ``NaN``, runaway nesting or digits)
is an :class:`~tessera.core.errors.InputError` naming the file, one line. The schemas are in
:mod:`tessera.core.plans`."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from tessera.core.errors import InputError
from tessera.core.user_files import read_user_file

# A file name that is not UTF-8 reaches Python as text with lone surrogates (os.fsdecode); no
# UTF-8 file can hold them raw, but JSON's \uXXXX escape can, and reads back to the same name.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def json_text(data: Any) -> str:
    """``data`` as the JSON text tessera writes (plans, reports, ``--json``): 2-space indent, UTF-8
    characters as they are, NaN refused, and a non-UTF-8 file name escaped (as ``\\udcff``)."""
    text = json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


# A plan is JSON text of at most this many bytes (a gpp plan of a 10,000-operator model is a few MB).
MAX_PLAN_BYTES = 256 * 2**20


def read_plan_json(path: str | os.PathLike[str], *, command: str | None = None) -> Any:
    """The decoded JSON of the plan file ``path``. ``command`` (e.g. ``validate``) words the
    message for a file that is no plan at all."""
    label = str(path)
    text = _plan_text(path, label, command)
    start = text.lstrip()
    if not start:
        raise InputError("not JSON: the file is empty", source=label)
    if start[0] not in "{[":  # a YAML spec, a log, a CSV: no JSON value starts so for a plan
        first = start.splitlines()[0]
        shown = repr(first) if len(first) <= 40 else repr(first[:40]) + "…"
        raise InputError(f"{_takes(command)} (a JSON object); this text starts with {shown}", source=label)
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", source=label
        ) from None
    except RecursionError:
        raise InputError("not a plausible plan: nested too deeply", source=label) from None
    except ValueError as exc:  # a duplicate key, NaN, an integer of more than 4300 digits
        why = "an integer too long to read" if "integer string conversion" in str(exc) else str(exc)
        raise InputError(f"not a plausible plan: {why}", source=label) from None


def _takes(command: str | None) -> str:
    return f"{command} takes a plan" if command else "expected a plan"


def _plan_text(path: str | os.PathLike[str], label: str, command: str | None) -> str:
    """The file's text; InputError for a missing, unreadable, binary, non-UTF-8 or huge file."""
    raw = read_user_file(path, what="plan", limit=MAX_PLAN_BYTES)
    takes = _takes(command)
    binary = _binary_kind(raw, label)
    if binary is not None:
        raise InputError(f"{takes} ({binary}): the JSON file tessera plan or place writes", source=label)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{takes} (JSON text): byte {exc.start} is not UTF-8 (0x{raw[exc.start]:02x})", source=label
        ) from None


def _binary_kind(raw: bytes, label: str) -> str | None:
    """What a file that is not text is (an ONNX model, an archive, binary data); None for text."""
    if raw.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "this is a zip archive"
    if raw.startswith(b"\x1f\x8b"):
        return "this is gzip-compressed"
    if raw.startswith(b"\x93NUMPY"):
        return "this is a NumPy array"
    # A ModelProto starts with field 1 (ir_version, a varint): tag byte 0x08.
    if raw.startswith(b"\x08") and (label.lower().endswith(".onnx") or _is_onnx(raw)):
        return "this is an ONNX model"
    if b"\0" in raw[:4096]:
        return "this is a binary file"
    return None


def _is_onnx(raw: bytes) -> bool:
    """Whether ``raw`` parses as an ONNX ModelProto with a graph."""
    import onnx  # only for a file that is not text

    model = onnx.ModelProto()
    try:
        model.ParseFromString(raw)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends: not a model
        return False
    return model.HasField("graph")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose key is given twice is refused (Python's reader keeps the last one)."""
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {duplicate!r} in one object")
    return data


def _no_constant(name: str) -> Any:
    """``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (Python's reader takes them)."""
    raise ValueError(f"{name} is not a JSON value")
