"""``tessera plan --kind cp`` end to end: plans, determinism, sweep and plot, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.cli.main import main
from tessera.models import build

THESIS = [
    "plan",
    "--kind",
    "cp",
    "--llm",
    "llama-7b",
    "--cluster",
    "a5000-4x",
    "--batch",
    "32",
    "--layers",
    "1",
]


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_llm_preset_plan_is_byte_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    code, out, _ = run([*THESIS, "--context", "100K", "-o", str(a)], capsys)
    assert code == 0 and "CP *" in out and "all_gather" in out
    assert run([*THESIS, "--context", "100K", "-o", str(b)], capsys)[0] == 0
    assert a.read_bytes() == b.read_bytes()
    code, out, _ = run([*THESIS, "--context", "100K", "--json"], capsys)
    assert code == 0 and out.encode() == a.read_bytes()
    plan = json.loads(out)
    assert plan["kind"] == "cp" and plan["strategy"] == "cp" and plan["degree"] == 4
    assert plan["model"] is None and plan["llm_config"]["path"] == "llama-7b"


def test_onnx_model_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gpt.onnx"
    path.write_bytes(build("gpt", "tiny", seed=0).SerializeToString())
    code, out, err = run(["plan", str(path), "--kind", "cp", "--cluster", "a5000-4x", "--batch", "8",
                          "--context", "4K", "--output-len", "128", "--json"], capsys)  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    assert plan["model"]["path"] == str(path) and plan["llm_config"] is None
    assert plan["llm"]["layers"] == 2 and plan["llm"]["source"]["kind"] == "onnx"
    assert plan["workload"]["output_len"]["spec"] == "128"


def test_sweep_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "sweep.svg"
    code, out, err = run([*THESIS, "--sweep-context", "1K,10K,100K,1M", "--plot", str(svg)], capsys)
    assert code == 0, err
    assert "context sweep" in out and "TP" in out and "CP" in out and "DP" in out
    first = svg.read_bytes()
    assert first.startswith(b"<?xml") and b"<svg" in first
    assert run([*THESIS, "--sweep-context", "1K,10K,100K,1M", "--plot", str(svg)], capsys)[0] == 0
    assert svg.read_bytes() == first
    code, out, _ = run([*THESIS, "--sweep-context", "1K,100K", "--json"], capsys)
    data = json.loads(out)
    assert data["plan"] is None
    assert [row["winner"] for row in data["sweep"]] == ["tp", "cp"]


def test_not_a_decoder_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bert.onnx"
    path.write_bytes(build("bert", "tiny", seed=0).SerializeToString())
    code, _, err = run(["plan", str(path), "--kind", "cp", "--cluster", "h200", "--batch", "4",
                        "--context", "1K"], capsys)  # fmt: skip
    assert code == 2 and "no causal self-attention found" in err


def test_infeasible_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*THESIS[:-2], "--context", "1M"], capsys)
    assert code == 3 and "needs at least" in err and "GiB per device" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--context", "1K", "--output-len", "normal:3"], "--output-len"),
        (["--context", "lots"], "--context"),
        (["--context", "1K", "--layers", "40"], "--layers"),
        ([], "--context"),
        (["--context", "1K", "--plot", "x.svg"], "--sweep-context"),
    ],
)
def test_bad_input_exits_2(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([*THESIS[:-2], *extra], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_model_and_llm_are_exclusive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        ["plan", "--kind", "cp", "--cluster", "h200", "--batch", "1", "--context", "1K"], capsys
    )
    assert code == 2 and "MODEL" in err
    bad = tmp_path / "m.yaml"
    bad.write_text("name: m\nlayers: two\n")
    code, _, err = run(["plan", "--kind", "cp", "--llm", str(bad), "--cluster", "h200", "--batch", "1",
                        "--context", "1K"], capsys)  # fmt: skip
    assert code == 2 and str(bad) in err and "layers" in err
