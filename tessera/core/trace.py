"""Timelines as Chrome trace-event JSON, the format Perfetto (ui.perfetto.dev) and chrome://tracing
open: one process per device or rank, a thread per stream, complete slices, and flow arrows from a
send to its receive. :func:`trace_problems` checks a document against the format's rules.
Layout and conventions: docs/traces.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COMPUTE", "Trace", "trace_problems"]

COMPUTE = "compute"  # the first stream of every track
_PHASES = frozenset("XMsf")


def _us(seconds: float) -> float:
    """Seconds as the format's microseconds, to the nanosecond (byte-stable output)."""
    return round(seconds * 1e6, 3)


@dataclass
class Trace:
    """A trace being built: :meth:`track` names a process, :meth:`span` adds a slice on one of its
    streams (threads, numbered in the order they first appear; ``compute`` first), :meth:`flow` an
    arrow between two slices; :meth:`to_json` is the document."""

    events: list[dict[str, Any]] = field(default_factory=list)
    streams: dict[int, dict[str, int]] = field(default_factory=dict)  # pid -> stream name -> tid
    flows: int = 0

    def track(self, pid: int, name: str, *, sort: int | None = None) -> None:
        """Process ``pid`` is called ``name``, shown in ``sort`` order (default: ``pid``)."""
        self.events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        order = {"sort_index": pid if sort is None else sort}
        self.events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": order})
        self._tid(pid, COMPUTE)

    def span(
        self,
        pid: int,
        stream: str,
        name: str,
        start: float,
        end: float,
        *,
        cat: str,
        args: Mapping[str, Any] | None = None,
    ) -> None:
        """A slice from ``start`` to ``end`` seconds on ``stream`` of track ``pid``."""
        event: dict[str, Any] = {
            "ph": "X", "name": name, "cat": cat, "pid": pid, "tid": self._tid(pid, stream),
            "ts": _us(start), "dur": _us(max(end - start, 0.0)),
        }  # fmt: skip
        if args:
            event["args"] = dict(args)
        self.events.append(event)

    def flow(
        self, name: str, source: tuple[int, str, float], target: tuple[int, str, float], *, cat: str
    ) -> None:
        """An arrow from the slice at ``source`` ``(pid, stream, seconds)`` to the one at ``target``
        (each bound to the slice enclosing that instant)."""
        self.flows += 1
        (sp, ss, s_ts), (tp, tstream, t_ts) = source, target
        common = {"name": name, "cat": cat, "id": self.flows}
        self.events.append({"ph": "s", **common, "pid": sp, "tid": self._tid(sp, ss), "ts": _us(s_ts)})
        end = {"ph": "f", "bp": "e", **common, "pid": tp, "tid": self._tid(tp, tstream)}
        self.events.append({**end, "ts": _us(max(t_ts, s_ts))})

    def to_json(self, **other: Any) -> dict[str, Any]:
        """The trace-event document (``other``: what the file describes, kept in ``otherData``)."""
        meta = [e for e in self.events if e["ph"] == "M"]
        timed = sorted(
            (e for e in self.events if e["ph"] != "M"),
            key=lambda e: (e["ts"], e["pid"], e["tid"], e["ph"] != "X", e.get("id", 0)),
        )
        return {"traceEvents": meta + timed, "displayTimeUnit": "ms", "otherData": other}

    def _tid(self, pid: int, stream: str) -> int:
        streams = self.streams.setdefault(pid, {})
        if stream not in streams:
            streams[stream] = len(streams)
            name = {"name": stream}
            self.events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": streams[stream], "args": name}
            )
        return streams[stream]


def trace_problems(doc: Any) -> list[str]:
    """What breaks the trace-event format's rules in ``doc`` (empty: none): known phases, integer
    processes and threads, non-negative microsecond timestamps and durations, every process named,
    every flow start paired with exactly one end of the same id, no end before its start."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("traceEvents"), Sequence):
        return ["not a trace-event document: no traceEvents list"]
    problems: list[str] = []
    named: set[int] = set()
    used: set[int] = set()
    flows: dict[str, dict[Any, float]] = {"s": {}, "f": {}}  # flow starts and ends by (cat, id)
    for i, e in enumerate(doc["traceEvents"]):
        why = _event_problem(e)
        if why is not None:
            problems.append(f"event {i}: {why}")
            continue
        if e["ph"] == "M":
            if e.get("name") == "process_name":
                named.add(e["pid"])
            continue
        used.add(e["pid"])
        if e["ph"] == "X":
            problems.extend(f"event {i}: {why}" for why in _slice_problems(e))
            continue
        key, seen = (e.get("cat"), e.get("id")), flows[e["ph"]]
        if key in seen:
            problems.append(f"event {i}: flow {key} has two {'starts' if e['ph'] == 's' else 'ends'}")
        seen[key] = e["ts"]
    problems.extend(_flow_problems(flows["s"], flows["f"]))
    problems.extend(f"process {pid} has events but no process_name" for pid in sorted(used - named))
    return problems


def _event_problem(e: Mapping[str, Any]) -> str | None:
    """What makes one event unreadable (its phase, pid, tid or timestamp); None if nothing."""
    ph = e.get("ph")
    if ph not in _PHASES:
        return f"phase {ph!r} is not one of {''.join(sorted(_PHASES))}"
    if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
        return "pid and tid must be integers"
    ts = e.get("ts")
    if ph != "M" and (not isinstance(ts, int | float) or ts < 0):
        return f"ts {ts!r} is not a non-negative number of microseconds"
    return None


def _slice_problems(e: Mapping[str, Any]) -> list[str]:
    """A complete event's own rules: a non-negative duration and a name."""
    problems = []
    if not isinstance(e.get("dur"), int | float) or e["dur"] < 0:
        problems.append("a complete event needs a non-negative dur")
    if not e.get("name"):
        problems.append("a slice needs a name")
    return problems


def _flow_problems(starts: Mapping[Any, float], ends: Mapping[Any, float]) -> list[str]:
    """Flows without their pair, or ending before they start."""
    problems = []
    for key in starts.keys() | ends.keys():
        if key not in ends or key not in starts:
            problems.append(f"flow {key}: a {'start' if key in starts else 'end'} without its pair")
        elif ends[key] < starts[key]:
            problems.append(f"flow {key}: ends at {ends[key]} us, before it starts at {starts[key]} us")
    return problems
