"""Writing files so that an interrupted run never leaves a half-written one."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import time
from pathlib import Path

from tessera.core.errors import InputError


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename.

    Readers see either the old file or the complete new one, never a partial write: the rename is
    atomic on POSIX file systems, and the data is fsynced before it. A symbolic link is followed
    (the file it points to is replaced, the link stays). A path that exists and is not a regular
    file — ``/dev/null``, ``/dev/stdout``, a named pipe — is written to directly: renaming over
    it would replace the device or pipe with a regular file.
    """
    payload = data.encode() if isinstance(data, str) else data
    target = _replaced(Path(path))
    if target is None:
        _write_into(path, payload)
        return Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_file(target.parent, target)
    try:
        with os.fdopen(fd, "wb") as f:  # closes the descriptor whatever fails below
            # mkstemp makes the file 0600; give it the mode a plain open() would (or the old file's).
            os.fchmod(f.fileno(), target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask())
            f.write(payload)
            f.flush()  # a full disk (ENOSPC) or quota (EDQUOT) shows here or in fsync
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return Path(path)


PIPE_WAIT_S = 5.0  # how long an output that is a named pipe may wait for its reader


def _write_into(path: str | os.PathLike[str], payload: bytes) -> None:
    """Write into an existing non-regular file. Opened without blocking: a named pipe that no process
    opens for reading within :data:`PIPE_WAIT_S` is refused (ENXIO) instead of waited on forever; one
    that is read (``-o >(jq .)``, ``/dev/stdout`` on a pipe) is then written to as usual."""
    deadline = time.monotonic() + PIPE_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            if time.monotonic() > deadline:
                raise InputError(
                    f"a named pipe that no process read within {PIPE_WAIT_S:g} s: nothing takes the output",
                    source=path,
                ) from None
            time.sleep(0.02)
    os.set_blocking(fd, True)
    with os.fdopen(fd, "wb") as stream:
        stream.write(payload)


def write_output(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """:func:`write_atomic` for a file the user named: a failure (no such directory, no
    permission, a full disk) is an :class:`InputError` naming the file, not an internal error."""
    try:
        return write_atomic(path, data)
    except OSError as exc:
        raise InputError(f"cannot write: {exc.strerror or exc}", source=path) from exc


def check_writable(path: str | os.PathLike[str]) -> None:
    """Fail early, before any work, when :func:`write_atomic` could not write ``path``.

    The check creates (and removes) a temporary file where the write would put its own: in the
    directory of the path (after links), or in its nearest existing ancestor when directories
    are missing (the write creates them). Permission bits alone would not tell: root passes
    every access check, and ``/proc`` refuses new files anyway. An existing non-regular file
    (``/dev/null``, a pipe) is written to directly, so only its kind is checked.
    """
    try:
        _check_writable(Path(path))
    except (OSError, RuntimeError) as exc:  # a link loop, a name too long
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InputError(f"cannot write: {reason}", source=path) from exc


def _check_writable(path: Path) -> None:
    if path.is_dir():
        raise InputError("is a directory", source=path)
    target = _replaced(path)
    if target is None:
        return
    where = target.parent
    while not where.exists():
        where = where.parent
    if not where.is_dir():
        raise InputError(f"cannot write: {where} is not a directory", source=path)
    try:
        fd, probe = _temp_file(where, target)
    except OSError as exc:
        raise InputError(f"cannot write in {where}: {exc.strerror or exc}", source=path) from exc
    os.close(fd)
    os.unlink(probe)


def _replaced(path: Path) -> Path | None:
    """The file :func:`write_atomic` renames its temporary file over (a link followed, the link
    stays), or ``None`` for an existing non-regular file it writes into (``stat`` follows links)."""
    if path.exists() and not stat.S_ISREG(path.stat().st_mode):
        return None
    return path.resolve() if path.is_symlink() else path


def _temp_file(directory: Path, target: Path) -> tuple[int, str]:
    return tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
