"""``tessera place`` and ``tessera launch placement.json`` end to end, with real measurements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli

from tessera.backends.patterns import is_convex
from tessera.core.graph import load_graph
from tessera.core.plan_checks import check_plan_against_model
from tessera.core.plans import load_plan

BACKENDS = "onnxruntime,openvino"  # TVM adds minutes of builds and nothing these checks need


def mlp():
    """A two-layer MLP with a softmax (12 operators): small enough to profile cold in seconds."""
    from backends.conftest import hand_graph

    return hand_graph(
        [
            ("fc1/matmul", "MatMul", ["x", "w1"], ["h1"]),
            ("fc1/bias", "Add", ["h1", "b1"], ["h2"]),
            ("fc1/relu", "Relu", ["h2"], ["h3"]),
            ("fc2/matmul", "MatMul", ["h3", "w2"], ["h4"]),
            ("fc2/bias", "Add", ["h4", "b2"], ["h5"]),
            ("fc2/gelu_in", "Sigmoid", ["h5"], ["h6"]),
            ("fc2/gate", "Mul", ["h5", "h6"], ["h7"]),
            ("head/matmul", "MatMul", ["h7", "w3"], ["h8"]),
            ("head/softmax", "Softmax", ["h8"], ["y"], {"axis": -1}),
        ],
        {"x": [8, 64]},
        ["y"],
        {"w1": [64, 128], "b1": [128], "w2": [128, 128], "b2": [128], "w3": [128, 16]},
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("place")
    (path / "model.onnx").write_bytes(mlp().model.SerializeToString())
    return path


@pytest.fixture(scope="module")
def placed(workdir: Path) -> tuple[Path, dict]:
    plan = workdir / "placement.json"
    result = run_cli(
        "place", str(workdir / "model.onnx"), "--backends", BACKENDS, "--cache", str(workdir / "p.sqlite"),
        "-o", str(plan), "--verify", "--json",
    )  # fmt: skip
    assert result.code == 0, result.err
    return plan, json.loads(result.out)


def test_place_writes_a_plan_that_covers_the_model(workdir: Path, placed) -> None:
    plan_path, report = placed
    graph = load_graph(str(workdir / "model.onnx"))
    plan = load_plan(plan_path)
    assert plan.kind == "placement" and check_plan_against_model(plan, graph) == []
    assert all(is_convex(graph, g.nodes) for g in plan.groups)
    measured = plan.measured
    assert set(measured["single_backend_latency_s"]) == {"onnxruntime", "openvino"}
    assert measured["latency_s"] > 0 and plan.predicted["latency_s"] > 0
    best = min(v for v in measured["single_backend_latency_s"].values())
    assert measured["latency_s"] <= best  # never slower than the best single backend (same run)
    assert report["verify"]["ok"] and report["plan"]["search"]["kind"] == "op"
    assert all(g.measured_time_s is not None for g in plan.groups)


def test_human_output_and_launch(workdir: Path, placed) -> None:
    plan_path, _ = placed
    human = run_cli(
        "place", str(workdir / "model.onnx"), "--backends", BACKENDS, "--cache", str(workdir / "p.sqlite")
    )
    assert human.code == 0, human.err
    assert "groups per backend" in human.out and "speed-up over the best single backend" in human.out
    launched = run_cli("launch", str(plan_path), "--repeat", "2", "--json")
    assert launched.code == 0, launched.err
    report = json.loads(launched.out)
    assert report["kind"] == "placement" and report["verify"]["ok"] and report["measured"]["latency_s"] > 0
    # The error against onnxruntime's fp32 reference, measured as place measured it (the same
    # seeded inputs): the worst output element, and each output relative to its own scale.
    worst = max(report["verify"]["outputs"].values(), key=lambda r: r["max_abs_diff"])
    assert report["error"]["max_abs"] == pytest.approx(worst["max_abs_diff"])
    recorded = load_plan(plan_path).measured["error"]
    assert report["error"]["max_rel"] == pytest.approx(recorded["max_rel"], rel=1e-6, abs=1e-12)
    assert 0 <= report["error"]["max_abs"] < 1e-4
    text = run_cli("launch", str(plan_path), "--repeat", "2")
    assert text.code == 0 and "outputs match onnxruntime" in text.out


def test_graph_level_search(workdir: Path) -> None:
    result = run_cli(
        "place", str(workdir / "model.onnx"), "--backends", BACKENDS, "--cache", str(workdir / "p.sqlite"),
        "--search", "graph", "--budget", "3", "--json",
    )  # fmt: skip
    assert result.code == 0, result.err
    search = json.loads(result.out)["plan"]["search"]
    assert search["kind"] == "graph" and search["graph_level_backend"] == "openvino"
    assert search["evolution"]["evaluations"] >= 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backends", "nosuch"], "unknown backend 'nosuch'"),
        (["--backends", "tensorrt"], "backend 'tensorrt' is unavailable"),
        (["--search", "exhaustive"], "exhaustive"),
        (["--device", "tpu"], "no backend is available on device 'tpu'"),
    ],
)
def test_bad_options_exit_2(workdir: Path, args: list[str], message: str) -> None:
    result = run_cli("place", str(workdir / "model.onnx"), *args)
    assert result.code == 2 and message in result.err


def test_missing_model_exit_2(tmp_path: Path) -> None:
    assert run_cli("place", str(tmp_path / "none.onnx")).code == 2


def test_launch_refuses_a_changed_model(workdir: Path, placed, tmp_path: Path) -> None:
    plan_path, _ = placed
    other = tmp_path / "other.onnx"
    model = mlp().model
    model.graph.initializer[0].raw_data = bytes(len(model.graph.initializer[0].raw_data))
    other.write_bytes(model.SerializeToString())
    result = run_cli("launch", str(plan_path), "--model", str(other))
    assert result.code == 2 and "model changed" in result.err


@pytest.mark.slow
def test_place_with_tvm(tmp_path: Path) -> None:
    """TVM as a placement backend (slow: every candidate is an LLVM build)."""
    from backends.conftest import hand_graph

    graph = hand_graph(
        [("mm", "MatMul", ["x", "w"], ["t"]), ("act", "Relu", ["t"], ["y"])],
        {"x": [4, 32]},
        ["y"],
        {"w": [32, 32]},
    )
    path = tmp_path / "mlp.onnx"
    path.write_bytes(graph.model.SerializeToString())
    result = run_cli(
        "place",
        str(path),
        "--backends",
        "onnxruntime,tvm",
        "--cache",
        str(tmp_path / "c.sqlite"),
        "--verify",
        "--json",
    )
    assert result.code == 0, result.err
    plan = json.loads(result.out)["plan"]
    assert set(plan["measured"]["single_backend_latency_s"]) == {"onnxruntime", "tvm"}


def test_repeat_runs_on_a_warm_cache_write_byte_identical_plans(workdir: Path, placed) -> None:
    """The final choice reads the medians the first run stored: same model, seed and cache, same
    plan, byte for byte (no live timing decides twice)."""
    plans = []
    for i in range(2):
        out = workdir / f"again{i}.json"
        result = run_cli("place", str(workdir / "model.onnx"), "--backends", BACKENDS,
                         "--cache", str(workdir / "p.sqlite"), "-o", str(out))  # fmt: skip
        assert result.code == 0, result.err
        plans.append(out.read_bytes())
    assert plans[0] == plans[1] == placed[0].read_bytes()
    measured = load_plan(placed[0]).measured
    assert measured["compared_with"] == ["onnxruntime", "openvino"] and measured["noise_margin"] == 0.05
    assert measured["best_single_backend"] in measured["decision"]  # what decided, in words
