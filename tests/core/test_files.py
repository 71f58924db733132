"""Atomic writes: a reader never sees a half-written file, even when the writer is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tessera.core.errors import InputError
from tessera.core.files import check_writable, write_atomic, write_output
from tessera.core.user_files import read_npz


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


@pytest.mark.parametrize("through_link", [False, True])
def test_write_atomic_writes_into_a_pipe_instead_of_replacing_it(tmp_path, through_link):
    """``-o /dev/stdout`` (a link to the process's pipe) or a named pipe: renaming over it would
    swap the pipe or the link (or, as root, a device node) for a regular file."""
    import stat
    import threading

    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    target = fifo
    if through_link:
        target = tmp_path / "stdout"
        target.symlink_to(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_atomic(target, "through the pipe\n")
    reader.join(timeout=10)
    assert got == [b"through the pipe\n"]
    assert stat.S_ISFIFO(fifo.stat().st_mode) and target.is_symlink() == through_link
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"out", target.name})  # no temp file


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc")
def test_write_atomic_writes_into_dev_stdout(tmp_path):
    """``/dev/stdout`` links to ``/proc/self/fd/1``, whose target (``pipe:[…]``) is no path:
    resolving it gave a bogus file name and an internal error."""
    r, w = os.pipe()
    link = tmp_path / "stdout"
    link.symlink_to(f"/proc/self/fd/{w}")
    try:
        write_atomic(link, "plan\n")
    finally:
        os.close(w)
    with os.fdopen(r, "rb") as f:
        assert f.read() == b"plan\n"
    assert link.is_symlink() and [p.name for p in tmp_path.iterdir()] == ["stdout"]


def test_write_output_names_the_file_it_cannot_write(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InputError) as info:
        write_output(blocker / "plan.json", "{}")
    assert info.value.source == str(blocker / "plan.json") and "cannot write" in info.value.message
    assert blocker.read_text() == "x"


def test_check_writable_leaves_nothing_behind(tmp_path):
    """The probe file goes, and directories the write would create are not created early."""
    (tmp_path / "old.json").write_text("old")
    check_writable(tmp_path / "old.json")
    check_writable(tmp_path / "new" / "deeper" / "plan.json")
    assert [p.name for p in tmp_path.iterdir()] == ["old.json"]
    assert (tmp_path / "old.json").read_text() == "old"
    with pytest.raises(InputError, match="is a directory"):
        check_writable(tmp_path)
    check_writable("/dev/null")  # written into, not replaced: only its kind matters


NOT_AN_NPZ = {
    "empty": (lambda p: p.write_bytes(b""), "the file is empty"),
    "a lone .npy": (
        lambda p: np.save(p.open("wb"), [1.0, 2.0]),
        "an array of shape [2], not an .npz",
    ),
    "a broken archive": (lambda p: p.write_bytes(b"PK\x03\x04garbage"), "File is not a zip file"),
    "pickled objects": (
        lambda p: np.savez(p, x=np.array([{"a": 1}], dtype=object)),
        "Object arrays cannot be loaded when allow_pickle=False",
    ),
    "missing": (lambda p: None, "no such data file"),
    "a named pipe": (lambda p: os.mkfifo(p), "expected a data file; this is a named pipe (FIFO)"),
    "a directory": (lambda p: p.mkdir(), "expected a data file; this is a directory"),
    # np.load reads any other bytes as a pickle: it said "pickled (object) data".
    "a text file": (lambda p: p.write_text("x,y\n1,2\n"), "not an .npz archive (a zip of named .npy arrays)"),
}


@pytest.mark.parametrize("case", sorted(NOT_AN_NPZ))
def test_read_npz_names_the_file_and_the_fault(tmp_path, case):
    """``--data``/``--inputs`` files: an empty one raised EOFError, which click turned into
    "aborted" (exit 130); a lone .npy a TypeError (exit 1). All are InputError now."""
    make, fragment = NOT_AN_NPZ[case]
    path = tmp_path / "data.npz"
    make(path)
    with pytest.raises(InputError) as info:
        read_npz(path)
    line = info.value.one_line()
    assert line.startswith(f"{path}: ") and fragment in line


def test_read_npz_returns_the_arrays_by_name(tmp_path):
    np.savez(tmp_path / "d.npz", a=np.arange(3), b=np.ones((2, 2), np.float32))
    got = read_npz(tmp_path / "d.npz")
    assert sorted(got) == ["a", "b"] and got["a"].tolist() == [0, 1, 2] and got["b"].dtype == np.float32


def test_a_named_pipe_no_process_reads_is_refused_not_waited_on(tmp_path, monkeypatch):
    """Writing into an existing FIFO that no process reads blocked forever; it is refused after a
    short wait for a reader (a reader that comes in time gets the output: the test above)."""
    import tessera.core.files as files

    monkeypatch.setattr(files, "PIPE_WAIT_S", 0.2)
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="a named pipe that no process read within 0.2 s"):
        write_output(fifo, "{}\n")
