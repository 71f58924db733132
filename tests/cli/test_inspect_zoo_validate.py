"""inspect, zoo and validate end to end: JSON on stdout only, deterministic, right numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli, run_tessera
from onnx_builders import ONNX_LIGHT_MODELS

from tessera import __version__
from tessera.core.graph import load_graph
from tessera.core.plans import ModelRef, PlacementGroup, PlacementPlan, dump_plan, write_plan
from tessera.models import ZOO, build, parameter_count


@pytest.fixture
def mmt_path(tmp_path: Path) -> Path:
    path = tmp_path / "mmt.onnx"
    assert run_cli("zoo", "build", "mmt", "-o", str(path)).code == 0
    return path


def test_version():
    result = run_tessera("--version")
    assert result.code == 0 and result.out.strip() == f"tessera {__version__}"


def test_zoo_list_json_names_every_model():
    rows = json.loads(run_cli("zoo", "list", "--json").out)
    assert [r["name"] for r in rows] == list(ZOO)
    assert all(r["sizes"] == ["tiny", "paper"] for r in rows)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_inspect_json_on_every_zoo_model(tmp_path, name):
    path = tmp_path / f"{name}.onnx"
    assert run_cli("zoo", "build", name, "--size", "paper", "-o", str(path)).code == 0
    result = run_cli("inspect", str(path), "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)  # stdout is JSON and nothing else
    assert report["parameters"]["count"] == parameter_count(build(name, "paper"))
    assert report["nodes"] == load_graph(path).num_nodes
    assert sum(report["op_types"].values()) == report["nodes"]
    assert report["flops"] > 0


@pytest.mark.parametrize("path", ONNX_LIGHT_MODELS, ids=lambda p: p.stem)
def test_inspect_onnx_wheel_models(path):
    result = run_cli("inspect", str(path), "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    graph = load_graph(path)
    assert report["flops"] == graph.total_flops
    assert report["inputs"][0]["shape"] == list(next(iter(graph.inputs.values())).shape)


def test_inspect_human_output_and_determinism(mmt_path):
    first = run_cli("inspect", str(mmt_path))
    assert first.code == 0
    assert "branches: up to 2 in parallel" in first.out
    assert "MatMul" in first.out and "\x1b[" not in first.out  # no colour when not a terminal
    assert run_cli("inspect", str(mmt_path)).out == first.out
    assert run_cli("inspect", str(mmt_path), "--json").out == run_cli("inspect", str(mmt_path), "--json").out


def test_inspect_input_shape_and_write_named(tmp_path, write_model):
    from onnx_builders import single_op_model

    model = single_op_model("Relu", [("x", ("n", 3))])
    model.graph.node[0].name = ""
    path = write_model(model)
    named = tmp_path / "named.onnx"
    report = tmp_path / "report.json"
    result = run_cli(
        "inspect",
        str(path),
        "--input-shape",
        "x=5x3",
        "--write-named",
        str(named),
        "--json",
        "-o",
        str(report),
    )
    assert result.code == 0, result.err
    assert json.loads(result.out)["inputs"][0]["shape"] == [5, 3]
    assert json.loads(report.read_text()) == json.loads(result.out)
    assert load_graph(named).order == ("Relu_0",)


def placement_for(path: Path) -> PlacementPlan:
    graph = load_graph(path)
    return PlacementPlan(
        model=ModelRef.of(graph),
        groups=[PlacementGroup(id=0, backend="onnxruntime", nodes=list(graph.order), pattern="whole-model")],
    )


def test_validate_accepts_a_plan_that_fits_its_model(tmp_path, mmt_path):
    plan_path = write_plan(placement_for(mmt_path), tmp_path / "plan.json")
    result = run_cli("validate", str(plan_path), "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["valid"] is True


def test_validate_refuses_a_changed_model(tmp_path, mmt_path):
    plan_path = write_plan(placement_for(mmt_path), tmp_path / "plan.json")
    assert run_cli("zoo", "build", "mmt", "--seed", "1", "-o", str(mmt_path)).code == 0
    result = run_cli("validate", str(plan_path))
    assert result.code == 2 and "model changed" in result.err and str(plan_path) in result.err


def test_validate_finds_unknown_duplicated_and_missing_nodes(tmp_path, mmt_path):
    plan = placement_for(mmt_path)
    nodes = plan.groups[0].nodes
    bad = plan.model_copy(
        update={
            "groups": [
                PlacementGroup(id=0, backend="onnxruntime", nodes=[*nodes[:-1], "ghost"], pattern="p"),
                PlacementGroup(id=1, backend="openvino", nodes=[nodes[0]], pattern="p"),
            ]
        }
    )
    plan_path = write_plan(bad, tmp_path / "bad.json")
    result = run_cli("validate", str(plan_path))
    assert result.code == 2
    assert "unknown node 'ghost'" in result.err and "(and 2 more)" in result.err


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        # An empty plan crashed validate and launch with KeyError (exit 1).
        (lambda p: p.update(groups=[]), "field groups: List should have at least 1 item"),
        (lambda p: p["groups"].append({**p["groups"][0], "nodes": ["x"]}), "group id 0 is used twice"),
        (lambda p: p.update(predicted={"latency_s": "fast"}), "predicted.latency_s must be a number"),
        (lambda p: p.update(predicted={"latency_s": -1.0}), "predicted.latency_s is -1.0"),
    ],
)
def test_validate_refuses_hand_edited_placements(tmp_path, mmt_path, edit, fragment):
    data = json.loads(dump_plan(placement_for(mmt_path)))
    edit(data)
    plan_path = tmp_path / "bad.json"
    plan_path.write_text(json.dumps(data))
    result = run_cli("validate", str(plan_path))
    lines = result.err.strip().splitlines()
    assert result.code == 2 and len(lines) == 1 and fragment in lines[0] and str(plan_path) in lines[0], (
        result.err
    )


def test_validate_refuses_placements_that_cannot_run(tmp_path, mmt_path):
    """Both passed validate and then failed launch (exit 4): a backend no registry knows, and
    groups that feed each other in a cycle (first and last thirds on one backend, the middle on
    another: the model's chain goes out of the first group and back in)."""
    plan = placement_for(mmt_path)
    nodes = plan.groups[0].nodes
    third = len(nodes) // 3
    cases = {
        "unknown": (
            [PlacementGroup(id=0, backend="tensorrtx", nodes=nodes, pattern="p")],
            "group 0: backend 'tensorrtx' is not a registered backend (known: cudnn, onnxruntime, onnxruntime-int8, openvino",
        ),
        "cycle": (
            [
                PlacementGroup(
                    id=0, backend="onnxruntime", nodes=nodes[:third] + nodes[2 * third :], pattern="p"
                ),
                PlacementGroup(id=1, backend="openvino", nodes=nodes[third : 2 * third], pattern="p"),
            ],
            "groups feed each other in a cycle (0 -> 1 -> 0): no order runs them",
        ),
    }
    for name, (groups, fragment) in cases.items():
        plan_path = write_plan(plan.model_copy(update={"groups": groups}), tmp_path / f"{name}.json")
        result = run_cli("validate", str(plan_path))
        lines = result.err.strip().splitlines()
        assert result.code == 2 and len(lines) == 1, result.err
        assert str(plan_path) in lines[0] and fragment in lines[0], lines[0]


def test_validate_names_a_missing_model(tmp_path, mmt_path):
    plan_path = write_plan(placement_for(mmt_path), tmp_path / "plan.json")
    mmt_path.unlink()
    result = run_cli("validate", str(plan_path))
    assert result.code == 2 and "does not exist" in result.err
    # A --model that is not there is named as such (it said "… the plan names … (give --model)").
    given = run_cli("validate", str(plan_path), "--model", str(tmp_path / "nope.onnx"))
    assert given.code == 2 and given.err.strip().endswith("nope.onnx: no such model file (given as --model)")


def test_a_plan_s_bad_input_shapes_are_named_as_the_plan_s(tmp_path, mmt_path):
    data = json.loads(dump_plan(placement_for(mmt_path)))
    data["model"]["input_shapes"] = {"nosuch": [1, 2]}
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(data))
    result = run_cli("validate", str(plan_path))
    assert result.code == 2 and f"{plan_path}: model.input_shapes (for " in result.err
    assert "names 'nosuch', which is not a graph input" in result.err and "--input-shape" not in result.err


def test_plans_are_written_byte_identically(tmp_path, mmt_path):
    a = write_plan(placement_for(mmt_path), tmp_path / "a.json").read_bytes()
    b = write_plan(placement_for(mmt_path), tmp_path / "b.json").read_bytes()
    assert a == b
