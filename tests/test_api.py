"""The Python API: the contract (``__all__``) is the one docs/api.md documents, each function
returns what its command prints with ``--json``, and errors carry the command's exit code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_runner import run_cli

import tessera
from tessera import api
from tessera.core.plans import GppPlan, dump_plan, load_plan, write_plan

DOCS = Path(__file__).parents[1] / "docs" / "api.md"


def test_the_contract_is_what_the_docs_document() -> None:
    documented = set(re.findall(r"^\| `(\w+)` \|", DOCS.read_text(), flags=re.MULTILINE))
    assert documented == set(api.__all__)
    assert set(tessera.__all__) == {"__version__", *api.__all__}
    for name in api.__all__:
        assert getattr(tessera, name) is getattr(api, name)
    with pytest.raises(AttributeError):
        tessera.no_such_function  # noqa: B018


@pytest.fixture(scope="module")
def mmt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("zoo") / "mmt.onnx"
    assert run_cli("zoo", "build", "mmt", "--size", "tiny", "-o", str(path)).code == 0
    return path


def test_inspect_is_the_commands_json(mmt: Path) -> None:
    cli = run_cli("inspect", str(mmt), "--json")
    assert cli.code == 0
    assert api.inspect(str(mmt)).to_json() == json.loads(cli.out)


def test_a_plan_is_the_commands_plan_and_validates(mmt: Path, tmp_path: Path) -> None:
    args = ["--cluster", "local-cpu-split", "--mini-batch", "8", "--memory-limit", "1.2MiB"]
    cli = run_cli("plan", str(mmt), *args, "--json")
    assert cli.code == 0
    plan = tessera.plan(str(mmt), cluster="local-cpu-split", mini_batch=8, memory_limit="1.2MiB")
    assert isinstance(plan, GppPlan) and dump_plan(plan) == cli.out
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    checked = tessera.validate(path)
    assert checked.to_json() == json.loads(run_cli("validate", str(path), "--json").out)
    assert checked.model == str(mmt) and checked.sha256 == load_plan(str(path)).model.sha256


def test_a_decoding_plan_from_an_llm_config() -> None:
    plan = tessera.plan(kind="cp", llm="gpt2", cluster="a5000-4x", batch=4, context=1024)
    cli = run_cli("plan", "--kind", "cp", "--llm", "gpt2", "--cluster", "a5000-4x", "--batch", "4",
                  "--context", "1K", "--json")  # fmt: skip
    assert dump_plan(plan) == cli.out


def test_errors_carry_the_commands_exit_code(mmt: Path, tmp_path: Path) -> None:
    with pytest.raises(tessera.InputError) as bad:
        tessera.inspect(str(tmp_path / "missing.onnx"))
    assert bad.value.exit_code == 2 and "missing.onnx" in str(bad.value)
    with pytest.raises(tessera.InfeasibleError) as tight:
        tessera.plan(str(mmt), cluster="local-cpu-split", mini_batch=8, memory_limit="1KiB")
    assert tight.value.exit_code == 3
    with pytest.raises(tessera.InputError):
        tessera.plan(str(mmt), cluster="local-cpu-split")  # no mini-batch
    bad_plan = tmp_path / "bad.json"
    bad_plan.write_text("{}")
    with pytest.raises(tessera.InputError) as invalid:
        tessera.validate(bad_plan)
    assert invalid.value.exit_code == 2


@pytest.mark.slow
def test_the_five_line_script_trains_and_places(mmt: Path, tmp_path: Path) -> None:
    plan = tessera.plan(str(mmt), cluster="local-cpu-split", mini_batch=8, memory_limit="1.2MiB")
    run = tessera.launch(plan, steps=2, training={"optimizer": "adamw"}, trace=str(tmp_path / "t.json"))
    report = run.to_json()
    assert (
        report["kind"] == "gpp" and len(report["steps"]) == 2 and report["measured"]["iteration_time_s"] > 0
    )
    assert "AdamW" in report["training"]["optimizer"] and (tmp_path / "t.json").is_file()
    placed = tessera.place(str(mmt), backends=["onnxruntime"], cache=tmp_path / "p.sqlite", verify=True)
    assert placed.verified is not None and placed.verified["ok"]
    assert placed.to_json()["plan"]["kind"] == "placement"
