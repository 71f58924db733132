"""Atomic writes: a reader never sees a half-written file, even when the writer is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tessera.core.files import write_atomic


def test_write_atomic_replaces_whole_file(tmp_path):
    path = tmp_path / "plan.json"
    write_atomic(path, "old")
    write_atomic(path, b"new contents")
    assert path.read_bytes() == b"new contents"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temp file left
    assert path.stat().st_mode & 0o077 == 0o666 & ~_current_umask() & 0o077  # not mkstemp's 0600


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_killed_writer_leaves_the_old_file_intact(tmp_path):
    """A writer killed in the middle of a large write leaves the previous plan, never a partial one."""
    path = tmp_path / "plan.json"
    write_atomic(path, "previous plan\n")
    script = (
        "import sys, time\n"
        "from tessera.core.files import write_atomic\n"
        "import os\n"
        "orig = os.fsync\n"
        "def slow_fsync(fd):\n    print('writing', flush=True); time.sleep(30); orig(fd)\n"
        "os.fsync = slow_fsync\n"
        f"write_atomic({str(path)!r}, b'x' * 50_000_000)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"  # the data is written, not yet renamed
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert path.read_text() == "previous plan\n"
    leftovers = [p for p in tmp_path.iterdir() if p.name != "plan.json"]
    # The killed writer's temp file may remain (it is hidden and never read as a plan).
    assert all(p.name.startswith(".plan.json.") and p.name.endswith(".tmp") for p in leftovers)
    assert os.path.getsize(path) == len("previous plan\n")


def test_write_atomic_follows_a_symlink(tmp_path):
    real = tmp_path / "plans" / "plan.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(real)
    write_atomic(link, "new")
    assert link.is_symlink() and link.resolve() == real.resolve()  # the link stays a link
    assert real.read_text() == "new"


def test_write_atomic_writes_into_a_pipe_instead_of_replacing_it(tmp_path):
    """``-o /dev/stdout`` or a named pipe: renaming over it would swap the pipe (or, as root, the
    device node) for a regular file."""
    import stat
    import threading

    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_atomic(fifo, "through the pipe\n")
    reader.join(timeout=10)
    assert got == [b"through the pipe\n"]
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp file beside it
