"""How ranks start: forked from a server that has imported torch and the entry point's module once.

A spawned rank imports torch and tessera by itself (about 3 s on a 2-core VM), then torch._dynamo
(2 s more: torch.optim's optimizers and make_fx load it on first use). Forked from a server that has
them loaded, it starts in a fraction of a second, and a process that launches again (the Python API,
a notebook, the tests) pays the imports once. The server keeps the environment and working folder
of when it started; each rank takes those of the launching process at its launch before its entry
point runs. See docs/executor.md ("Launching workers").
"""

from __future__ import annotations

import multiprocessing
import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any

__all__ = ["SECONDARY", "as_launched", "launcher_pid", "start_server"]

# Messages of failures that are a consequence of another rank's failure: the rank lost its link to
# a peer or timed out waiting for one (tessera's workers say "waiting for … from rank N").
SECONDARY = re.compile(
    r"waiting for .* from rank|connection (closed|reset|refused)|broken pipe|closed by peer",
    re.IGNORECASE,
)
# A rank failing only for a lost peer waits this long before it exits: the agent reports the first
# failure it sees, and a forked rank exits at once (a spawned one took a second to end its interpreter).
SECONDARY_DELAY_S = 1.0
# Loaded by the server before it forks any rank: this module first (it keeps the server's
# environment before torch's imports touch it), torch, and torch._dynamo, which torch.optim's
# optimizers and make_fx import on their first call.
_PRELOAD = (__name__, "torch", "torch._dynamo")
# In the server (which imports this module): its environment as it started, which its ranks inherit.
_SERVER_ENV = dict(os.environ)
_launcher: int | None = None


def start_server(entrypoint: Callable[..., Any]) -> str:
    """Start this process's fork server, once, with torch and ``entrypoint``'s module loaded (a
    later launch of another entry point imports its module in the ranks), and return the start
    method of the launch: ``forkserver``, or ``spawn`` where the server cannot start (its socket's
    path in TMPDIR longer than a Unix socket's). Called outside a launch's scratch folder: the
    server's socket outlives the launch."""
    multiprocessing.get_context("forkserver").set_forkserver_preload([*_PRELOAD, entrypoint.__module__])
    try:
        forkserver.ensure_running()
    except OSError:
        return "spawn"
    return "forkserver"


def as_launched(
    env: dict[str, str], cwd: str, path: list[str], launcher: int, entrypoint: Callable[..., Any], *args: Any
) -> Any:
    """A rank's entry point: the launching process's environment (with the variables torch's agent
    set for this rank on top), working folder and ``sys.path``, then ``entrypoint(*args)``."""
    global _launcher
    agent = {k: v for k, v in os.environ.items() if _SERVER_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update({**env, **agent})
    os.chdir(cwd)
    sys.path[:] = path
    _launcher = launcher
    threading.Thread(target=_end_with, args=(launcher,), name="tessera-launcher-watch", daemon=True).start()
    try:
        return entrypoint(*args)
    except Exception as exc:
        if SECONDARY.search(str(exc)):
            time.sleep(SECONDARY_DELAY_S)
        raise


def _end_with(launcher: int) -> None:
    """End this rank when the launching process is gone (killed: no one is left to report to). A
    spawned rank's parent-death signal did it; a forked rank's parent is the server, which outlives
    the launcher while its ranks run."""
    try:
        fd = os.pidfd_open(launcher)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): look every half second
        while _alive(launcher):
            time.sleep(0.5)
    else:
        select.select([fd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, and another user's: the pid was reused
        pass
    return True


def launcher_pid() -> int:
    """The process that launched this rank (its parent is the fork server)."""
    return _launcher if _launcher is not None else os.getppid()
