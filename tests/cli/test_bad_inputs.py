"""The bad-input corpus (tests/data/bad): each gives its documented exit code and one line, no traceback."""

from __future__ import annotations

import json
import os
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
    "opset99.onnx": "opset 99 of ai.onnx, but the installed onnx",
}

SPEC_CASES = {
    "not_yaml.yaml": "YAML",
    "spec_wrong_types.yaml": "device_types.gpu.memory",
    "spec_missing_fields.yaml": "device_types",
    "spec_zero_bandwidth.yaml": "memory_bandwidth",
    "spec_zero_memory.yaml": "device_types.gpu.memory",
    "spec_unknown_device_type.yaml": "tpu",
    "spec_duplicate_names.yaml": "gpu",
    "spec_alias_bomb_name.yaml": "expands to more than 1,000,000 values",
    "spec_alias_bomb_cores.yaml": "expands to more than 1,000,000 values",
    "spec_recursive_alias.yaml": "a value contains itself",
    "spec_deep_nesting.yaml": "nesting depth",
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
    "plan_duplicate_keys.json": "duplicate key 'kind'",
    "plan_deep_nesting.json": "nested too deeply",
    "plan_huge_integer.json": "an integer too long to read",
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
    assert_one_line_error(run_cli("inspect", str(missing)), missing, "no such ONNX model file")
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


def _output_commands(out: str) -> list[list[str]]:
    """Every command line that writes a file the user names, writing it to ``out``; the model
    they read does not exist, so only a check made before any work can report the output."""
    model = "no_such_model.onnx"
    gpp = ["plan", model, "--kind", "gpp", "--cluster", "graphpipe-v100", "--mini-batch", "8"]
    cp = ["plan", "--kind", "cp", "--llm", "gpt2", "--cluster", "h200", "--batch", "1", "--context", "1K"]
    return [
        [*gpp, "-o", out],
        [*gpp, "--gantt", out],
        ["inspect", model, "-o", out],
        ["inspect", model, "--write-named", out],
        ["place", model, "-o", out],
        ["zoo", "build", "mmt", "-o", out],
        [*cp, "--sweep-context", "1K,2K", "--plot", out],
    ]


def test_an_unwritable_output_fails_before_any_work(tmp_path):
    """``-o``, ``--gantt``, ``--plot``, ``--write-named`` under a regular file: exit 2 with one
    line naming the path, before the model is read (a long search would lose its result)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = blocker / "out.json"
    for args in _output_commands(str(out)):
        result = run_cli(*args)
        assert_one_line_error(result, out, f"{blocker} is not a directory")
    assert blocker.read_text() == "x"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_an_output_in_a_directory_that_refuses_files_fails_even_as_root():
    """Permission bits say nothing to root: ``/proc`` passes ``os.access`` but refuses new
    files; the check tries a file where the write would put one."""
    out = Path("/proc/tessera-plan.json")
    for args in _output_commands(str(out)):
        assert_one_line_error(run_cli(*args), out, "cannot write in /proc")


def test_outputs_that_would_replace_an_input_or_each_other(tmp_path):
    """``-o model.onnx`` replaced the model with the plan (exit 0); ``-o x --gantt x`` kept one."""
    from tessera.models import build

    model = tmp_path / "m.onnx"
    model.write_bytes(build("candle_uno", "tiny").SerializeToString())
    before = model.read_bytes()
    gpp = ["plan", str(model), "--kind", "gpp", "--cluster", "local-cpu-split", "--mini-batch", "8"]
    same = str(tmp_path / "same.svg")
    cases = [
        ([*gpp, "-o", str(model)], "-o", "model"),
        ([*gpp, "-o", same, "--gantt", same], "--gantt", "-o"),
        (["place", str(model), "--backends", "onnxruntime", "-o", str(model)], "-o", "model"),
        (["inspect", str(model), "--write-named", str(model)], "--write-named", "model"),
    ]
    for args, option, other in cases:
        result = run_cli(*args)
        lines = result.err.strip().splitlines()
        assert result.code == 2 and len(lines) == 1, (args, result.err)
        assert f"{option} " in lines[0] and f"is also the {other}" in lines[0]
    assert model.read_bytes() == before and not (tmp_path / "same.svg").exists()
    both = run_cli(*gpp, "-o", "/dev/null", "--gantt", "/dev/null")  # written into: no conflict
    assert both.code == 0, both.err
    llm = tmp_path / "llm.yaml"
    cp = ["plan", "--kind", "cp", "--llm", str(llm), "--cluster", "h200", "--batch", "1", "--context", "1K"]
    result = run_cli(*cp, "-o", str(llm))
    assert result.code == 2 and "-o " in result.err and "is also the LLM config" in result.err, result.err


@pytest.mark.parametrize(
    "make,fragment",
    [
        (lambda d: d / "plan.txt", "not a picture format"),  # --gantt only
        (lambda d: (d / "loop.svg").symlink_to(d / "loop.svg") or d / "loop.svg", "Symlink loop"),
        (lambda d: d / ("x" * 300 + ".svg"), "File name too long"),
        (lambda d: str(d) + "/", "names no file"),
    ],
)
def test_odd_output_paths_are_bad_input(tmp_path, make, fragment):
    out = str(make(tmp_path))
    args = [
        "plan",
        "no_such_model.onnx",
        "--kind",
        "gpp",
        "--cluster",
        "local-cpu-split",
        "--mini-batch",
        "8",
    ]
    result = run_cli(*args, "--gantt", out)
    lines = result.err.strip().splitlines()
    assert result.code == 2 and len(lines) == 1 and fragment in lines[0], result.err


def _edited(change):
    def edit(plan: dict) -> str:
        change(plan)
        return json.dumps(plan)

    return edit


HAND_EDITS = {
    "duplicate stage id": (_edited(lambda p: p["stages"][1].update(id=0)), "stage ids must be 0..1"),
    "edge to no stage": (_edited(lambda p: p["edges"][0].update(dst=99)), "edge 0->99 does not join"),
    "kind is a list": (_edited(lambda p: p.update(kind=[])), "kind [] is not a plan kind"),
    "mini-batch without its actions": (
        _edited(lambda p: p.update(mini_batch_size=16 * 10**12)),
        "stage 0: 4 actions for mini-batch 16000000000000",
    ),
    "no cluster": (
        _edited(lambda p: p.update(cluster=None)),
        "cluster: the plan records no cluster, so C3 and device memory cannot be checked",
    ),
    # Values a hand edit gets wrong: not coerced, refused.
    "micro-batch as a string": (
        _edited(lambda p: p["stages"][0].update(micro_batch_size="8")),
        "field stages.0.micro_batch_size: Input should be a valid integer",
    ),
    "schema version true": (_edited(lambda p: p.update(schema_version=True)), "schema_version True"),
    "action F00": (
        _edited(lambda p: p["stages"][0]["schedule"]["actions"].__setitem__(0, "F00")),
        "field stages.0.schedule.actions.0: String should match pattern",
    ),
    "a micro-batch that does not exist": (
        _edited(lambda p: p["stages"][0]["schedule"]["actions"].__setitem__(1, "F99999")),
        "F99999: there are 2 micro-batches (0..1)",
    ),
    "NaN prediction": (
        _edited(lambda p: p["predicted"].update(iteration_time_s=float("nan"))),
        "NaN is not a JSON value",
    ),
    "negative prediction": (
        _edited(lambda p: p["predicted"].update(iteration_time_s=-1.0)),
        "predicted.iteration_time_s is -1.0: predictions are finite and not negative",
    ),
    # Plans whose numbers are not their model's: validate counts again.
    "node count": (
        _edited(lambda p: p["model"].update(num_nodes=5)),
        "model.num_nodes is 5; the model has 81",
    ),
    "memory zeroed": (
        _edited(
            lambda p: p["stages"][0].update(
                memory={"weights": 0, "optimizer": 0, "activations": 0, "peak": 0}
            )
        ),
        "memory: stage 0 records 0 bytes; its operators need 117760 (11968 weights, 83776 gradients",
    ),
    "micro-batches a million times larger, memory unchanged": (
        _edited(
            lambda p: [
                p.update(mini_batch_size=16 * 10**6),
                *(st.update(micro_batch_size=8 * 10**6) for st in p["stages"]),
            ]
        ),
        "memory: stage 0: its operators need 22016095744 (",
    ),
    "a gpipe label on 1f1b passes": (
        _edited(lambda p: p["stages"][1]["schedule"].update(kind="gpipe")),
        "stage 1: its actions are not a gpipe schedule with 1 in flight",
    ),
    "k on a 1f1b schedule": (
        _edited(lambda p: p["stages"][0]["schedule"].update(k=7)),
        "stage 0: schedule k 7 is kFkB's; a 1f1b schedule has k 1",
    ),
    "an edge twice": (_edited(lambda p: p["edges"].append(p["edges"][0])), "edge 0->1 is listed twice"),
    "an edge with a tensor that does not cross": (
        _edited(lambda p: p["edges"][0]["tensors"][0].update(name="bogus")),
        "edge 0->1 names 'bogus', which does not flow from stage 0 to 1",
    ),
    "edge bytes not its tensors'": (
        _edited(lambda p: p["edges"][0].update(bytes=1)),
        "edge 0->1: bytes 1 is not the sum of its tensors' bytes",
    ),
    "nested too deep": (lambda p: "[" * 100_000 + "]" * 100_000, "not a plausible plan"),
    "a 5000-digit number": (lambda p: '{"schema_version": ' + "9" * 5000 + "}", "not a plausible plan"),
}


@pytest.mark.parametrize("edit", sorted(HAND_EDITS))
def test_hand_edited_plans_are_bad_input(tmp_path, edit):
    """Each crashed ``validate`` with exit 1 (KeyError, TypeError, RecursionError, ValueError,
    MemoryError) before the plan's schema said what is wrong."""
    change, fragment = HAND_EDITS[edit]
    path = tmp_path / "plan.json"
    path.write_text(change(json.loads((BAD / "plan_ok.json").read_text())))
    model = BAD / "plan_model.onnx"  # the copy's recorded model path is relative to BAD
    assert_one_line_error(run_cli("validate", str(path), "--model", str(model)), path, fragment)
