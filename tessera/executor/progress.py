"""Progress of a launch's workers, watched from the launcher: each worker touches its heartbeat file
on every pass it starts (:func:`beat`); :class:`ProgressMonitor` stops every local worker once no
rank has made progress for ``--timeout`` seconds and names the rank that held the others up. It
bounds a hang that the workers cannot end themselves (a stopped or wedged process)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

HEARTBEAT_ENV = "TESSERA_HEARTBEAT_DIR"
POLL_S = 0.05

_beating: Path | None = None


def beat() -> None:
    """Say this worker is making progress (cheap: one ``utime``). The first beat writes the
    worker's pid, so that the launcher can stop it; outside a launch it does nothing."""
    global _beating
    if _beating is None:
        folder = os.environ.get(HEARTBEAT_ENV)
        if not folder:
            return
        path = Path(folder) / f"rank{int(os.environ.get('RANK', '0'))}"
        path.write_text(str(os.getpid()))
        _beating = path
        return
    os.utime(_beating)


def process_state(pid: int) -> str | None:
    """The process's state letter (``/proc/PID/stat``: R, S, D, T stopped, Z…), None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def workers_of(launcher: int) -> list[int]:
    """The live worker processes of process ``launcher``: its children that multiprocessing spawned
    (``spawn_main``) and the children of its fork server (``multiprocessing.forkserver``)."""
    procs: dict[int, tuple[int, str, bytes]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            procs[int(entry.name)] = (int(ppid), state, (entry / "cmdline").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    servers = {pid for pid, (ppid, _, cmd) in procs.items() if ppid == launcher and b"forkserver" in cmd}
    return [
        pid
        for pid, (ppid, state, cmd) in procs.items()
        if state != "Z"
        and ((ppid == launcher and b"spawn_main" in cmd) or (ppid in servers and b"forkserver" in cmd))
    ]


class ProgressMonitor:
    """Watches the heartbeat files in ``folder``; when the newest is ``timeout_s`` old, it SIGKILLs
    every worker of this process and keeps :attr:`verdict`, the line the launch reports instead of
    the workers' own failures."""

    def __init__(
        self, folder: Path, timeout_s: float, ranks: list[int], describe_rank: Callable[[int], str]
    ) -> None:
        self.folder = folder
        self.timeout_s = timeout_s
        self.ranks = ranks  # this node's ranks: one not heard from yet counts from the start
        self.describe_rank = describe_rank
        self.verdict: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tessera-progress", daemon=True)

    def _beats(self) -> dict[int, tuple[float, int]]:
        """rank → (time of its last beat, pid)."""
        found = {}
        for path in self.folder.glob("rank*"):
            try:
                found[int(path.name[4:])] = (path.stat().st_mtime, int(path.read_text() or 0))
            except (OSError, ValueError):
                continue  # being written
        return found

    def _watch(self) -> None:
        started = time.time()
        while not self._stop.wait(POLL_S):
            beats = self._beats()
            last = {r: beats[r][0] if r in beats else started for r in self.ranks}
            if time.time() - max(last.values()) <= self.timeout_s:
                continue
            stopped = [r for r, (_, pid) in beats.items() if process_state(pid) in ("T", "t")]
            culprit = min(stopped) if stopped else min(last, key=lambda r: (last[r], r))
            what = (
                "is stopped (SIGSTOP?)"
                if stopped
                else "made no progress"
                if culprit in beats
                else "never started"
            )
            self.verdict = (
                f"{self.describe_rank(culprit)} {what} and no rank went on for {self.timeout_s:g} s "
                "(--timeout): stopped every worker"
            )
            for pid in workers_of(os.getpid()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return

    @contextmanager
    def watching(self) -> Iterator[ProgressMonitor]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()
