"""Absurd option values (empty, huge, inf, nan) are bad input: exit 2, one line naming the option.

None of these start workers or run a search: the values are refused before any work.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_runner import run_cli

from tessera.cli.render import emit_json

BAD = Path(__file__).parents[1] / "data" / "bad"
CP = ["plan", "--kind", "cp", "--llm", "gpt2", "--cluster", "a5000-4x"]


def assert_bad_option(result, option: str, fragment: str = "") -> None:
    assert result.code == 2, (result.code, result.err)
    assert result.out == ""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert option in lines[0] and fragment in lines[0], lines[0]
    assert "Traceback" not in result.err and "internal error" not in result.err


def test_cp_empty_context_is_bad_input():
    assert_bad_option(run_cli(*CP, "--batch", "4", "--context", ""), "--context")


@pytest.mark.parametrize(
    "value",
    [
        "uniform:1-99999999999999",  # was MemoryError (an array of every length)
        "99999999999999999999",  # was OverflowError (int64)
        "9" * 5000,  # a float overflow, and too long to quote in full
        "uniform:1-2048M",
    ],
)
def test_cp_output_len_out_of_range(value: str):
    assert_bad_option(run_cli(*CP, "--batch", "4", "--context", "4K", "--output-len", value),
                      "--output-len", "1..1073741824")  # fmt: skip


@pytest.mark.parametrize("line", ["12345678901234567890123", "1" + "0" * 5000, "²"])
def test_cp_output_len_file_out_of_range(tmp_path: Path, line: str):
    path = tmp_path / "lengths.txt"
    path.write_text(f"10\n{line}\n", encoding="utf-8")
    result = run_cli(*CP, "--batch", "4", "--context", "4K", "--output-len", f"file:{path}")
    assert_bad_option(result, "--output-len", "line 2")
    assert str(path) in result.err and len(result.err) < 300


def test_cp_huge_uniform_output_len_is_fast():
    """uniform:1-500000000 took 42 s and 8 GB for a mean; the closed form is instant (exit 3: no fit)."""
    result = run_cli(*CP, "--batch", "4", "--context", "4K", "--output-len", "uniform:1-500000000")
    assert result.code == 3 and "no strategy fits" in result.err


@pytest.mark.parametrize("value", ["100000000", "99999999999", "99999999999999999999999", "65537"])
def test_cp_batch_out_of_range(value: str):
    assert_bad_option(run_cli(*CP, "--batch", value, "--context", "4K"), "--batch", "1..65536")


@pytest.mark.parametrize("value", ["inf", "nan", "1e308", "-inf", "0", "86401"])
def test_launch_timeout_must_be_finite_and_bounded(value: str):
    result = run_cli("launch", str(BAD / "plan_ok.json"), "--timeout", value)
    assert_bad_option(result, "--timeout", "at most 86400")


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "-inf"])
def test_launch_lr_must_be_finite_and_positive(value: str):
    result = run_cli("launch", str(BAD / "plan_ok.json"), "--lr", value, "--json")
    assert_bad_option(result, "--lr", "finite number greater than 0")


def test_emit_json_writes_non_finite_numbers_as_null(capsys: pytest.CaptureFixture[str]):
    emit_json({"loss": math.nan, "steps": [{"loss": math.inf}, {"loss": 0.5}], "ratio": (-math.inf, 2)})
    out = capsys.readouterr().out

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in --json output")

    assert json.loads(out, parse_constant=refuse) == {
        "loss": None,
        "steps": [{"loss": None}, {"loss": 0.5}],
        "ratio": [None, 2],
    }


@pytest.mark.parametrize(
    "shape", ["modality0=99999999999999999999999x16x32", "modality0=1048576x1048576x2", "x=" + "9" * 30]
)
def test_inspect_input_shape_too_large(shape: str):
    result = run_cli("inspect", str(BAD / "plan_model.onnx"), "--input-shape", shape)
    assert_bad_option(result, "--input-shape", "not a plausible input")


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--tolerance", "nan"),
        ("--tolerance", "inf"),
        ("--tolerance", "2"),
        ("--budget", "nan"),
        ("--budget", "inf"),
    ],
)
def test_place_float_options_refuse_nan_and_infinity(option: str, value: str):
    """click's FloatRange let NaN through (every comparison with it is false): ``place --tolerance
    nan`` and ``--budget nan|inf`` ran. One option type refuses them for every float option."""
    result = run_cli("place", str(BAD / "missing-model.onnx"), option, value)
    assert_bad_option(result, option, "expected a finite number greater than 0")
