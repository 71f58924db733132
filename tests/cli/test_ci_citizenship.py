"""tessera as a CI citizen: --json stdout is JSON and nothing else, plans are byte-identical for the
same inputs, and plans and specs are data (safe YAML, no pickle, no eval anywhere in the package)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_runner import run_cli

import tessera

CP_PLAN = ["plan", "--kind", "cp", "--llm", "gpt2", "--cluster", "h200", "--batch", "4", "--context"]
"""A cache-parallel plan of GPT-2 on the H200 preset; the context follows."""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    paths = {"mmt": folder / "mmt.onnx", "dlrm_paper": folder / "dlrm.onnx"}
    assert run_cli("zoo", "build", "mmt", "-o", str(paths["mmt"])).code == 0
    assert run_cli("zoo", "build", "dlrm", "--size", "paper", "-o", str(paths["dlrm_paper"])).code == 0
    return paths


def json_commands(models: dict[str, Path], tmp: Path) -> list[list[str]]:
    gpp = [
        "plan",
        str(models["dlrm_paper"]),
        "--kind",
        "gpp",
        "--cluster",
        "graphpipe-v100",
        "--mini-batch",
        "256",
    ]
    return [
        ["inspect", str(models["mmt"]), "--json"],
        ["zoo", "list", "--json"],
        ["zoo", "build", "gpt", "-o", str(tmp / "gpt.onnx"), "--json"],
        [*gpp, "--json", "-o", str(tmp / "gpp.json")],
        ["validate", str(tmp / "gpp.json"), "--json"],
        [*CP_PLAN, "4K", "--json"],
        ["backends", "--json"],
    ]


def test_json_stdout_is_one_json_document(models, tmp_path):
    for args in json_commands(models, tmp_path):
        result = run_cli(*args)
        assert result.code == 0, (args, result.err)
        json.loads(result.out)  # the whole stdout, nothing else
        assert "\x1b[" not in result.out + result.err, args  # no colour when not a terminal


def test_same_inputs_give_byte_identical_plans(models, tmp_path):
    def plans(tag: str) -> list[bytes]:
        gpp, cp = tmp_path / f"gpp-{tag}.json", tmp_path / f"cp-{tag}.json"
        cmd_gpp = ["plan", str(models["dlrm_paper"]), "--kind", "gpp", "--cluster", "graphpipe-v100"]
        assert run_cli(*cmd_gpp, "--mini-batch", "512", "-o", str(gpp)).code == 0
        cmd_cp = ["plan", "--kind", "cp", "--llm", "llama-7b", "--cluster", "a5000-4x", "--batch", "32"]
        assert run_cli(*cmd_cp, "--context", "32K", "--layers", "1", "-o", str(cp)).code == 0
        return [gpp.read_bytes(), cp.read_bytes()]

    assert plans("a") == plans("b")


def test_plans_and_specs_are_data_never_code():
    """No pickle, no eval/exec, YAML only through safe loaders, anywhere in the package."""
    forbidden = re.compile(
        r"\bimport pickle\b|\bpickle\.|\bmarshal\.|\beval\(|\bexec\(|yaml\.(unsafe_)?load\((?![^)]*Loader=)"
    )
    unsafe_loaders = re.compile(r"yaml\.(Full|Unsafe)?Loader\b(?!.*SafeLoader)|FullLoader|UnsafeLoader")
    offenders = []
    for path in Path(tessera.__file__).parent.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if forbidden.search(code) or unsafe_loaders.search(code):
                offenders.append(f"{path}:{number}: {line.strip()}")
    assert offenders == []
    # The YAML loader in use constructs only plain data: PyYAML's safe constructor (over libyaml's
    # parser where it is built in), and it refuses a Python tag.
    import yaml

    from tessera.core.config_files import UniqueKeyLoader

    assert issubclass(UniqueKeyLoader, yaml.constructor.SafeConstructor)
    assert not issubclass(UniqueKeyLoader, yaml.constructor.FullConstructor)
    with pytest.raises(yaml.constructor.ConstructorError):
        yaml.load("!!python/object/apply:os.system ['true']", Loader=UniqueKeyLoader)  # noqa: S506


@pytest.mark.parametrize("table", ["inspect", "cp"])
def test_a_reader_that_goes_away_is_not_a_failure(models, table):
    """``tessera inspect m.onnx | head -1`` under ``set -o pipefail``: rich's console exited 1 on
    the broken pipe; now it is exit 0 and nothing on stderr, as for plain output."""
    import os
    import subprocess
    import sys

    args = {
        "inspect": ["inspect", str(models["mmt"])],
        "cp": [*CP_PLAN, "1K"],
    }[table]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte
    with os.fdopen(write, "wb") as stdout:
        proc = subprocess.run(
            [sys.executable, "-m", "tessera", *args],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("command", [[], ["zoo"]])
def test_a_bare_command_group_prints_its_help(command):
    """``tessera`` alone used to print its whole help squeezed into one ``error:`` line. Now it is
    the help as ``--help`` lays it out (on stderr, nothing on stdout) with the usage exit code 2."""
    res = run_cli(*command)
    shown = run_cli(*command, "--help")
    assert res.code == 2 and res.out == "" and "error" not in res.err
    assert res.err.strip() == shown.out.strip()
    assert len(res.err.splitlines()) > 5
