"""``tessera plan``: options that used to be accepted and then ignored or contradicted are usage
errors (exit 2), and a cp plan of an ONNX decoder fits the model's position table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli

from tessera.core.graph import load_graph
from tessera.models import build
from tessera.planners.cp.recognize import position_limit

CP = ["--kind", "cp", "--cluster", "local-cpu-split", "--batch", "2"]


@pytest.fixture
def gpt(write_model, zoo) -> Path:
    return write_model(zoo("gpt"), "gpt.onnx")  # 16 positions


def test_a_context_beyond_the_models_positions_is_refused(gpt: Path) -> None:
    res = run_cli("plan", str(gpt), *CP, "--context", "64", "-o", str(gpt.with_name("cp.json")))
    assert res.code == 2 and not gpt.with_name("cp.json").exists()
    assert res.err.startswith(f"tessera: error: {gpt}: ") and "model holds 16 positions" in res.err
    # context 8 and 9 generated tokens: 8 + 9 - 1 = 16 positions (the last token is not fed back)
    res = run_cli("plan", str(gpt), *CP, "--context", "8", "--output-len", "9", "--json")
    assert res.code == 0, res.err
    assert json.loads(res.out)["workload"]["context"] == 8
    res = run_cli("plan", str(gpt), *CP, "--context", "8", "--output-len", "10", "--json")
    assert res.code == 2 and "needs 17 positions" in res.err
    res = run_cli("plan", str(gpt), *CP, "--context", "4", "--sweep-context", "4,64", "--output-len", "2")
    assert res.code == 2 and "context 64" in res.err


def test_position_limit_reads_the_position_table() -> None:
    assert position_limit(load_graph(build("gpt", "tiny", seed=0, seq=96)), 32) == 96
    assert position_limit(load_graph(build("gpt", "paper", seed=0)), 768) == 1024


def test_k_help_shows_no_default_that_is_an_error() -> None:
    res = run_cli("plan", "--help")
    assert res.code == 0
    text = " ".join(res.out.split())
    assert "k of kFkB (--schedule kfkb only; default 2)" in text
    assert "k of kFkB. [default: 2]" not in text


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--kind", "spp", "--mini-batch", "8", "--no-baseline"], "--no-baseline"),
        (["--kind", "cp", "--llm", "gpt2", "--batch", "1", "--context", "1K", "--input-shape", "x=1"], "--input-shape"),
        (["--kind", "cp", "--llm", "gpt2", "--batch", "1", "--context", "1K", "--sweep-context", ""], "--sweep-context"),
        (["--kind", "cp", "--llm", "gpt2", "--batch", "1", "--sweep-context", " , "], "--sweep-context"),
    ],
    ids=["no-baseline-spp", "input-shape-llm", "empty-sweep", "blank-sweep"],
)  # fmt: skip
def test_options_that_would_be_ignored_are_usage_errors(tmp_path: Path, args: list[str], flag: str) -> None:
    model = tmp_path / "mmt.onnx"
    model.write_bytes(build("mmt", "tiny", seed=0).SerializeToString())
    source = [str(model)] if "--mini-batch" in args else []
    res = run_cli("plan", *source, "--cluster", "local-cpu-split", *args)
    assert res.code == 2, res.err
    assert flag in res.err and "Traceback" not in res.err and len(res.err.strip().splitlines()) == 1


def test_a_request_longer_than_launch_can_decode_is_refused() -> None:
    # plan wrote it (context 1024M, outputs of 2 tokens: 1024M + 1 positions); launch then refused.
    result = run_cli("plan", "--kind", "cp", "--llm", "gpt2", "--cluster", "h200", "--batch", "1",
                     "--context", "1024M", "--output-len", "2")  # fmt: skip
    assert result.code == 2
    assert "needs 1073741825 positions; a request may hold at most 1073741824 (1024M)" in result.err
