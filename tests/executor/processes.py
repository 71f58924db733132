"""Running ``tessera launch`` as a real process and interrupting it once its workers are up."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tessera.executor.launcher import FAULT_ENV
from tessera.executor.progress import process_state, workers_of


def still_running(workers: list[int]) -> list[int]:
    """Those of ``workers`` that still run as workers (a reused pid runs something else)."""
    alive = []
    for pid in workers:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if (b"spawn_main" in cmd or b"forkserver" in cmd) and process_state(pid) != "Z":
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


def start_launch(args: list[str], fault: str | None = None) -> tuple[subprocess.Popen, list[int]]:
    """``tessera launch ARGS`` as a process (with the test-only fault ``fault``, e.g. ``1:0:hang``),
    returned once its 2 workers run, with their pids."""
    env = {**os.environ}
    env.pop("TESSERA_DEBUG", None)
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    proc = subprocess.Popen(
        [sys.executable, "-m", "tessera", "launch", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    workers: list[int] = []
    while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
        workers = workers_of(proc.pid)
    while time.monotonic() < deadline and proc.poll() is None and len(_heartbeats(workers)) < 2:
        time.sleep(0.1)  # each worker beats once it runs its own code
    if len(workers) < 2 or len(_heartbeats(workers)) < 2:
        proc.kill()
        raise AssertionError(f"the workers did not start: {proc.communicate()[1]}")
    return proc, workers


def _heartbeats(workers: list[int]) -> list[Path]:
    """The heartbeat files of ``workers`` (tessera.executor.progress: each holds its rank's pid),
    in the launch's scratch folder in TMPDIR."""
    pids = {str(pid) for pid in workers}
    try:
        paths = list(Path(tempfile.gettempdir()).glob("tessera-launch-*/tessera-progress-*/rank*"))
    except OSError:  # another launch's folder went while listing: the caller looks again
        return []
    found = []
    for path in paths:
        try:
            if path.read_text().strip() in pids:
                found.append(path)
        except OSError:
            continue
    return sorted(found)


def listening_addresses(pids: list[int]) -> list[str]:
    """``ADDRESS:PORT`` of every TCP socket the processes ``pids`` listen on (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        try:
            rows = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                hex_addr, hex_port = local.split(":")
                raw = bytes.fromhex(hex_addr)
                # /proc/net/tcp prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                address = socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, words)
                found.append(f"{address}:{int(hex_port, 16)}")
    return found
