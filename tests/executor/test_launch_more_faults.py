"""More faults around ``launch`` and ``plan`` (#29): a launcher killed with SIGKILL (its workers must
not outlive it), a ``--master-port`` another launch holds, and a full disk under ``plan -o``.

Each refusal is one line on stderr with the README's exit code, and nothing partial is left: no
plan, no temporary file, an older plan at the same path untouched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runner import run_cli
from executor.processes import start_launch, still_running, workers_of
from executor.test_launch_faults import TINY_LLM

import tessera.core.files as files
import tessera.executor.launcher as launcher


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder (the current directory) holding a tiny LLM config; returns it."""
    monkeypatch.chdir(tmp_path)
    Path("tiny.yaml").write_text(TINY_LLM)
    return tmp_path


def _plan_args(out: str) -> list[str]:
    """``plan --kind cp`` of the tiny config on this machine's two cores: a cp plan of degree 2."""
    return ["plan", "--llm", "tiny.yaml", "--kind", "cp", "--cluster", "local-cpu-split", "--batch", "4",
            "--context", "8K", "--output-len", "uniform:1-1024", "-o", out]  # fmt: skip


@pytest.fixture
def cp_plan(tiny: Path) -> Path:
    res = run_cli(*_plan_args("cp.json"))
    assert res.code == 0, res.err
    return tiny / "cp.json"


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _killed_at_exit(proc: subprocess.Popen, workers: list[int]) -> Iterator[None]:
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        for pid in still_running(workers):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# -- a killed launcher ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, "1:1:hang"], ids=["decoding", "a peer hung"])
def test_workers_do_not_outlive_a_killed_launcher(cp_plan: Path, fault: str | None) -> None:
    """SIGKILL gives the launcher no chance to stop its workers: each must notice on its own (a
    rank forked from the server watches the launcher's pidfd; a spawned one gets torch's
    PR_SET_PDEATHSIG). Gone within seconds, whether decoding or waiting on a hung peer in a gloo
    collective."""
    proc, workers = start_launch(
        [str(cp_plan), "--prompt-lens", "16", "--new-tokens", "200000", "--timeout", "60"], fault=fault
    )
    with _killed_at_exit(proc, workers):
        time.sleep(0.5)  # decoding (or rank 0 waiting on the hung rank 1)
        proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        while still_running(workers) and time.monotonic() - killed_at < 15:
            time.sleep(0.1)
        took = time.monotonic() - killed_at
        assert still_running(workers) == [], f"workers {still_running(workers)} outlived the launcher"
    assert took < 10, f"the workers took {took:.1f} s to stop"


# -- a port another launch holds ------------------------------------------------------------------


@pytest.mark.slow
def test_a_master_port_another_launch_holds_is_exit_4_in_one_line(cp_plan: Path) -> None:
    """Two jobs on one --master-port: the second is refused before any of its workers starts
    (exit 4, a launch failure: the command is right, the port is taken), and the first goes on."""
    port = _free_port()
    first, workers = start_launch(
        [str(cp_plan), "--prompt-lens", "16", "--timeout", "60", "--master-port", str(port)], fault="1:1:hang"
    )
    with _killed_at_exit(first, workers):
        second = subprocess.Popen(
            [sys.executable, "-m", "tessera", "launch", str(cp_plan), "--master-port", str(port), "--prompt-lens", "16"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={k: v for k, v in os.environ.items() if k not in ("TESSERA_DEBUG", launcher.FAULT_ENV)},
        )  # fmt: skip
        time.sleep(0.5)
        spawned = workers_of(second.pid)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 4, err
        assert _one_line(err) == (
            f"tessera: error: --master-port {port} on 127.0.0.1 is in use (another job?): give another "
            "port, or leave --master-port out to use a free one"
        )
        assert spawned == [] and first.poll() is None and len(still_running(workers)) == 2


def test_a_port_taken_after_the_probe_is_exit_4_too(cp_plan: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The port is probed before anything starts; one taken in between is refused by the store's
    own bind in the same words (no worker starts: the store comes first)."""
    monkeypatch.setattr(launcher, "_probe_listen", lambda addr, port: port)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run_cli("launch", str(cp_plan), "--master-port", str(port), "--prompt-lens", "16")
    assert res.code == 4, res.err
    assert f"--master-port {port} on 127.0.0.1 is in use" in _one_line(res.err)


# -- a full disk under plan -o --------------------------------------------------------------------


def _leftovers(folder: Path, name: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{name}.") or p.name == name)


def test_a_full_disk_leaves_no_plan_and_no_temporary_file(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC while the plan is written (injected where a full disk shows, at flush/fsync): exit 2,
    one line naming the file; neither the plan nor the temporary file is left, and an older plan
    at that path is kept whole."""

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    res = run_cli(*_plan_args("plan.json"))
    assert res.code == 2
    assert _one_line(res.err) == "tessera: error: plan.json: cannot write: No space left on device"
    assert _leftovers(tiny, "plan.json") == []

    Path("plan.json").write_text("the older plan\n")
    res = run_cli(*_plan_args("plan.json"))
    assert res.code == 2 and "No space left on device" in _one_line(res.err)
    assert _leftovers(tiny, "plan.json") == ["plan.json"]
    assert Path("plan.json").read_text() == "the older plan\n"


def test_dev_full_as_the_output_is_exit_2_in_one_line(tiny: Path) -> None:
    """A device is written into, not replaced: /dev/full answers ENOSPC on every write."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    res = run_cli(*_plan_args("/dev/full"))
    assert res.code == 2
    assert _one_line(res.err) == "tessera: error: /dev/full: cannot write: No space left on device"


@pytest.fixture
def tiny_tmpfs(tiny: Path) -> Iterator[Path]:
    """A 4 KiB tmpfs (one page) mounted in the test's folder: a real full disk. Skipped where
    mounting is not allowed (not root, no CAP_SYS_ADMIN)."""
    folder = tiny / "full"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_real_full_disk_under_plan_o(tiny: Path, tiny_tmpfs: Path) -> None:
    """The plan (about 6 KB) does not fit a 4 KiB file system: refused after the search, with the
    directory as it was (the early writability check passes: an empty file fits)."""
    res = run_cli(*_plan_args("full/plan.json"))
    assert res.code == 2
    assert _one_line(res.err) == "tessera: error: full/plan.json: cannot write: No space left on device"
    assert _leftovers(tiny_tmpfs, "plan.json") == []

    Path("full/plan.json").write_text("old\n")
    res = run_cli(*_plan_args("full/plan.json"))
    assert res.code == 2 and Path("full/plan.json").read_text() == "old\n"
    assert _leftovers(tiny_tmpfs, "plan.json") == ["plan.json"]
