"""Running ``tessera launch`` as a real process and interrupting it once its workers are up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tessera.executor.launcher import FAULT_ENV


def workers_of(pid: int) -> list[int]:
    """The live worker processes (torch's ``spawn_main`` children) of launcher ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in cmd:
            found.append(int(entry.name))
    return found


def still_running(workers: list[int]) -> list[int]:
    """Those of ``workers`` that still run as workers (a reused pid runs something else)."""
    alive = []
    for pid in workers:
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                alive.append(pid)
        except OSError:
            continue
    return alive


def interrupt_launch(args: list[str], sig: signal.Signals) -> tuple[int, str, list[int]]:
    """Run ``tessera launch ARGS`` with rank 1 hanging (the test-only fault hook: the run cannot end
    by itself), send ``sig`` once its 2 workers run, and return the exit code, stderr and the
    workers' pids."""
    env = {**os.environ, FAULT_ENV: "1:0:hang"}
    env.pop("TESSERA_DEBUG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tessera", "launch", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            workers = workers_of(proc.pid)
        assert len(workers) == 2, "the workers did not start"
        time.sleep(1.0)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err, workers
