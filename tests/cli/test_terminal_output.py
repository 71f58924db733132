"""What reaches a terminal or a JSON reader from files: control characters in names a model holds
are escaped (no line split, no escape sequence), a file name that is not UTF-8 is written and read
back exactly, and a standard output on a full device is one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from cli_runner import run_cli
from onnx import TensorProto, helper

from tessera.core.errors import InputError, terminal_safe

EVIL = "evil\n\x1b[31mRED"


def _evil_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [EVIL, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [EVIL, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_terminal_safe_escapes_controls_and_undecodable_bytes():
    assert terminal_safe("a\nb\x1b[2J\x7f\x85 é \udcff") == "a\\nb\\x1b[2J\\x7f\\x85 é \\xff"
    line = InputError("bad\x1b[31m", source="/x/no\nsuch\udcff.onnx").one_line()
    assert line == "/x/no\\nsuch\\xff.onnx: bad\\x1b[31m"


@pytest.mark.parametrize("as_json", [False, True])
def test_a_dim_param_with_a_newline_and_an_escape_reaches_no_terminal_raw(tmp_path: Path, as_json: bool):
    model = _evil_model(tmp_path / "evil.onnx")
    proc = subprocess.run(
        [sys.executable, "-m", "tessera", "inspect", str(model), *(["--json"] if as_json else [])],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout + proc.stderr
    if as_json:  # JSON escapes it itself, and the reader gets the name back exactly
        assert f"x:0 ({EVIL})" in json.loads(proc.stdout)["defaulted_dims"]
    else:
        assert "evil\\n\\x1b[31mRED" in proc.stdout
        assert all("RED" not in line or "evil" in line for line in proc.stdout.splitlines())


def test_a_file_name_that_is_not_utf8_is_planned_and_read_back(tmp_path: Path):
    """It was UnicodeEncodeError (exit 1) after the whole search: the plan records the model's
    path, and no UTF-8 text holds a lone surrogate. JSON's escape does, and reads back the same."""
    model = _evil_model(tmp_path / "plain.onnx").rename(os.fsdecode(bytes(tmp_path / "m") + b"\xff.onnx"))
    plan = os.fsdecode(bytes(tmp_path / "p") + b"\xff.json")
    result = run_cli("place", str(model), "--backends", "onnxruntime", "--input-shape", "x=2x4", "-o", plan)
    assert result.code == 0, result.err
    text = Path(plan).read_bytes().decode("utf-8")  # valid UTF-8
    assert "m\\udcff.onnx" in text
    validated = run_cli("validate", plan)
    assert validated.code == 0 and "valid placement plan" in validated.out, validated.err


def test_standard_output_on_a_full_device_is_one_line_exit_2(tmp_path: Path):
    model = _evil_model(tmp_path / "m.onnx")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "tessera", "inspect", str(model), "--json"],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == "tessera: error: cannot write the output: No space left on device"


def test_every_environment_variable_read_is_documented_in_help_and_readme() -> None:
    """Each TESSERA_ variable the package reads is in ``tessera --help`` and the README, or is one
    that launch sets for its own workers."""
    import re

    from tessera.cli.main import ENVIRONMENT, INTERNAL_ENVIRONMENT

    root = Path(__file__).parents[2]
    read = set()
    for path in (root / "tessera").rglob("*.py"):
        read |= set(re.findall(r'"(TESSERA_[A-Z_]+)"', path.read_text()))
    assert read == set(ENVIRONMENT) | set(INTERNAL_ENVIRONMENT)
    shown = run_cli("--help").out
    readme = (root / "README.md").read_text()
    for name in ENVIRONMENT:
        assert name in shown and f"| `{name}` |" in readme, name
