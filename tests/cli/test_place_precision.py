"""Precision as a placement dimension (issue #30): ``place --tolerance REL`` lets reduced-precision
backends (``openvino-bf16``) run groups while the placed model's error against the fp32 onnxruntime
reference stays within REL; without it placement is exact fp32 as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_cli

from tessera.backends.composite import relative_error, verify_outputs
from tessera.backends.registry import default_registry
from tessera.core.plans import load_plan

BF16, WHY = default_registry().entry("openvino-bf16").available()
needs_bf16 = pytest.mark.skipif(not BF16, reason=f"openvino-bf16 unavailable: {WHY}")
BACKENDS = "onnxruntime,openvino,openvino-bf16"


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> Path:
    """A small model of MatMuls (the test MLP of test_place): bf16 speeds its MatMuls up."""
    from cli.test_place import mlp

    path = tmp_path_factory.mktemp("precision") / "mlp.onnx"
    path.write_bytes(mlp().model.SerializeToString())
    return path


def test_relative_error_is_against_each_outputs_scale() -> None:
    want = {"a": np.array([1.0, -4.0]), "b": np.array([0.001, 0.002])}
    got = {"a": np.array([1.2, -4.0]), "b": np.array([0.001, 0.0021])}
    assert relative_error(got, want) == pytest.approx(0.05)  # a: 0.2 / 4; b: 0.0001 / 0.002
    assert verify_outputs(got, want, 0.06)["ok"] and not verify_outputs(got, want, 0.04)["ok"]
    assert not verify_outputs(got, want, None)["ok"]  # fp32 exact by default


@pytest.mark.parametrize("backend", [pytest.param("openvino-bf16", marks=needs_bf16), "onnxruntime-int8"])
def test_a_reduced_precision_backend_needs_a_tolerance(mlp: Path, tmp_path: Path, backend: str) -> None:
    result = run_cli("place", str(mlp), "--backends", backend, "--cache", str(tmp_path / "c.sqlite"))
    assert result.code == 2 and "computes in reduced precision: give --tolerance" in result.err


@pytest.mark.slow
@needs_bf16
def test_under_a_tolerance_bf16_runs_within_it_and_launch_reports_the_error(
    mlp: Path, tmp_path: Path
) -> None:
    out = tmp_path / "placed.json"
    placed = run_cli("place", str(mlp), "--backends", BACKENDS, "--tolerance", "0.25",
                     "--cache", str(tmp_path / "c.sqlite"), "-o", str(out), "--verify", "--json")  # fmt: skip
    assert placed.code == 0, placed.err  # whichever runs fastest, within the budget
    measured = load_plan(out).measured
    assert measured["tolerance"] == 0.25 and measured["error"]["max_rel"] <= 0.25
    assert "openvino-bf16" in measured["compared_with"]
    assert measured["best_fp32_single_backend"] in ("onnxruntime", "openvino")
    # bf16 alone: its error is real (about 10% on this softmax of random MatMuls) and within the budget
    placed = run_cli("place", str(mlp), "--backends", "openvino-bf16", "--tolerance", "0.25",
                     "--cache", str(tmp_path / "c.sqlite"), "-o", str(out), "--verify")  # fmt: skip
    assert placed.code == 0, placed.err
    plan = load_plan(out)
    assert {g.backend for g in plan.groups} == {"openvino-bf16"}
    assert 1e-5 < plan.measured["error"]["max_rel"] <= 0.25
    launched = run_cli("launch", str(out), "--repeat", "2", "--json")
    assert launched.code == 0, launched.err
    report = json.loads(launched.out)
    assert report["verify"]["ok"] and report["verify"]["relative_error"] <= 0.25


@pytest.mark.slow
@needs_bf16
def test_a_budget_bf16_cannot_meet_keeps_every_group_exact(mlp: Path, tmp_path: Path) -> None:
    out = tmp_path / "tight.json"
    placed = run_cli("place", str(mlp), "--backends", BACKENDS, "--tolerance", "1e-7",
                     "--cache", str(tmp_path / "c.sqlite"), "-o", str(out))  # fmt: skip
    assert placed.code == 0, placed.err
    plan = load_plan(out)
    assert all(g.backend != "openvino-bf16" for g in plan.groups)
    assert plan.measured["error"]["max_rel"] < 1e-3


def test_outputs_are_checked_on_the_data_file_given(mlp: Path, tmp_path: Path) -> None:
    from tessera.core.graph import load_graph
    from tessera.planners.placement.reference import reference_run

    graph = load_graph(str(mlp))
    rng = np.random.default_rng(7)
    arrays = {n: (100 * rng.standard_normal(i.shape)).astype(i.dtype) for n, i in graph.inputs.items()}
    data = tmp_path / "calibration.npz"
    np.savez(data, **arrays)
    feeds, reference = reference_run(graph, 0, str(data))
    for name, array in arrays.items():
        np.testing.assert_array_equal(feeds[name], array)
    assert reference.keys() == set(graph.outputs)
    out = tmp_path / "placed.json"
    placed = run_cli("place", str(mlp), "--backends", "onnxruntime", "--data", str(data),
                     "--cache", str(tmp_path / "c.sqlite"), "-o", str(out), "--verify")  # fmt: skip
    assert placed.code == 0, placed.err
    assert load_plan(out).measured["inputs"].startswith("calibration.npz (sha256 ")
    np.savez(data, wrong=np.zeros(3))
    refused = run_cli("place", str(mlp), "--data", str(data), "--cache", str(tmp_path / "c.sqlite"))
    assert refused.code == 2 and str(data) in refused.err and "no array for model input" in refused.err


@pytest.mark.slow
def test_int8_groups_are_quantized_on_the_calibration_inputs_and_launch_checks_them(
    mlp: Path, tmp_path: Path
) -> None:
    from backends.test_onnxruntime_int8 import cnn

    model = tmp_path / "cnn.onnx"
    model.write_bytes(cnn().model.SerializeToString())
    out = tmp_path / "int8.json"
    placed = run_cli("place", str(model), "--backends", "onnxruntime-int8", "--tolerance", "0.25",
                     "--cache", str(tmp_path / "c.sqlite"), "-o", str(out), "--verify")  # fmt: skip
    assert placed.code == 0, placed.err
    plan = load_plan(out)
    # int8 runs the model (ONNX Runtime's fp32 may keep a group it measured faster: a timing, which
    # a loaded machine once tipped)
    assert "onnxruntime-int8" in {g.backend for g in plan.groups}
    error = plan.measured["error"]["max_rel"]
    assert 1e-4 < error <= 0.25  # int8 really ran: fp32 would be ~1e-7
    launched = run_cli("launch", str(out), "--repeat", "2", "--json")
    assert launched.code == 0, launched.err
    report = json.loads(launched.out)
    # launch quantizes on the same (seeded) inputs: the same model, the same error
    assert report["verify"]["ok"] and report["verify"]["relative_error"] == pytest.approx(error, rel=1e-6)
    tight = run_cli("place", str(model), "--backends", "onnxruntime,onnxruntime-int8", "--tolerance", "1e-6",
                    "--cache", str(tmp_path / "c.sqlite"), "-o", str(out))  # fmt: skip
    assert tight.code == 0, tight.err
    assert all(g.backend == "onnxruntime" for g in load_plan(out).groups)
    # the MLP's softmax of large random logits is beyond int8 at 0.25: refused, not written wrong
    refused = run_cli("place", str(mlp), "--backends", "onnxruntime-int8", "--tolerance", "0.25",
                      "--cache", str(tmp_path / "c.sqlite"), "-o", str(tmp_path / "no.json"))  # fmt: skip
    assert refused.code == 2 and "stays within --tolerance 0.25" in refused.err and str(mlp) in refused.err
    assert not (tmp_path / "no.json").exists()
