"""Start workers the way ``torchrun`` does (torch.distributed's elastic agent), and what every
worker shares: its setup, the watchdog, memory readings and test-only fault injection.

:func:`launch_workers` runs ``entrypoint(*args)`` on this node's ranks and returns their results,
or raises :class:`~tessera.core.errors.LaunchError` naming the rank that failed first and why.
No restarts; a hung worker is bounded by the process-group timeout and the :class:`Watchdog`.
See docs/executor.md ("Launching workers").
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import faulthandler
import ipaddress
import logging
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from tessera.core.errors import InputError, LaunchError, Terminated
from tessera.executor.progress import HEARTBEAT_ENV, ProgressMonitor, beat
from tessera.executor.worker_start import SECONDARY, as_launched, launcher_pid, start_server

# Seconds between the agent's SIGTERM and SIGKILL to workers it stops.
SHUTDOWN_GRACE_S = 5


@dataclass(frozen=True)
class LaunchOptions:
    """torchrun's options: processes per node (default: the whole world on this node), nodes,
    this node's rank, the rendezvous address, and the fault timeout in seconds."""

    nproc_per_node: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free local port (single node only)
    timeout_s: float = 60.0
    threads_per_rank: int | None = None  # torch threads of every rank (None: the cores over the ranks)


def free_port(addr: str = "127.0.0.1") -> int:
    """A port free for listening on ``addr``; InputError when ``addr`` does not resolve or is not
    an address of this machine (node 0 serves the rendezvous there)."""
    return _probe_listen(addr, 0)


def _probe_listen(addr: str, port: int) -> int:
    """Bind (and release) ``addr:port`` as the rendezvous store will; the port bound. InputError for
    an address that does not resolve or is not this machine's, LaunchError for a port in use."""
    family, kind, proto, _, where = _address(addr, port)
    try:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store: TIME_WAIT is no conflict
            s.bind(where)
            return int(s.getsockname()[1])
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise _port_in_use(addr, port) from None
        raise InputError(
            f"--master-addr {addr!r}: cannot listen there ({exc.strerror}); "
            "node 0 serves the rendezvous, so it must be one of its addresses"
        ) from None


def _address(addr: str, port: int) -> tuple:
    """``addr:port`` resolved (the first of ``getaddrinfo``); InputError when it does not resolve
    or names every interface (``0.0.0.0``, ``::``): the rendezvous store takes any connection
    without authentication, so it listens on one address the workers share, never on all."""
    try:
        found = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise InputError(f"--master-addr {addr!r}: the host name does not resolve ({reason})") from None
    if ipaddress.ip_address(found[4][0].split("%")[0]).is_unspecified:
        raise InputError(
            f"--master-addr {addr!r} means every interface; the rendezvous store is unauthenticated, so "
            "give the one address the nodes reach node 0 at (127.0.0.1 on one node)"
        )
    return found


def _port_in_use(addr: str, port: int) -> LaunchError:
    return LaunchError(
        f"--master-port {port} on {addr} is in use (another job?): "
        "give another port, or leave --master-port out to use a free one"
    )


def resolve(options: LaunchOptions, world_size: int) -> tuple[int, int]:
    """(nproc_per_node, master_port) for a run of ``world_size`` ranks; InputError if they disagree."""
    if options.nnodes < 1 or not 0 <= options.node_rank < options.nnodes:
        raise InputError(f"--node-rank {options.node_rank} is not in [0, --nnodes {options.nnodes})")
    if options.timeout_s <= 0:
        raise InputError(f"--timeout {options.timeout_s}: must be positive")
    nproc = options.nproc_per_node
    if nproc is None:
        if world_size % options.nnodes:
            raise InputError(f"the plan's {world_size} ranks do not split evenly over {options.nnodes} nodes")
        nproc = world_size // options.nnodes
    if nproc * options.nnodes != world_size:
        raise InputError(
            f"--nproc-per-node {nproc} x --nnodes {options.nnodes} = {nproc * options.nnodes} "
            f"processes, but the plan has {world_size} devices (one process each)"
        )
    port = options.master_port
    if port is None:
        if options.nnodes > 1:
            raise InputError("--master-port is required with --nnodes > 1")
        port = free_port(options.master_addr)
    elif options.node_rank == 0:  # this node serves the rendezvous: it must be able to listen there
        _probe_listen(options.master_addr, port)
    else:
        _address(options.master_addr, port)
    return nproc, port


def _shutdown_grace(config: type, grace_s: float = 0.0) -> dict[str, float]:
    """``shutdown_timeout`` where this torch's LaunchConfig has it (torch 2.11's has not: there the
    agent's own grace applies)."""
    names = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
    return {"shutdown_timeout": max(SHUTDOWN_GRACE_S, grace_s)} if "shutdown_timeout" in names else {}


def launch_workers(
    entrypoint: Callable[..., Any],
    args: tuple[Any, ...],
    world_size: int,
    options: LaunchOptions,
    *,
    describe_rank: Callable[[int], str] = lambda r: f"rank {r}",
    grace_s: float = 0.0,
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` on every local rank of a ``world_size``-rank job; return this
    node's results by global rank. Raises LaunchError (exit 4) when a worker fails. ``grace_s``:
    how long workers asked to stop (SIGTERM) may take before they are killed, beyond the usual
    few seconds (a run that writes a checkpoint as it stops)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nproc, port = resolve(options, world_size)
    # c10d's C++ warnings (a socket timing out when a peer stops) would print many lines per
    # worker; the launch reports the failure in one. Shown with -v (the root logger at INFO).
    cpp_log_level = os.environ.get("TORCH_CPP_LOG_LEVEL", _cpp_log_level())
    with _env("TORCH_CPP_LOG_LEVEL", cpp_log_level):  # read as the server imports torch
        start_method = start_server(entrypoint)
    config = LaunchConfig(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=nproc,
        run_id=f"tessera-{uuid.uuid4().hex[:12]}",
        rdzv_backend="static",
        rdzv_endpoint=f"{options.master_addr}:{port}",
        rdzv_configs={"rank": options.node_rank, "timeout": int(max(options.timeout_s, 1))},
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull),  # set in _scratch: nothing made yet
        **_shutdown_grace(LaunchConfig, grace_s),
    )
    threads = str(options.threads_per_rank or max(1, (os.cpu_count() or 1) // nproc))
    with (
        _scratch(config, DefaultLogsSpecs),
        tempfile.TemporaryDirectory(prefix="tessera-progress-") as heartbeats,
        _env(HEARTBEAT_ENV, heartbeats),
        _env("TORCH_CPP_LOG_LEVEL", cpp_log_level),
        _env("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", threads)),
        _quiet_agent(),
        _store_server(options, port),
        ProgressMonitor(
            Path(heartbeats), options.timeout_s, _local_ranks(options, nproc), describe_rank
        ).watching() as monitor,
    ):
        try:
            here = (dict(os.environ), os.getcwd(), list(sys.path), os.getpid())
            return elastic_launch(config, as_launched)(*here, entrypoint, *args)
        except ChildFailedError as exc:
            raise LaunchError(monitor.verdict or _describe_failure(exc, describe_rank)) from None
        except Exception as exc:
            if type(exc).__name__ == "SignalException":  # the agent caught SIGINT/SIGTERM
                if getattr(exc, "sigval", None) == signal.SIGTERM:
                    raise Terminated from None
                raise KeyboardInterrupt from None
            if type(exc).__name__ in ("RendezvousTimeoutError", "RendezvousError", "DistStoreError"):
                raise LaunchError(f"rendezvous at {options.master_addr}:{port} failed: {exc}") from None
            if monitor.verdict is not None:
                # The monitor killed the workers; torch may then fail reading what a killed worker
                # was writing (an EOFError, which click would report as "aborted", exit 130).
                raise LaunchError(monitor.verdict) from None
            if type(exc).__name__ == "DistNetworkError":  # the store could not listen or connect
                if "EADDRINUSE" in str(exc):  # taken since resolve() probed it
                    raise _port_in_use(options.master_addr, port) from None
                raise LaunchError(f"rendezvous at {options.master_addr}:{port} failed: {exc}") from None
            raise


@contextlib.contextmanager
def _scratch(config: Any, logs_specs: type) -> Iterator[None]:
    """A folder for what the elastic agent writes for a run (its log folders, the
    ``pytorch-errorfile-*`` pickles torch's spawn makes in the temporary directory), removed when
    the run ends however it ends: a launch leaves nothing in TMPDIR. Workers keep theirs."""
    folder = tempfile.mkdtemp(prefix="tessera-launch-")
    previous = tempfile.tempdir
    tempfile.tempdir = folder
    try:
        config.logs_specs = logs_specs(log_dir=os.path.join(folder, "logs"))
        yield
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(folder, ignore_errors=True)


def _cpp_log_level() -> str:
    return "INFO" if logging.getLogger().getEffectiveLevel() <= logging.INFO else "ERROR"


def _local_ranks(options: LaunchOptions, nproc: int) -> list[int]:
    """The global ranks this node runs (torch's elastic agent numbers them node by node)."""
    return list(range(options.node_rank * nproc, (options.node_rank + 1) * nproc))


@contextlib.contextmanager
def _store_server(options: LaunchOptions, port: int) -> Iterator[None]:
    """On node 0, serve the rendezvous store on ``--master-addr`` only. torch's TCPStore server
    listens on every interface; one created first on a socket bound to the address is shared by
    the elastic agent's store (it is multi-tenant: one server per port in a process)."""
    if options.node_rank != 0:
        yield
        return
    import torch.distributed as dist

    family, kind, proto, _, where = _address(options.master_addr, port)
    with socket.socket(family, kind, proto) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(where)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:  # taken since resolve() probed it
                raise _port_in_use(options.master_addr, port) from None
            raise
        listener.listen(1024)
        fd = listener.detach()  # the store's server owns (and closes) the listening socket
    try:
        server = dist.TCPStore(
            options.master_addr,
            port,
            None,
            True,
            timedelta(seconds=max(options.timeout_s, 1)),
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise
    try:
        yield
    finally:
        del server


def _describe_failure(exc: Any, describe_rank: Callable[[int], str]) -> str:
    """One line: the root-cause rank (first by time; a rank whose message is only a lost link to a
    peer counts after the others), what happened, and how many ranks failed in all."""
    failures = sorted(exc.failures.items(), key=lambda kv: (_is_secondary(kv[1]), kv[1].timestamp, kv[0]))
    rank, failure = failures[0]
    more = f"; {len(failures) - 1} other rank(s) stopped with it" if len(failures) > 1 else ""
    return f"{describe_rank(rank)} failed: {_reason(failure)}{more}"


def _message(failure: Any) -> str:
    """The Python error a worker recorded (its elastic error file), or "" when it left none."""
    if failure.error_file == "<N/A>":
        return ""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return " ".join(str(message).split())


def _is_secondary(failure: Any) -> bool:
    text = _message(failure)
    return failure.exitcode < 0 or bool(text and SECONDARY.search(text))


def _reason(failure: Any) -> str:
    text = _message(failure)
    if os.environ.get("TESSERA_DEBUG") and isinstance(failure.message, dict):  # the worker's traceback
        stack = (failure.message.get("extraInfo") or {}).get("py_callstack")
        if stack:
            sys.stderr.write(f"{stack}\n")
    if text:
        return text
    if failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()} (pid {failure.pid})"
    return f"exited with code {failure.exitcode} without a Python error (pid {failure.pid})"


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The elastic agent logs every failure at ERROR with a banner; tessera reports it in one line.
    Its logs stay visible with ``-v`` (the root logger at INFO or below)."""
    # torch sets levels on some of its module loggers (the agent's "Received 15 death signal" is one):
    # quieting the parents is not enough.
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    names = [n for n in list(logging.Logger.manager.loggerDict) if n.startswith(prefixes)]
    loggers = [logging.getLogger(n) for n in dict.fromkeys([*prefixes, *names])]
    old = [lg.level for lg in loggers]
    if logging.getLogger().getEffectiveLevel() > logging.INFO:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, old, strict=True):
            lg.setLevel(level)


def available_memory_bytes() -> int | None:
    """Memory this host can still give its processes without swapping or the OOM killer: the
    kernel's ``MemAvailable`` (``/proc/meminfo``), capped by a cgroup v2 limit's headroom; free
    pages (``os.sysconf``) where there is no ``/proc``; None when neither can be read."""
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            current = int(f.read().strip())
        if limit != "max":
            found.append(max(0, int(limit) - current))
    if not found:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return min(found) if found else None


def local_ranks(options: LaunchOptions, world_size: int) -> range:
    """The global ranks that run on this node (the torchrun layout: ``nproc_per_node`` consecutive
    ranks per node); :func:`resolve` checks that the numbers agree."""
    nproc = options.nproc_per_node or max(1, world_size // max(options.nnodes, 1))
    first = options.node_rank * nproc
    return range(min(first, world_size), min(first + nproc, world_size))


def choose_backend(cluster: dict[str, Any] | None, device_ids: Iterable[str]) -> str:
    """The process-group backend for a plan's devices: NCCL when they are all GPUs and this machine
    has CUDA, gloo (CPU) otherwise. ``cluster`` is the plan's resolved cluster spec."""
    import torch

    kinds = {t.get("kind") for t in _device_types(cluster, device_ids)}
    return "nccl" if kinds == {"gpu"} and torch.cuda.is_available() else "gloo"


def _device_types(cluster: dict[str, Any] | None, device_ids: Iterable[str]) -> list[dict[str, Any]]:
    """The device-type entries (as in the plan's resolved cluster) of ``device_ids``, one each
    ({} for a device the cluster does not know); none without a cluster."""
    if not cluster:
        return []
    types = cluster.get("device_types", {})
    by_id = {d["id"]: d.get("type") for d in cluster.get("devices", [])}
    return [types.get(by_id.get(dev), {}) for dev in device_ids]


def plan_threads(cluster: dict[str, Any] | None, device_ids: Iterable[str]) -> int | None:
    """The torch threads a rank of a CPU plan runs with: the cores of its devices' type, as the
    planner's measurements assumed (``tessera calibrate`` writes one core per rank); None where
    the plan's cluster does not say or its devices differ."""
    found = {(t.get("kind"), t.get("cores")) for t in _device_types(cluster, device_ids)}
    if len(found) != 1:
        return None
    kind, cores = found.pop()
    return int(cores) if kind == "cpu" and cores else None


_PINNED: list[list[int]] = []  # the cores pin_cores pinned this process to, if it did


def own_cores() -> bool:
    """Whether this process runs on cores of its own (:func:`pin_cores` pinned it)."""
    return bool(_PINNED)


def pin_cores(local_rank: int, local_ranks: int, threads: int) -> list[int] | None:
    """Pin this process to cores of its own — local rank ``r`` to the ``r``-th block of ``threads``
    of the cores it may run on — when this node's ranks fit them (as CPU training launchers do):
    ranks that the scheduler lets share a core now and then made the same plan's launches differ
    by up to 24% here. The cores pinned to, or None (they do not fit: left to the scheduler)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if local_ranks * threads > len(cores) or local_ranks < 2:
        return None
    mine = cores[local_rank * threads : (local_rank + 1) * threads]
    os.sched_setaffinity(0, mine)
    _PINNED[:] = [mine]
    return mine


def worker_setup(world_size: int, backend: str) -> tuple[int, Any]:
    """What every worker does first: read its rank from the torchrun environment, check the world
    size against the plan's, cap its threads (OMP_NUM_THREADS), pin it to cores of its own where
    this node's ranks fit them (:func:`pin_cores`) and pick its device (the local GPU under NCCL,
    else the CPU). Returns ``(rank, torch.device)``."""
    import torch

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world != world_size:
        raise LaunchError(f"rank {rank}: WORLD_SIZE {world}, but the plan needs {world_size}")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    pin_cores(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.get_num_threads())
    if backend != "nccl":
        return rank, torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return rank, device


# Test-only fault injection: "RANK:STEP:KIND" makes that rank fail at the start of that step
# (KIND: exit = os._exit(3), raise = an exception, hang = sleep until the timeouts act, term = SIGTERM
# to the launcher, as a scheduler stopping the job would).
FAULT_ENV = "TESSERA_TEST_FAULT"
# A worker's watchdog fires at this multiple of --timeout (the launcher's own wait comes first).
WATCHDOG_FACTOR = 1.5


def memory_status(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process in bytes, from /proc/self/status.

    Not ``getrusage``'s ``ru_maxrss``: it survives ``exec``, so a spawned worker would report its
    launcher's peak. Falls back to it where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def inject_test_fault(rank: int, step: int) -> None:
    """Test-only fault injection (see :data:`FAULT_ENV`); does nothing unless the variable is set."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    r, s, kind = spec.split(":")
    if int(r) != rank or int(s) != step:
        return
    if kind == "exit":
        os._exit(3)
    if kind == "raise":
        raise RuntimeError(f"injected fault ({FAULT_ENV}={spec})")
    if kind == "hang":
        time.sleep(10**6)
    if kind == "term":  # the launcher asked to stop (as by kill or a scheduler) during this step
        os.kill(launcher_pid(), signal.SIGTERM)


class Watchdog:
    """Ends this worker when a step (or the start-up) runs past the timeout: the hang is recorded
    in the elastic error file (so the launcher names this rank and why) and the process exits.

    One thread for the whole run: :meth:`arm` only moves the deadline (a worker arms it every
    step, and starting a thread each time cost 0.3 ms a step on a busy 2-core host)."""

    def __init__(self, timeout_s: float, rank: int) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self._deadline: float | None = None
        self._what = ""
        self._moved = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, what: str) -> None:
        beat()
        with self._moved:
            self._deadline, self._what = time.monotonic() + self.timeout_s, what
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="tessera-watchdog", daemon=True)
                self._thread.start()

    def disarm(self) -> None:
        with self._moved:
            self._deadline = None
            self._moved.notify()

    def _watch(self) -> None:
        with self._moved:
            while True:
                if self._deadline is None:
                    self._moved.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                self._moved.wait(left)  # woken early only by disarm; a re-arm moves the deadline out
        self._fire(self._what)

    def _fire(self, what: str) -> None:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        if os.environ.get("TESSERA_DEBUG"):
            faulthandler.dump_traceback(all_threads=True)
        error = TimeoutError(f"rank {self.rank}: {what} did not finish within {self.timeout_s:g} s (hung)")
        with contextlib.suppress(Exception):
            ErrorHandler().record_exception(error)
        os._exit(1)
