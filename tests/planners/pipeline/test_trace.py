"""``plan --trace``: the simulated iteration as a trace-event file (a track per device, every
send an arrow to its receive), and a saved plan simulated again as the planner simulated it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from cli_runner import run_cli

from tessera.core.plans import load_plan
from tessera.core.specs import ClusterSpec
from tessera.core.trace import trace_problems
from tessera.planners.pipeline.trace import simulate_plan


@pytest.fixture(scope="module")
def mmt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("zoo") / "mmt.onnx"
    assert run_cli("zoo", "build", "mmt", "--size", "tiny", "-o", str(path)).code == 0
    return path


CASES = {  # a DAG on two nodes of four GPUs with replicas; a forced chain on two CPU ranks
    "v100-dag": ["--cluster", "graphpipe-v100", "--mini-batch", "32", "--devices", "8"],
    "cpu-chain": ["--cluster", "local-cpu-split", "--mini-batch", "8", "--memory-limit", "1.2MiB"],
    "v100-kfkb": [
        "--cluster",
        "graphpipe-v100",
        "--mini-batch",
        "64",
        "--devices",
        "8",
        "--schedule",
        "kfkb",
    ],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_plan_trace_is_the_simulated_iteration(case: str, mmt: Path, tmp_path: Path) -> None:
    plan_path, trace_path = tmp_path / "plan.json", tmp_path / "trace.json"
    made = run_cli("plan", str(mmt), *CASES[case], "-o", str(plan_path), "--trace", str(trace_path))
    assert made.code == 0, made.err
    doc = json.loads(trace_path.read_text())
    assert trace_problems(doc) == []
    plan = load_plan(str(plan_path))
    events = doc["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    devices = [d for st in plan.stages for d in st.devices]
    assert tracks == {f"{d} (stage {st.id})" for st in plan.stages for d in st.devices}
    assert len(tracks) == len(devices)
    # Each device's compute stream: its stage's forwards and backwards, at the predicted times.
    pid = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    for st in plan.stages:
        for d in st.devices:
            mine = [
                e
                for e in events
                if e["ph"] == "X" and e["pid"] == pid[f"{d} (stage {st.id})"] and e["tid"] == 0
            ]
            assert sorted(e["name"] for e in mine) == sorted(st.schedule.actions)
            for e in mine:
                want = st.predicted["forward_time_s" if e["name"][0] == "F" else "backward_time_s"]
                assert e["dur"] == pytest.approx(want * 1e6, rel=1e-6, abs=2e-3)
    end = max(e["ts"] + e.get("dur", 0) for e in events if e["ph"] == "X")
    assert end == pytest.approx(plan.predicted["iteration_time_s"] * 1e6, rel=1e-6)
    # Every transfer: an arrow from its sender's slice to its receiver's, once per sending replica.
    flows = Counter(e["ph"] for e in events if e["ph"] in "sf")
    sends = [e for e in events if e["ph"] == "X" and e["name"].startswith(("activations", "gradients"))]
    assert flows["s"] == flows["f"] == sum(1 for e in sends if _stream(events, e).startswith("send"))
    assert flows["s"] > 0
    again = tmp_path / "again.json"
    assert run_cli("plan", str(mmt), *CASES[case], "--trace", str(again)).code == 0
    assert again.read_bytes() == trace_path.read_bytes()  # deterministic


def _stream(events: list, e: dict) -> str:
    return next(
        m["args"]["name"]
        for m in events
        if m["name"] == "thread_name" and (m["pid"], m["tid"]) == (e["pid"], e["tid"])
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_saved_plan_simulates_again_to_its_prediction(case: str, mmt: Path, tmp_path: Path) -> None:
    plan_path = tmp_path / "plan.json"
    assert run_cli("plan", str(mmt), *CASES[case], "-o", str(plan_path)).code == 0
    plan = load_plan(str(plan_path))
    sim = simulate_plan(plan, ClusterSpec.from_json_dict(plan.cluster))
    assert sim.iteration_time == pytest.approx(plan.predicted["iteration_time_s"], rel=1e-6)
    for st in plan.stages:
        assert sim.busy[st.id] == pytest.approx(st.predicted["busy_s"], rel=1e-6)


def test_trace_is_an_option_of_training_plans_only(tmp_path: Path) -> None:
    result = run_cli("plan", "--kind", "cp", "--llm", "gpt2", "--cluster", "h200", "--batch", "1",
                     "--context", "1K", "--trace", str(tmp_path / "t.json"))  # fmt: skip
    assert result.code == 2 and "--trace does not apply to --kind cp" in result.err
    assert not (tmp_path / "t.json").exists()
