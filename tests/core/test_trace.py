"""The trace-event writer and its checker: what Perfetto and chrome://tracing need of a file."""

from __future__ import annotations

import json

from tessera.core.trace import COMPUTE, Trace, trace_problems


def _two_tracks() -> Trace:
    trace = Trace()
    trace.track(0, "rank 0")
    trace.track(1, "rank 1")
    trace.span(0, COMPUTE, "F0", 0.0, 1e-3, cat="measured")
    trace.span(0, "send → stage 1", "activations 0", 1e-3, 1.1e-3, cat="measured")
    trace.span(1, "receive ← stage 0", "activations 0", 1e-3, 1.2e-3, cat="measured")
    trace.flow("activations 0", (0, "send → stage 1", 1e-3), (1, "receive ← stage 0", 1e-3), cat="measured")
    return trace


def test_a_built_trace_follows_the_format() -> None:
    doc = _two_tracks().to_json(what="test")
    assert trace_problems(doc) == []
    events = doc["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "X", "s", "f"}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {
        (0, 0): "compute",
        (0, 1): "send → stage 1",
        (1, 0): "compute",
        (1, 1): "receive ← stage 0",
    }
    first = next(e for e in events if e["ph"] == "X")
    assert (first["ts"], first["dur"]) == (0.0, 1000.0)  # microseconds
    end = next(e for e in events if e["ph"] == "f")
    assert end["bp"] == "e" and end["pid"] == 1
    assert json.loads(json.dumps(doc)) == doc
    assert json.dumps(_two_tracks().to_json(what="test")) == json.dumps(doc)  # byte-stable


def test_the_checker_names_each_broken_rule() -> None:
    doc = _two_tracks().to_json()
    events = doc["traceEvents"]
    broken = {
        "phase 'B'": [*events, {"ph": "B", "pid": 0, "tid": 0, "ts": 1, "name": "x"}],
        "non-negative number of microseconds": [
            *events,
            {"ph": "X", "pid": 0, "tid": 0, "ts": -1, "dur": 1, "name": "x"},
        ],
        "non-negative dur": [*events, {"ph": "X", "pid": 0, "tid": 0, "ts": 1, "name": "x"}],
        "without its pair": [e for e in events if e["ph"] != "f"],
        "before it starts": [{**e, "ts": 0.0} if e["ph"] == "f" else e for e in events],
        "no process_name": [*events, {"ph": "X", "pid": 7, "tid": 0, "ts": 1, "dur": 1, "name": "x"}],
        "integers": [*events, {"ph": "X", "pid": "7", "tid": 0, "ts": 1, "dur": 1, "name": "x"}],
        "two starts": [*events, next(e for e in events if e["ph"] == "s")],
    }
    for rule, bad in broken.items():
        problems = trace_problems({**doc, "traceEvents": bad})
        assert any(rule in p for p in problems), (rule, problems)
    assert trace_problems({"events": []}) == ["not a trace-event document: no traceEvents list"]
