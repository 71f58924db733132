"""``launch --trace``: the run's own timeline as a trace-event file, each rank's measured spans
beside the plan's simulated iteration, every message an arrow from its send to its receive."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from cli_runner import run_cli

from tessera.core.plans import load_plan
from tessera.core.trace import trace_problems

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture(scope="module")
def mmt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("zoo") / "mmt.onnx"
    assert run_cli("zoo", "build", "mmt", "--size", "tiny", "-o", str(path)).code == 0
    return path


def _launched(mmt: Path, tmp_path: Path, *plan_args: str) -> tuple[object, dict, dict]:
    plan_path, trace_path = tmp_path / "plan.json", tmp_path / "run.json"
    made = run_cli(
        "plan",
        str(mmt),
        "--cluster",
        "local-cpu-split",
        "--mini-batch",
        "8",
        *plan_args,
        "-o",
        str(plan_path),
    )
    assert made.code == 0, made.err
    run = run_cli("launch", str(plan_path), "--steps", str(STEPS), "--trace", str(trace_path), "--json")
    assert run.code == 0, run.err
    doc = json.loads(trace_path.read_text())
    assert trace_problems(doc) == []
    return load_plan(str(plan_path)), json.loads(run.out), doc


def _names(doc: dict, what: str) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == what}


def test_a_two_stage_run_traces_every_action_and_message_beside_the_prediction(
    mmt: Path, tmp_path: Path
) -> None:
    plan, report, doc = _launched(mmt, tmp_path, "--memory-limit", "1.2MiB")
    assert len(plan.stages) == 2
    events = doc["traceEvents"]
    tracks = {pid: name for (pid, _), name in _names(doc, "process_name").items()}
    assert tracks == {
        2 * r: f"rank {r}: {st.devices[0]} (stage {st.id}) measured" for r, st in enumerate(plan.stages)
    } | {
        2 * r + 1: f"rank {r}: {st.devices[0]} (stage {st.id}) predicted" for r, st in enumerate(plan.stages)
    }
    streams = _names(doc, "thread_name")
    spans = [e for e in events if e["ph"] == "X"]
    for r, st in enumerate(plan.stages):
        measured = [e for e in spans if e["pid"] == 2 * r and streams[(e["pid"], e["tid"])] == "compute"]
        actions = Counter(e["name"] for e in measured)
        assert actions == Counter({**{a: STEPS for a in st.schedule.actions}, "optimizer step": STEPS})
        # Each step's compute spans are the busy time the report gives for it.
        for k, row in enumerate(report["steps"]):
            busy = sum(e["dur"] for e in measured if e["args"]["step"] == k and e["name"] != "optimizer step")
            assert busy * 1e-6 == pytest.approx(row["busy_s"][str(st.id)], rel=1e-3)
        predicted = [e for e in spans if e["pid"] == 2 * r + 1 and streams[(e["pid"], e["tid"])] == "compute"]
        assert Counter(e["name"] for e in predicted) == Counter({a: STEPS for a in st.schedule.actions})
        for e in predicted:
            want = st.predicted["forward_time_s" if e["name"][0] == "F" else "backward_time_s"]
            assert e["dur"] == pytest.approx(want * 1e6, rel=1e-6, abs=2e-3)
    # Messages: activations forward and gradients back, per micro-batch and step, each an arrow
    # from a send on one rank to the receive on the other, measured and predicted alike.
    micro_batches = plan.mini_batch_size // plan.stages[0].micro_batch_size
    for cat in ("measured", "predicted"):
        starts = [e for e in events if e["ph"] == "s" and e["cat"] == cat]
        ends = {e["id"]: e for e in events if e["ph"] == "f" and e["cat"] == cat}
        assert len(starts) == len(ends) == 2 * micro_batches * STEPS
        for s in starts:
            f = ends[s["id"]]
            assert s["pid"] // 2 != f["pid"] // 2 and s["name"] == f["name"]
            assert streams[(s["pid"], s["tid"])].startswith("send") and streams[
                (f["pid"], f["tid"])
            ].startswith("receive")


def test_data_parallel_replicas_trace_their_all_reduce(mmt: Path, tmp_path: Path) -> None:
    plan, _, doc = _launched(mmt, tmp_path)
    assert len(plan.stages) == 1 and len(plan.stages[0].devices) == 2
    streams = _names(doc, "thread_name")
    for cat, pids in (("measured", (0, 2)), ("predicted", (1, 3))):
        for pid in pids:
            reduce = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == pid
                      and streams[(pid, e["tid"])] == "all-reduce"]  # fmt: skip
            assert len(reduce) == STEPS and all(e["cat"] == cat for e in reduce)


def test_trace_applies_to_training_plans_only(tmp_path: Path) -> None:
    plan = tmp_path / "cp.json"
    made = run_cli("plan", "--kind", "cp", "--llm", "gpt2", "--cluster", "a5000-4x", "--batch", "1",
                   "--context", "1K", "-o", str(plan))  # fmt: skip
    assert made.code == 0, made.err
    for flag, value in (("--trace", "t.json"), ("--save-model", "m.onnx"), ("--checkpoint", "ck")):
        result = run_cli("launch", str(plan), flag, str(tmp_path / value))
        assert result.code == 2 and f"{flag} does not apply to a cp plan" in result.err, flag
        assert not (tmp_path / value).exists()
    result = run_cli("launch", str(plan), "--precision", "bf16")
    assert result.code == 2 and "--precision does not apply to a cp plan" in result.err, result.err
