"""The SQLite profile cache: measured costs keyed by backend, version, device and subgraph.

Default ``~/.cache/tessera/profiles.sqlite``. The subgraph key is :func:`subgraph_hash`, a canonical hash
of operator types, attributes, shapes, dtypes and topology (not names, not weight values). WAL journaling,
a busy timeout and ``BEGIN IMMEDIATE`` writes let processes share it; an unreadable file is moved aside
and rebuilt. References: Collage thesis §2.4.2 (measurements logged for reuse). Details: docs/backends.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx
from onnx import helper

from tessera.backends.base import cpu_cores, cpu_model, default_cache_dir
from tessera.core.errors import InputError
from tessera.core.files import check_writable

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 30.0
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS profiles (
    backend TEXT NOT NULL,
    backend_version TEXT NOT NULL,
    device TEXT NOT NULL,
    subgraph TEXT NOT NULL,
    median_s REAL,            -- NULL: the build or run failed (infinite cost)
    iqr_s REAL,
    runs INTEGER NOT NULL,
    compile_s REAL,
    error TEXT,
    created REAL NOT NULL,
    PRIMARY KEY (backend, backend_version, device, subgraph)
);
CREATE TABLE IF NOT EXISTS context_switch (
    src TEXT NOT NULL,
    dst TEXT NOT NULL,
    versions TEXT NOT NULL,
    device TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    seconds REAL NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (src, dst, versions, device, nbytes)
);
"""


SQLITE_MAGIC = b"SQLite format 3\x00"

# A cached time outside this range is no measurement (an edited or damaged row): it is read as a
# miss, measured again and, where the cache is writable, replaced.
MAX_SECONDS = 1e6


def default_profile_path() -> Path:
    return default_cache_dir() / "profiles.sqlite"


def device_fingerprint(device: str) -> str:
    """The key part naming the hardware: the backend's device, the CPU model and its core count."""
    return f"{device} | {cpu_model()} | {cpu_cores()} cores"


@dataclass(frozen=True)
class Profile:
    """One cached measurement. ``median_s`` is ``inf`` when the build or run failed."""

    backend: str
    backend_version: str
    device: str
    subgraph: str
    median_s: float
    iqr_s: float
    runs: int
    compile_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return math.isfinite(self.median_s)


class ProfileCache:
    """The cache file (see the module docstring). Safe to share between threads and processes."""

    def __init__(self, path: str | Path | None = None) -> None:
        # A file at the default path is tessera's own: garbage there is moved aside. A path the
        # user named (``--cache``) may be a typo for a model or a plan: only an SQLite file is.
        self.path = Path(path) if path is not None else default_profile_path()
        self._own = path is None or Path(path) == default_profile_path()
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self.read_only = False  # the file or its folder is not writable: used without storing
        self.unwritable: str | None = None  # why the disk refused a write: no more are tried
        self._warned: set[str] = set()

    # -- connection and recovery ----------------------------------------------------------------

    def open(self) -> None:
        """Open (or create) the cache now: a path that cannot hold one is an :class:`InputError`
        before any measuring work, not a failure after it."""
        self._with_conn(lambda conn: None)

    def check(self) -> None:
        """:meth:`open` a cache that exists; for one that does not, only check that it could be
        created (the file appears with the first measurement), so that a run refused before it
        measures anything (a bad ``--data``) leaves no file behind."""
        if self.path.is_symlink() or self.path.exists():
            self.open()
        else:
            try:
                check_writable(self.path)
            except InputError as exc:
                why = exc.message.removeprefix("cannot write: ")
                raise InputError(f"cannot create the profile cache: {why}", source=self.path) from None

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise InputError(
                    "cannot create the profile cache: a file is in the way of its folder", source=self.path
                ) from None
            except OSError as exc:  # no permission, a read-only file system
                raise InputError(
                    f"cannot create the profile cache's folder: {exc.strerror or exc}", source=self.path
                ) from None
            existed = self.path.is_symlink() or self.path.exists()
            if existed and not (_writable(self.path) and _writable(self.path.parent)):
                self._conn = self._connect_read_only()
                return self._conn
            try:
                conn = sqlite3.connect(
                    self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
                )
                if not existed:
                    conn.execute("PRAGMA user_version").fetchone()  # sqlite creates the file lazily
            except sqlite3.OperationalError as exc:
                if existed:
                    raise
                raise InputError(f"cannot create the profile cache: {exc}", source=self.path) from None
            self._set_up_retrying(conn, existed)
            self._conn = conn
        return self._conn

    def _set_up_retrying(self, conn: sqlite3.Connection, existed: bool) -> None:
        # SQLite answers "database is locked" at once, without waiting out the busy timeout,
        # when connections race to switch a new file to WAL or to create the schema (a lock
        # upgrade it cannot wait for): retry the set-up until the timeout instead.
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                self._set_up(conn)
                break
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) and time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                conn.close()
                if existed:
                    raise
                self._remove_new_files()  # a new file the disk refused to grow: nothing to keep
                raise InputError(
                    f"cannot create the profile cache: {exc} (a full disk or a file-size limit?); "
                    "give --cache another path",
                    source=self.path,
                ) from None
            except BaseException:
                conn.close()
                raise

    def _remove_new_files(self) -> None:
        for suffix in ("", "-wal", "-shm", "-journal"):
            with suppress(OSError):
                Path(f"{self.path}{suffix}").unlink()

    def _connect_read_only(self) -> sqlite3.Connection:
        """A cache the user may not write (mode 0444, a read-only folder or file system) is read as
        it is and nothing is stored; it is never moved aside. One that cannot be read as a cache is
        an :class:`InputError`."""
        self.read_only = True
        self._warn_once(
            "read-only",
            "profile cache %s is read-only: using its measurements, storing no new ones",
            self.path,
        )
        uri = f"{self.path.resolve().as_uri()}?immutable=1"
        try:
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
            check = conn.execute("PRAGMA quick_check").fetchone()
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.Error as exc:
            raise InputError(f"cannot read the read-only profile cache: {exc}", source=self.path) from None
        if not check or check[0] != "ok" or not {"profiles", "context_switch"} <= tables:
            conn.close()
            raise InputError(
                "the read-only profile cache is not a readable tessera cache (and cannot be replaced)",
                source=self.path,
            )
        return conn

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def _stored(self, what: str) -> bool:
        """Whether a write may go ahead; on a read-only cache it is skipped (said once), and after
        a write the disk refused."""
        if self.read_only:
            self._warn_once("skipped", "profile cache %s is read-only: %s not stored", self.path, what)
        return not self.read_only and self.unwritable is None

    @staticmethod
    def _set_up(conn: sqlite3.Connection) -> None:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        check = conn.execute("PRAGMA quick_check").fetchone()
        if not check or check[0] != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {check[0] if check else 'no answer'}")
        conn.executescript(_SCHEMA)
        conn.execute(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
            (str(SCHEMA_VERSION),),
        )

    def _not_a_cache(self) -> str | None:
        """Why the file at the cache path is not a cache to move aside, or ``None`` if it is one."""
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return None
        except OSError as exc:  # a link loop, a name too long
            return f"cannot open the profile cache: {exc.strerror or exc}"
        if not stat.S_ISREG(info.st_mode):
            return "the profile cache is not a regular file"
        with open(self.path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
        if head and head != SQLITE_MAGIC and not self._own:
            return "not a profile cache (an SQLite database); left untouched: give --cache another path"
        return None

    def _recover(self, err: Exception) -> None:
        """Move an unreadable cache file (and its WAL) aside and start an empty one; a file that
        is no cache of tessera's (see :meth:`_not_a_cache`) is an :class:`InputError` instead."""
        why = self._not_a_cache()
        if why is not None:
            raise InputError(why, source=self.path) from err
        if self._conn is not None:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
            self._conn = None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        moved = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(self.path) + suffix)
            if src.exists():
                try:
                    src.replace(Path(str(moved) + suffix))
                except OSError:
                    src.unlink(missing_ok=True)
        log.warning(
            "profile cache %s is unreadable (%s); moved it to %s and started a new one", self.path, err, moved
        )

    def _with_conn(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            for attempt in (0, 1):
                try:
                    conn = self._connect()
                    if self.read_only:
                        return self._read_only_call(fn, conn)
                    return fn(conn)
                except sqlite3.OperationalError as err:
                    if "locked" in str(err) or "busy" in str(err) or attempt:
                        raise
                    self._recover(err)  # e.g. "disk I/O error" on a truncated file
                except sqlite3.DatabaseError as err:
                    if attempt:
                        raise
                    self._recover(err)
            raise AssertionError("unreachable")  # pragma: no cover

    def _write(self, fn: Callable[[sqlite3.Connection], None]) -> None:
        """Store a measurement. A write the disk refuses (full, a file-size limit, an I/O error) is
        said once and the run goes on without storing: the cache saves time, it holds no result.
        The file is never moved aside for it (it is not corrupt)."""
        with self._lock:
            try:
                fn(self._connect())
            except sqlite3.OperationalError as err:
                if "locked" in str(err) or "busy" in str(err):
                    raise
                self.unwritable = str(err)
                log.warning(
                    "profile cache %s cannot store measurements (%s); going on without storing",
                    self.path,
                    err,
                )

    def _read_only_call(self, fn: Callable[[sqlite3.Connection], T], conn: sqlite3.Connection) -> T:
        try:
            return fn(conn)
        except sqlite3.Error as exc:  # never moved aside: it is not ours to replace
            raise InputError(f"cannot read the read-only profile cache: {exc}", source=self.path) from None

    @contextmanager
    def _transaction(self, conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # -- profiles -------------------------------------------------------------------------------

    def get(self, backend: str, version: str, device: str, subgraph: str) -> Profile | None:
        def read(conn: sqlite3.Connection) -> Profile | None:
            row = conn.execute(
                "SELECT median_s, iqr_s, runs, compile_s, error FROM profiles "
                "WHERE backend = ? AND backend_version = ? AND device = ? AND subgraph = ?",
                (backend, version, device, subgraph),
            ).fetchone()
            if row is None:
                return None
            median, iqr, runs, compile_s, error = row
            if not (
                _seconds_or_null(median)
                and _seconds_or_null(iqr)
                and _seconds_or_null(compile_s)
                and type(runs) is int
                and runs >= 0
                and (error is None or isinstance(error, str))
            ):
                self._warn_once(
                    "bad-row", "profile cache %s holds invalid values; measuring again", self.path
                )
                return None
            return Profile(
                backend,
                version,
                device,
                subgraph,
                math.inf if median is None else float(median),
                math.inf if iqr is None else float(iqr),
                runs,
                compile_s,
                error,
            )

        return self._with_conn(read)

    def put(self, profile: Profile) -> None:
        if not self._stored("measurements"):
            return

        def write(conn: sqlite3.Connection) -> None:
            with self._transaction(conn):
                conn.execute(
                    "INSERT OR REPLACE INTO profiles VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        profile.backend,
                        profile.backend_version,
                        profile.device,
                        profile.subgraph,
                        profile.median_s if math.isfinite(profile.median_s) else None,
                        profile.iqr_s if math.isfinite(profile.iqr_s) else None,
                        profile.runs,
                        profile.compile_s,
                        profile.error,
                        time.time(),
                    ),
                )

        self._write(write)

    def count(self) -> int:
        return int(self._with_conn(lambda c: c.execute("SELECT COUNT(*) FROM profiles").fetchone()[0]))

    # -- context switches ------------------------------------------------------------------------

    def get_switch(self, src: str, dst: str, versions: str, device: str, nbytes: int) -> float | None:
        row = self._with_conn(
            lambda c: c.execute(
                "SELECT seconds FROM context_switch WHERE src = ? AND dst = ? AND versions = ? AND device = ? AND nbytes = ?",
                (src, dst, versions, device, nbytes),
            ).fetchone()
        )
        if row is None:
            return None
        if not (_seconds_or_null(row[0]) and row[0] is not None):
            self._warn_once("bad-row", "profile cache %s holds invalid values; measuring again", self.path)
            return None
        return float(row[0])

    def put_switch(self, src: str, dst: str, versions: str, device: str, nbytes: int, seconds: float) -> None:
        if not self._stored("measurements"):
            return

        def write(conn: sqlite3.Connection) -> None:
            with self._transaction(conn):
                conn.execute(
                    "INSERT OR REPLACE INTO context_switch VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (src, dst, versions, device, nbytes, seconds, time.time()),
                )

        self._write(write)


# --- the canonical subgraph hash ---------------------------------------------------------------


def subgraph_hash(model: onnx.ModelProto) -> str:
    """A hash of a (sub-)model's computation that ignores node and tensor names and weight values.

    Each tensor gets a label from what computes it: a graph input its shape and dtype, an initializer
    its shape and dtype, a node output the node's op type, domain, attributes, the labels of its
    inputs in order and the output index. The hash covers the sorted node labels, the sorted output
    labels and the opsets, so it is independent of names and of the order of independent nodes.
    """
    g = model.graph
    labels: dict[str, str] = {}
    for vi in g.input:
        labels[vi.name] = _digest(["input", *_type_of(vi)])
    for init in g.initializer:
        labels[init.name] = _digest(["weight", list(init.dims), int(init.data_type)])
    node_labels = []
    for node in g.node:
        attrs = sorted((a.name, _attr_value(a)) for a in node.attribute)
        ins = [labels.get(t, "missing") if t else "" for t in node.input]
        label = _digest(["node", node.op_type, node.domain, attrs, ins])
        node_labels.append(label)
        for i, t in enumerate(node.output):
            if t:
                labels[t] = _digest([label, i])
    outputs = sorted(labels.get(vi.name, "missing") for vi in g.output)
    opsets = sorted((o.domain, o.version) for o in model.opset_import)
    return _digest(["subgraph", sorted(node_labels), outputs, opsets])


def _type_of(vi: onnx.ValueInfoProto) -> list[Any]:
    tt = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tt.shape.dim]
    return [dims, int(tt.elem_type)]


def _attr_value(attr: onnx.AttributeProto) -> Any:
    value = helper.get_attribute_value(attr)
    if isinstance(value, onnx.TensorProto):
        return [
            "tensor",
            list(value.dims),
            int(value.data_type),
            hashlib.sha256(value.SerializeToString()).hexdigest(),
        ]
    if isinstance(value, onnx.GraphProto):
        return ["graph", hashlib.sha256(value.SerializeToString(deterministic=True)).hexdigest()]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list):
        return [_attr_value_item(v) for v in value]
    if isinstance(value, float):
        return repr(value)
    return value


def _attr_value_item(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, onnx.TensorProto | onnx.GraphProto):
        return hashlib.sha256(v.SerializeToString()).hexdigest()
    return v


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, separators=(",", ":"), default=_json_default).encode()).hexdigest()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)


def _seconds_or_null(value: object) -> bool:
    """A stored time: NULL (failed or not measured) or a real number of seconds in [0, MAX_SECONDS]."""
    return value is None or (type(value) in (int, float) and 0 <= value <= MAX_SECONDS)  # type: ignore[operator]


def _writable(path: Path) -> bool:
    """Writable by this process and not marked read-only by its mode (root may write a 0444 file;
    a user who made the cache read-only still means it)."""
    try:
        mode = path.stat().st_mode
        return os.access(path, os.W_OK) and bool(mode & 0o222)
    except OSError:  # a link loop, a name too long: not a read-only cache; opening it says why
        return True
