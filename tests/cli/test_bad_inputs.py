"""The bad-input corpus (tests/data/bad): each gives its documented exit code and one line, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_cli, run_tessera

from tessera.core.errors import InputError
from tessera.core.specs import load_cluster

BAD = Path(__file__).parents[1] / "data" / "bad"

ONNX_CASES = {
    "empty.onnx": "file is empty",
    "truncated.onnx": "not an ONNX model",
    "text.onnx": "not an ONNX model",
    "cycle.onnx": "cycle: 'first' -> 'second' -> 'first'",
    "dangling_input.onnx": "dangling input 'ghost'",
    "unknown_op.onnx": "op 'FooBar'",
    "custom_domain.onnx": "domain 'com.example'",
    "huge_dims.onnx": "not a plausible model",
    "negative_dim.onnx": "size -3",
    "zero_dim.onnx": "size 0",
}

SPEC_CASES = {
    "not_yaml.yaml": "YAML",
    "spec_wrong_types.yaml": "device_types.gpu.memory",
    "spec_missing_fields.yaml": "device_types",
    "spec_zero_bandwidth.yaml": "memory_bandwidth",
    "spec_zero_memory.yaml": "device_types.gpu.memory",
    "spec_unknown_device_type.yaml": "tpu",
    "spec_duplicate_names.yaml": "gpu",
}

PLAN_CASES = {
    "plan_not_json.json": "not JSON",
    "plan_wrong_schema_version.json": "schema_version 99",
    "plan_wrong_kind.json": "kind 'teleport'",
    "plan_missing_field.json": "field model",
    "plan_missing_model.json": "'no_such_model.onnx' the plan names does not exist",
    "plan_changed_model.json": "model changed",
    "plan_unknown_node.json": "unknown node 'ghost'",
    "plan_unknown_device.json": "C3: stage 1 names device 'node9/cpu:7', not in the cluster",
    "plan_breaks_c1.json": "is in both group/stage 0 and 1",
    "plan_breaks_c2.json": "C2: operators of stage 0 feed stage 1 but the plan has no edge 0->1",
    "plan_breaks_c3.json": "C3: device",
    "plan_breaks_c5.json": "C5:",
    "plan_breaks_c4.json": "C4: stage 0: B1 before F1",
}


def test_the_corpus_plans_are_broken_copies_of_a_valid_plan():
    result = run_cli("validate", str(BAD / "plan_ok.json"))
    assert result.code == 0, result.err


def assert_one_line_error(result, path: Path, fragment: str, code: int = 2) -> None:
    assert result.code == code, result.err
    assert result.out == ""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert str(path) in lines[0]
    assert fragment in lines[0]
    assert "Traceback" not in result.err


@pytest.mark.parametrize("name", sorted(ONNX_CASES))
def test_bad_models(name):
    path = BAD / name
    assert_one_line_error(run_cli("inspect", str(path)), path, ONNX_CASES[name])


@pytest.mark.parametrize("name", sorted(SPEC_CASES))
def test_bad_cluster_specs(name):
    path = BAD / name
    with pytest.raises(InputError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and SPEC_CASES[name] in message


@pytest.mark.parametrize("name", sorted(PLAN_CASES))
def test_bad_plans(name):
    path = BAD / name
    assert_one_line_error(run_cli("validate", str(path)), path, PLAN_CASES[name])


def test_missing_file_and_directory(tmp_path):
    missing = tmp_path / "nope.onnx"
    assert_one_line_error(run_cli("inspect", str(missing)), missing, "no such file")
    assert_one_line_error(run_cli("inspect", str(tmp_path)), tmp_path, "directory")


def test_usage_errors_exit_2_with_one_line():
    for args in (["inspect"], ["inspect", "--no-such-option", "x.onnx"], ["zoo", "build", "nope", "-o", "x"]):
        result = run_cli(*args)
        assert result.code == 2, (args, result.err)
        assert len(result.err.strip().splitlines()) == 1, result.err
        assert "Traceback" not in result.err


def test_real_process_reports_bad_model_with_exit_2():
    path = BAD / "cycle.onnx"
    assert_one_line_error(run_tessera("inspect", str(path)), path, "cycle")


@pytest.mark.parametrize("name", sorted(SPEC_CASES))
def test_bad_cluster_specs_through_the_cli(name):
    path = BAD / name
    result = run_cli(
        "plan", "--kind", "cp", "--llm", "llama-7b", "--cluster", str(path), "--batch", "1", "--context", "1K"
    )
    assert_one_line_error(result, path, SPEC_CASES[name])
