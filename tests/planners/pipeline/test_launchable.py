"""Refused at plan time what launch cannot run. A model exported with a fixed batch axis
(torch.onnx.export's default) cannot be trained in micro-batches of other sizes: plan refuses it
(exit 2, the fix named), validate and launch say the same; a model written by inspect --write-named
keeps the original's symbolic batch. Operators the executor cannot train: plan warns, validate refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_cli
from onnx import TensorProto, helper, numpy_helper

from tessera.core.errors import InputError
from tessera.core.graph import load_graph
from tessera.executor.routing import tensor_layouts
from tessera.planners.pipeline.plan import pipeline_options, plan_gpp

FIX = "re-export with a dynamic batch axis"


def _mlp(path: Path, batch: int | str) -> Path:
    rng = __import__("numpy").random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(8, 8)).astype("float32"), "w")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
            helper.make_node("Relu", ["h"], ["y"], name="relu"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8])],
        [w],
    )
    path.write_bytes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    )
    return path


def test_plan_refuses_a_fixed_batch_with_the_fix(tmp_path: Path) -> None:
    path = _mlp(tmp_path / "fixed.onnx", 2)
    result = run_cli(
        "plan", str(path), "--cluster", "local-cpu-split", "--mini-batch", "8", "-o", str(tmp_path / "p.json")
    )
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "fixed batch of 2" in lines[0] and FIX in lines[0]
    assert "dynamic_axes={'x': {0: 'batch'}}" in lines[0]
    assert not (tmp_path / "p.json").exists()


def test_validate_and_launch_say_the_same(tmp_path: Path, cluster) -> None:
    dynamic = load_graph(str(_mlp(tmp_path / "dynamic.onnx", "batch")))
    spec = cluster("local-cpu-split")
    plan, _, _ = plan_gpp(dynamic, spec, pipeline_options(spec, mini_batch=8), baseline=False)
    fixed = load_graph(str(_mlp(tmp_path / "fixed.onnx", 2)))
    from tessera.planners.pipeline.checks import check_gpp_plan

    assert check_gpp_plan(plan, dynamic) == []
    problems = check_gpp_plan(plan, fixed)
    assert any(p.startswith("launch cannot train it: input 'x' has a fixed batch of 2") for p in problems)
    with pytest.raises(InputError, match=FIX):
        tensor_layouts(fixed, str(tmp_path / "fixed.onnx"))


def test_the_named_model_keeps_the_symbolic_batch(tmp_path: Path) -> None:
    source = _mlp(tmp_path / "dynamic.onnx", "batch")
    named = tmp_path / "named.onnx"
    assert run_cli("inspect", str(source), "--write-named", str(named)).code == 0
    graph = load_graph(str(named), input_shapes={"x": (4, 8)})
    assert graph.fixed_batch == {} and graph.inputs["x"].shape == (4, 8)
    args = ["--cluster", "local-cpu-split", "--mini-batch", "8", "--json"]
    a, b = run_cli("plan", str(source), *args), run_cli("plan", str(named), *args)
    assert a.code == b.code == 0, a.err + b.err
    assert a.out.split('"stages"')[1] == b.out.split('"stages"')[1]  # same plan, another file


def test_operators_launch_cannot_train_are_named_by_plan_and_validate(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Acos", ["x"], ["y"], name="acos")],
        "acos",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 3])],
    )
    model = tmp_path / "det.onnx"
    model.write_bytes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    )
    out = tmp_path / "det.json"
    planned = run_cli("plan", str(model), "--cluster", "local-cpu-split", "--mini-batch", "4", "-o", str(out))
    assert planned.code == 0, planned.err  # a plan to simulate, with a warning
    assert "warning" in planned.err and "no function for Acos ('acos')" in planned.err
    checked = run_cli("validate", str(out))
    assert checked.code == 2 and "launch cannot train it" in checked.err and "Acos ('acos')" in checked.err
