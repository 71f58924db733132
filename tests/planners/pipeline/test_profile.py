"""Measured operator costs (``plan --profile``): torch autograd per operator, cached, with fallbacks.

Timing assertions compare quantities 2× or more apart (64 samples vs 1; backward of a weighted
MatMul vs its forward); everything else asserts structure (cache hits, fallback counts, bytes).
The measurements run on one thread (``local-cpu-split``'s one-core device): two threads on a
shared two-core machine stall on each other.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from cli_runner import run_cli
from onnx import TensorProto, helper, numpy_helper
from onnx_builders import single_op_model

from tessera.backends.profile_cache import ProfileCache
from tessera.core.cost import CostModel
from tessera.core.errors import InputError
from tessera.core.graph import load_graph
from tessera.core.specs import load_cluster
from tessera.models import build
from tessera.planners.pipeline.profile import ProfileOptions, open_cache, profile_graph

pytest.importorskip("torch")

FAST = ProfileOptions(budget_s=0.05)


@pytest.fixture(scope="module")
def core():
    """One CPU core (torch runs one thread)."""
    return load_cluster("local-cpu-split").devices()[0].type


def _matmul_graph():
    w = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    return load_graph(single_op_model("MatMul", [("x", (1, 128, 512))], (1, 128, 512), initializers={"w": w}))


def _mixed_graph() -> onnx.ModelProto:
    """x → MatMul(W) → Relu → Reshape(Constant) → Acos (no torch converter) → y, and
    x → Shape (no gradient) → s."""
    w = numpy_helper.from_array(np.ones((16, 16), np.float32), "w")
    shape = numpy_helper.from_array(np.array([0, 4, 4], np.int64), "shape_value")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Constant", [], ["shape"], name="shape_const", value=shape),
        helper.make_node("Reshape", ["r", "shape"], ["q"], name="reshape"),
        helper.make_node("Acos", ["q"], ["y"], name="acos"),
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
    ]
    graph = helper.make_graph(
        nodes,
        "mixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4]),
            helper.make_tensor_value_info("s", TensorProto.INT64, [2]),
        ],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_matmul_times_are_positive_grow_with_samples_and_backward_exceeds_forward(tmp_path, core) -> None:
    graph = _matmul_graph()
    measured = profile_graph(graph, core, cache=ProfileCache(tmp_path / "p.sqlite"), options=FAST)
    op = graph.op("op")
    fw1, bw1 = measured.times(op, 1)
    fw64, bw64 = measured.times(op, 64)
    assert fw1 > 0 and bw1 > 0
    assert fw64 > 2 * fw1 and bw64 > 2 * bw1
    # With weights, backward computes the input and the weight gradient: twice the forward's FLOPs.
    assert bw64 > fw64
    # One operator, measured at 1 sample and (when it fits the budget, as here) at 8: nothing cached.
    assert measured.report.measurements in (1, 2) and measured.report.cache_hits == 0
    assert measured.line("op") is not None


def test_warm_cache_measures_nothing_and_gives_the_same_times(tmp_path, core) -> None:
    graph = load_graph(build("mmt", "tiny"))
    cache = tmp_path / "p.sqlite"
    cold = profile_graph(graph, core, cache=ProfileCache(cache), options=FAST)
    assert cold.report.measurements > 0
    # Identical layers share measurements: far fewer distinct operators than operators.
    assert cold.report.distinct < cold.report.operators / 3
    warm = profile_graph(graph, core, cache=ProfileCache(cache), options=FAST)
    assert warm.report.measurements == 0
    assert warm.report.cache_hits == cold.report.measurements
    for name in graph.order:
        for samples in (1, 3, 16):
            op = graph.op(name)
            assert warm.times(op, samples) == cold.times(op, samples)
    assert warm.to_json() == cold.to_json()


def test_unsupported_and_non_differentiable_operators_fall_back_to_the_roofline(tmp_path, core) -> None:
    graph = load_graph(_mixed_graph())
    cache = tmp_path / "p.sqlite"
    measured = profile_graph(graph, core, cache=ProfileCache(cache), options=FAST)
    assert measured.roofline_types() == {"Acos": 1, "Shape": 1}
    assert measured.to_json()["roofline_operators"] == 2
    assert measured.to_json()["measured_operators"] == 3  # MatMul, Relu, Reshape (its shape: a Constant)
    assert measured.fallback["shape_const"].startswith("constant")
    assert "no torch converter" in measured.fallback["acos"]
    assert "differentiable" in measured.fallback["shape"]
    # The cost model takes measured times where there are some, the roofline elsewhere.
    roofline = CostModel.for_device(core)
    cost = CostModel.for_device(core, measured=measured)
    matmul, hard = graph.op("matmul"), graph.op("acos")
    assert cost.forward_time(matmul, 4) == measured.times(matmul, 4)[0]
    assert cost.backward_time(matmul, 4) == measured.times(matmul, 4)[1]
    assert cost.forward_time(hard, 4) == roofline.forward_time(hard, 4)
    # The failed measurement (Shape) is cached too: a second run measures nothing.
    again = profile_graph(graph, core, cache=ProfileCache(cache), options=FAST)
    assert again.report.measurements == 0
    assert again.roofline_types() == {"Acos": 1, "Shape": 1}


def test_a_cache_path_that_cannot_hold_a_file_is_an_input_error(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="not a folder"):
        open_cache(tmp_path / "file" / "p.sqlite")
    with pytest.raises(InputError, match="not a file"):
        open_cache(tmp_path)


def test_plan_profile_writes_a_valid_measured_plan_reproducible_from_the_cache(tmp_path) -> None:
    model = tmp_path / "candle.onnx"
    model.write_bytes(build("candle_uno", "tiny").SerializeToString())
    cache = tmp_path / "profiles.sqlite"
    args = ["plan", str(model), "--kind", "gpp", "--cluster", "local-cpu", "--mini-batch", "8"]
    args += ["--profile", "--cache", str(cache)]
    cold = run_cli(*args, "-o", str(tmp_path / "a.json"))
    assert cold.code == 0, cold.err
    assert "costs: measured on torch cpu" in cold.out
    assert " 0 cached" in cold.err and "66 operators (5 distinct)" in cold.err
    warm = run_cli(*args, "-o", str(tmp_path / "b.json"))
    assert warm.code == 0, warm.err
    assert ": 0 (operator, samples) measured" in warm.err
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    cost = json.loads((tmp_path / "a.json").read_text())["predicted"]["cost_model"]
    assert cost["kind"] == "measured" and cost["torch"] and "cpu" in cost["device"]
    assert cost["measured_operators"] == cost["operators"] == 66
    checked = run_cli("validate", str(tmp_path / "a.json"))
    assert checked.code == 0, checked.err
    # Without --profile the plan is the roofline's, as before.
    plain = run_cli(*args[:-3], "--json")
    assert plain.code == 0 and json.loads(plain.out)["predicted"]["cost_model"] == "roofline"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--profile", "--cache", "{file}/p.sqlite"], "is not a folder"),
        (["--cache", "{dir}/p.sqlite"], "give --profile too"),
        (["--profile", "--cache", "{dir}"], "is a directory"),
    ],
)
def test_bad_cache_options_exit_2_with_one_line(tmp_path, extra, message) -> None:
    model = tmp_path / "candle.onnx"
    model.write_bytes(build("candle_uno", "tiny").SerializeToString())
    (tmp_path / "file").write_text("x")
    extra = [e.format(file=tmp_path / "file", dir=tmp_path) for e in extra]
    result = run_cli(
        "plan", str(model), "--kind", "gpp", "--cluster", "local-cpu", "--mini-batch", "8", *extra
    )
    assert result.code == 2
    assert message in result.err and len(result.err.strip().splitlines()) == 1
