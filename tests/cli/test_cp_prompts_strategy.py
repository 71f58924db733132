"""``plan --kind cp --strategy/--degree`` and ``launch --prompts`` (issue #27): a chosen strategy
and degree are planned (or refused naming what the cluster offers), and given prompts are decoded
exactly, in order, or refused in one line naming the file and the fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from decode_reference import greedy_tokens

from tessera.models import build


@pytest.fixture
def gpt(tmp_path: Path) -> Path:
    path = tmp_path / "gpt.onnx"
    path.write_bytes(build("gpt", "tiny", seed=3, kv_heads=2, seq=64).SerializeToString())
    return path


def _plan(tmp_path: Path, gpt: Path, *extra: str, batch: int = 2) -> tuple[int, str, Path]:
    out = tmp_path / "plan.json"
    res = run_cli("plan", str(gpt), "--kind", "cp", "--cluster", "local-cpu-split", "--batch", str(batch),
                  "--context", "16", "--output-len", "4", "-o", str(out), *extra)  # fmt: skip
    return res.code, res.err, out


@pytest.mark.parametrize("strategy", ["cp", "tp", "dp"])
def test_a_chosen_strategy_and_degree_are_planned(tmp_path: Path, gpt: Path, strategy: str) -> None:
    code, err, out = _plan(tmp_path, gpt, "--strategy", strategy, "--degree", "2")
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert (plan["strategy"], plan["degree"]) == (strategy, 2)


def test_a_degree_the_cluster_does_not_offer_is_refused(tmp_path: Path, gpt: Path) -> None:
    code, err, out = _plan(tmp_path, gpt, "--degree", "3")
    assert code == 2 and "--degree 3: the cluster offers degrees 1, 2" in err and not out.exists()


def _prompts(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_given_prompts_are_decoded_in_order_as_the_reference(tmp_path: Path, gpt: Path) -> None:
    code, err, plan = _plan(tmp_path, gpt, "--strategy", "cp", "--degree", "2", batch=3)
    assert code == 0, err
    prompts = [[5, 17, 3, 99, 42], [1, 2], [64, 64, 64, 7, 7, 100, 12]]
    given = _prompts(tmp_path, "\n".join(" ".join(map(str, p)) for p in prompts) + "\n\n")
    res = run_cli(
        "launch", str(plan), "--model", str(gpt), "--prompts", str(given), "--new-tokens", "4", "--json"
    )
    assert res.code == 0, res.err
    assert json.loads(res.out)["tokens"] == greedy_tokens(gpt, prompts, 4)


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("1 2\n3 4\n5 6\n", "--prompts: 3 requests, more than the plan's batch of 2"),
        ("1 2\n3 x 4\n", "line 2: 'x' is not a token id"),
        ("1 2\n-3\n", "line 2: '-3' is not a token id"),
        ("\n \n", "no prompts"),
        ("1 2\n3 999\n", "request 2 has token id 999, outside the vocabulary 0..127"),
    ],
)
def test_bad_prompts_are_refused_in_one_line(tmp_path: Path, gpt: Path, text: str, fault: str) -> None:
    code, err, plan = _plan(tmp_path, gpt)
    assert code == 0, err
    res = run_cli("launch", str(plan), "--model", str(gpt), "--prompts", str(_prompts(tmp_path, text)))
    assert res.code == 2 and fault in res.err, res.err
    assert len(res.err.strip().splitlines()) == 1 and "Traceback" not in res.err


def test_prompts_and_prompt_lens_together_are_a_usage_error(tmp_path: Path, gpt: Path) -> None:
    code, err, plan = _plan(tmp_path, gpt)
    res = run_cli("launch", str(plan), "--model", str(gpt), "--prompts", str(_prompts(tmp_path, "1\n")),
                  "--prompt-lens", "3")  # fmt: skip
    assert res.code == 2 and "drop --prompt-lens" in res.err
