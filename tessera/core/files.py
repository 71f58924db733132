"""Writing files so that an interrupted run never leaves a half-written one."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename.

    Readers see either the old file or the complete new one, never a partial write: the rename is
    atomic on POSIX file systems, and the data is fsynced before it. A symbolic link is followed
    (the file it points to is replaced, the link stays). A path that exists and is not a regular
    file — ``/dev/null``, ``/dev/stdout``, a named pipe — is written to directly: renaming over
    it would replace the device or pipe with a regular file.
    """
    target = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    if target.exists() and not stat.S_ISREG(target.stat().st_mode):  # stat follows links
        with open(target, "wb") as stream:
            stream.write(payload)
        return Path(path)
    if target.is_symlink():
        target = target.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        # mkstemp makes the file 0600; give it the mode a plain open() would (or the old file's).
        os.fchmod(fd, target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return Path(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
