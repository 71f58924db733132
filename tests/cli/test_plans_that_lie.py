"""Plans edited to claim what their model or machine does not: validation re-derives the claim
(recognized decoder sizes, backend precision against the tolerance, backend devices) and refuses
it in one line naming the field, where each used to validate and launch."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_runner import run_cli

from tessera.models import build


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("lies")
    import onnx

    onnx.save(build("gpt", "tiny"), folder / "gpt.onnx")
    here = os.getcwd()
    os.chdir(folder)  # the plans record the model as the user named it: "gpt.onnx"
    try:
        placed = run_cli("place", "gpt.onnx", "--backends", "onnxruntime", "-o", "place.json")
        planned = run_cli("plan", "gpt.onnx", "--kind", "cp", "--cluster", "local-cpu", "--batch", "2",
                          "--context", "8", "--output-len", "4", "-o", "cp.json")  # fmt: skip
    finally:
        os.chdir(here)
    assert placed.code == 0 and planned.code == 0, placed.err + planned.err
    return {"placement": folder / "place.json", "cp": folder / "cp.json"}


def _group(backend: str) -> Callable[[dict[str, Any]], None]:
    return lambda p: p["groups"][0].update(backend=backend)


LIES: dict[str, tuple[str, Callable[[dict[str, Any]], None], str]] = {
    "int8 without a tolerance": (
        "placement",
        _group("onnxruntime-int8"),
        "backend 'onnxruntime-int8' computes in reduced precision, and the plan has no measured.tolerance",
    ),  # fmt: skip
    "bf16 without a tolerance": (
        "placement",
        _group("openvino-bf16"),
        "'openvino-bf16' computes in reduced precision",
    ),
    "tolerance 2": (
        "placement",
        lambda p: p["measured"].update(tolerance=2.0),
        "measured.tolerance is 2.0: a relative output error in (0, 1] or null",
    ),  # fmt: skip
    "tolerance text": (
        "placement",
        lambda p: p["measured"].update(tolerance="0.1"),
        "measured.tolerance is '0.1'",
    ),
    "cuda device on cpu groups": (
        "placement",
        lambda p: p.update(device="cuda"),
        "backend 'onnxruntime' runs on cpu",
    ),  # fmt: skip
    "64 layers of 8192": (
        "cp",
        lambda p: p["llm"].update(layers=64, hidden=8192),
        "llm.layers is 64 but the model has 2",
    ),  # fmt: skip
    "heads": ("cp", lambda p: p["llm"].update(heads=8, kv_heads=8), "llm.heads is 8 but the model has 4"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
@pytest.mark.parametrize("command", ["validate", "launch"])
def test_a_plan_that_lies_is_refused(plans: dict[str, Path], tmp_path: Path, lie: str, command: str) -> None:
    kind, edit, fragment = LIES[lie]
    plan = json.loads(plans[kind].read_text())
    edit(plan)
    plan["model"]["path"] = str(plans[kind].parent / plan["model"]["path"])
    edited = tmp_path / "plan.json"
    edited.write_text(json.dumps(plan))
    result = run_cli(command, str(edited))
    assert result.code == 2, (result.code, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and str(edited) in lines[0], lines


@pytest.mark.parametrize("kind", ["placement", "cp"])
def test_the_plans_as_written_validate(plans: dict[str, Path], kind: str) -> None:
    result = run_cli("validate", str(plans[kind]))
    assert result.code == 0 and "valid" in result.out, result.err


def test_a_same_named_model_in_the_working_directory_does_not_shadow_the_plans(
    plans: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan names ``gpt.onnx``; another ``gpt.onnx`` in the working directory was taken first
    and validate failed on its sha256. The model whose sha256 is the plan's is used."""
    import onnx

    onnx.save(build("gpt", "tiny", 7), tmp_path / "gpt.onnx")  # other weights: another sha256
    monkeypatch.chdir(tmp_path)
    for kind in ("placement", "cp"):
        result = run_cli("validate", str(plans[kind]))
        assert result.code == 0, result.err
        assert f"for {plans[kind].parent / 'gpt.onnx'}" in result.out, result.out
    (plans["cp"].parent / "gpt.onnx").rename(plans["cp"].parent / "moved.onnx")
    try:  # only the other one is left: the mismatch is reported
        result = run_cli("validate", str(plans["cp"]))
        assert result.code == 2 and "model changed: the plan was made for sha256" in result.err
    finally:
        (plans["cp"].parent / "moved.onnx").rename(plans["cp"].parent / "gpt.onnx")
