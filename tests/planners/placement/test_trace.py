"""``place --trace``: a placement's groups on a track per backend, each at its measured time, laid
out in order, or by dataflow where the plan runs independent groups concurrently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli

from tessera.core.graph import load_graph
from tessera.core.plans import ModelRef, PlacementGroup, PlacementPlan
from tessera.core.trace import trace_problems
from tessera.models import build
from tessera.planners.placement.trace import placement_trace


@pytest.fixture(scope="module")
def mmt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("zoo") / "mmt.onnx"
    path.write_bytes(build("mmt", "tiny", seed=0).SerializeToString())
    return path


@pytest.mark.parametrize("concurrent", [False, True])
def test_groups_are_laid_out_by_order_or_by_dataflow(mmt: Path, concurrent: bool) -> None:
    graph = load_graph(str(mmt))
    order = graph.order
    branch0 = [n for n in order if n.startswith("branch0/")]
    branch1 = [n for n in order if n.startswith("branch1/")]
    rest = [n for n in order if n not in set(branch0) | set(branch1)]
    times = (0.002, 0.003, 0.001)
    groups = [
        PlacementGroup(id=i, backend=b, nodes=nodes, pattern="test", measured_time_s=t)
        for i, (b, nodes, t) in enumerate(zip(("onnxruntime", "openvino", "onnxruntime"), (branch0, branch1, rest), times, strict=True))
    ]  # fmt: skip
    plan = PlacementPlan(
        model=ModelRef.of(graph), groups=groups, concurrent=concurrent, predicted={"latency_s": 0.006}
    )
    doc = placement_trace(plan, graph)
    assert trace_problems(doc) == []
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names.values()) == ["onnxruntime", "openvino"]
    spans = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    starts = {int(n.split(":")[0].split()[1]): e["ts"] for n, e in spans.items()}
    assert [spans[f"group {i}: test"]["dur"] for i in range(3)] == [t * 1e6 for t in times]
    assert names[spans["group 1: test"]["pid"]] == "openvino"
    # The merge reads both branches: it starts after both; branch 1 waits for branch 0 only in order.
    assert starts[1] == (0.0 if concurrent else 2000.0)
    assert starts[2] == (3000.0 if concurrent else 5000.0)


def test_place_trace_through_the_cli(mmt: Path, tmp_path: Path) -> None:
    out = tmp_path / "place.trace.json"
    result = run_cli("place", str(mmt), "--backends", "onnxruntime", "--cache", str(tmp_path / "c.sqlite"),
                     "--trace", str(out))  # fmt: skip
    assert result.code == 0, result.err
    doc = json.loads(out.read_text())
    assert trace_problems(doc) == [] and doc["otherData"]["latency_s"] > 0
    assert {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"} == {"onnxruntime"}
