"""Reading the files users name: regular files only, refused before opening otherwise, and capped.

Every model, plan, config, data, prompts and lengths file goes through :func:`regular_file` (a
named pipe would block the read forever, ``/dev/zero`` would fill memory) and, when read whole,
:func:`read_user_file` with a size cap of its kind. ``.npz`` archives are read by
:func:`read_npz`, which checks every array's header (and what the caller expects of it) before any
array's data is inflated.
"""

from __future__ import annotations

import os
import stat
import tokenize
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tessera.core.errors import InputError

MAX_MODEL_BYTES = 2**31 - 1  # protobuf parses no message larger; weights beyond go in external data
MAX_TEXT_BYTES = 64 * 2**20  # prompts, output lengths: text a person or a script writes

_KINDS = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def regular_file(path: str | os.PathLike[str], *, what: str) -> Path:
    """``path`` when it is a regular file (links followed); an InputError naming it otherwise.

    ``stat`` never blocks, so a FIFO or a device is refused before anything opens it.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise InputError(f"no such {what} file", source=path) from None
    except (OSError, ValueError) as exc:  # a name too long, a link loop, a NUL byte
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InputError(f"cannot read the {what}: {reason}", source=path) from None
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise InputError(f"expected {_a(what)} file; this is {kind}", source=path)
    return Path(path)


def read_user_file(path: str | os.PathLike[str], *, what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (InputError beyond).

    The file is opened without blocking and checked again on its descriptor, so a pipe put in its
    place after :func:`regular_file` cannot hang the read either.
    """
    regular_file(path, what=what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise InputError(f"cannot read the {what}: {exc.strerror or exc}", source=path) from None
    with os.fdopen(fd, "rb") as stream:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"expected {_a(what)} file; this is not a regular file", source=path)
        if info.st_size > limit:
            raise InputError(_too_large(what, info.st_size, limit), source=path)
        try:
            raw = stream.read(info.st_size + 1)  # not limit + 1: read(n) allocates n bytes first
            while info.st_size < len(raw) <= limit and (more := stream.read(2**20)):  # it grows
                raw += more
        except OSError as exc:
            raise InputError(f"cannot read the {what}: {exc.strerror or exc}", source=path) from None
    if len(raw) > limit:
        raise InputError(_too_large(what, len(raw), limit), source=path)
    return raw


def read_model_bytes(path: str | os.PathLike[str]) -> bytes:
    """An ONNX file's bytes (a FIFO, a device or a file past protobuf's 2 GiB refused unread)."""
    return read_user_file(path, what="ONNX model", limit=MAX_MODEL_BYTES)


def _too_large(what: str, size: int, limit: int) -> str:
    return f"{size:,} bytes, more than the {_size(limit)} {_a(what)} file may hold"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n + 1 >= scale:
            return f"{(n + 1) / scale:g} {unit}"
    return f"{n} bytes"


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


# An array header: (name, dtype, shape). A check raises InputError (naming the array) to refuse it,
# returns False to skip the array unread, True to read it.
ArrayCheck = Callable[[str, np.dtype, tuple[int, ...]], bool]


def read_npz(
    path: str | os.PathLike[str], what: str = "data", *, wanted: ArrayCheck | None = None
) -> dict[str, Any]:
    """The arrays of an ``.npz`` archive by name; InputError naming ``path`` for anything else
    (missing, not a regular file, empty, a lone ``.npy``, a broken archive, pickled objects).

    Each member's ``.npy`` header is read first: an array whose header declares more bytes than
    the member holds is refused, and ``wanted`` sees every header before any data is inflated, so
    an archive that declares 10^11 floats or inflates to gigabytes the model never reads costs
    nothing.
    """
    regular_file(path, what=what)
    try:
        with open(path, "rb") as fh:
            head = fh.read(6)
        if not head:
            raise InputError(f"cannot read {what}: the file is empty", source=str(path))
        if not head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
            if head.startswith(b"\x93NUMPY"):
                with open(path, "rb") as fh:
                    _, shape, _ = npy_header(fh)
                raise ValueError(f"an array of shape {list(shape)}, not an .npz archive of named arrays")
            # np.load reads anything else as a pickle and refuses it as "pickled data".
            raise ValueError("not an .npz archive (a zip of named .npy arrays)")
        with zipfile.ZipFile(path) as archive:
            return _members(archive, path, wanted)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise InputError(f"cannot read {what}: {' '.join(str(exc).split())}", source=str(path)) from None


def _members(
    archive: zipfile.ZipFile, path: str | os.PathLike[str], wanted: ArrayCheck | None
) -> dict[str, Any]:
    arrays: dict[str, Any] = {}
    for info in archive.infolist():
        if not info.filename.endswith(".npy"):
            continue
        name = info.filename[: -len(".npy")]
        with archive.open(info) as member:
            dtype, shape, fortran = npy_header(member)
            declared = dtype.itemsize * int(np.prod(shape, dtype=object))
            if declared > info.file_size:
                raise InputError(
                    f"array {name!r} declares shape {list(shape)} ({declared:,} bytes) but holds "
                    f"{info.file_size:,}",
                    source=str(path),
                )
            if wanted is not None and not wanted(name, dtype, shape):
                continue
            array = np.empty(shape, dtype=dtype, order="F" if fortran else "C")
            view = memoryview(array.reshape(-1, order="A").view(np.uint8)) if declared else b""
            if declared and member.readinto(view) != declared:
                raise ValueError(f"array {name!r} is truncated")
        arrays[name] = array
    return arrays


def npy_header(stream: Any) -> tuple[np.dtype, tuple[int, ...], bool]:
    """dtype, shape and order of the ``.npy`` at the start of ``stream``; ValueError for anything
    else (numpy parses the header as a Python literal: a broken one raised tokenize's TokenError or
    a SyntaxError, which no caller expects), and for object arrays."""
    fmt = np.lib.format
    version = fmt.read_magic(stream)
    reader = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
    if reader is None:
        raise ValueError(f".npy format version {version} is not supported")
    try:
        shape, fortran, dtype = reader(stream)
    except (SyntaxError, tokenize.TokenError, TypeError, RecursionError, MemoryError) as exc:
        raise ValueError(f"the .npy header is not valid ({type(exc).__name__})") from None
    if dtype.hasobject:
        raise ValueError("Object arrays cannot be loaded when allow_pickle=False")
    return dtype, tuple(shape), fortran
