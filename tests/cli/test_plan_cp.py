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
    # Positions for the 4K context and 128 generated tokens (tiny gpt's table has 16: refused).
    path.write_bytes(build("gpt", "tiny", seed=0, seq=4224).SerializeToString())
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


def test_a_plan_for_the_compiled_step_predicts_it_and_says_where_it_cannot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gpt.onnx"
    path.write_bytes(build("gpt", "tiny", seed=0, seq=256).SerializeToString())
    args = ["plan", str(path), "--kind", "cp", "--cluster", "local-cpu-split", "--batch", "1", "--context", "128",
            "--output-len", "32", "--strategy", "dp", "--degree", "1", "--json"]  # fmt: skip
    code, out, err = run(args, capsys)
    assert code == 0 and "warning" not in err, err
    traced = json.loads(out)["predicted"]
    code, out, err = run([*args, "--compile"], capsys)
    assert code == 0 and "warning" not in err, err
    compiled = json.loads(out)["predicted"]
    assert "compiled" not in traced["cost_model"] and compiled["cost_model"]["compiled"] is True
    operations = traced["cost_model"]["step_operations"]
    saved = operations * (2.9e-6 - 1.9e-6)  # local-cpu-split's traced and compiled cost per operation
    assert traced["breakdown"]["host_s"] - compiled["breakdown"]["host_s"] == pytest.approx(saved, rel=1e-3)
    # A cluster that has measured no compiled step: said, and charged the traced step's cost.
    code, out, err = run([*args[:5], "a5000-4x", *args[6:], "--compile"], capsys)
    assert code == 0 and "warning: cluster a5000-4x: no decode_compiled_op_overhead" in err
    assert json.loads(out)["predicted"]["cost_model"]["compiled"] is True


def test_a_profiled_plan_charges_the_models_own_step_and_a_warm_rerun_is_byte_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--profile``: the model's decode step is timed here (traced, and compiled with --compile);
    each operation is charged what it measured (its step less the modeled compute, over its
    operations) in place of the cluster's decode_op_overhead, so the one-rank plan predicts the
    step measured; cached, a second run writes the same bytes."""
    import sqlite3

    path, cache = tmp_path / "gpt.onnx", tmp_path / "p.sqlite"
    path.write_bytes(build("gpt", "tiny", seed=0, seq=256).SerializeToString())
    args = ["plan", str(path), "--kind", "cp", "--cluster", "local-cpu-split", "--batch", "1", "--context", "128",
            "--output-len", "32", "--strategy", "dp", "--degree", "1", "--profile", "--cache", str(cache)]  # fmt: skip
    code, _, err = run([*args, "--compile", "-o", str(tmp_path / "a.json")], capsys)
    assert code == 0 and "warning" not in err, err
    plan = json.loads((tmp_path / "a.json").read_text())["predicted"]
    traced_op, compiled_op = plan["cost_model"]["measured_op_overhead"]
    assert 0 < compiled_op and 0 < traced_op
    operations = plan["cost_model"]["step_operations"]
    # The step's host time is the measured operations' (plus the block table's few entries).
    assert plan["breakdown"]["host_s"] == pytest.approx(operations * compiled_op, rel=0.01)
    with sqlite3.connect(cache) as conn:
        rows = conn.execute("SELECT backend, median_s FROM profiles").fetchall()
    assert sorted(b for b, _ in rows) == ["torch-decode.compiled-step", "torch-decode.step"]
    assert all(0 < seconds < 1 for _, seconds in rows)
    assert run([*args, "--compile", "-o", str(tmp_path / "b.json")], capsys)[0] == 0
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    # Another model's plan is not this one's measurement; traced alone, the traced one is charged.
    code, out, _ = run([*args, "--json"], capsys)
    traced = json.loads(out)["predicted"]
    assert code == 0 and traced["cost_model"]["measured_op_overhead"] == [traced_op, 0.0]
    # A GPU cluster's step cannot be timed here: said, and predicted from its spec.
    code, out, err = run([*args[:5], "h200", *args[6:], "--json"], capsys)
    assert code == 0 and "warning: --profile: cluster h200 has devices other than CPUs" in err
    assert "measured_op_overhead" not in json.loads(out)["predicted"]["cost_model"]
    # An LLM config has no step to time.
    code, _, err = run([*THESIS, "--context", "1K", "--profile"], capsys)
    assert code == 2 and "--profile times the decode step of a model" in err


def test_a_step_the_profile_cannot_build_is_said_and_predicted_from_the_spec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tessera.executor import decode_program

    path = tmp_path / "gpt.onnx"
    path.write_bytes(build("gpt", "tiny", seed=0, seq=256).SerializeToString())
    traced = decode_program.compile_step

    def compile_step(*args, inductor: bool = False, **kwargs):  # inductor fails; the traced step builds
        return "inductor failed" if inductor else traced(*args, **kwargs)

    monkeypatch.setattr(decode_program, "compile_step", compile_step)
    code, out, err = run(["plan", str(path), "--kind", "cp", "--cluster", "local-cpu-split", "--batch", "1",
                          "--context", "128", "--output-len", "32", "--profile", "--cache", str(tmp_path / "p.sqlite"),
                          "--compile", "--json"], capsys)  # fmt: skip
    assert code == 0 and "warning: --profile:" in err and "inductor failed" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "measured_op_overhead" not in json.loads(out)["predicted"]["cost_model"]


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


def _shards(p: dict, spans: list[list[int]]) -> None:
    for shard, (a, b) in zip(p["kv_shards"], spans, strict=True):
        shard.update(start=a, stop=b)


CP_HAND_EDITS = {
    "a gap between shards": (
        lambda p: _shards(p, [[0, 8192], [8200, 16384], [16384, 24576], [24576, 32768]]),
        "cp kv_shards must split positions 0..32768 in consecutive ranges",
    ),
    "shards short of the context": (
        lambda p: _shards(p, [[0, 8192], [8192, 16384], [16384, 24576], [24576, 30000]]),
        "cp kv_shards must split positions 0..32768",
    ),
    "a shard too few": (lambda p: p["kv_shards"].pop(), "a plan of degree 4 has 3 kv_shards"),
    "a device twice": (
        lambda p: p["workload"]["devices"].__setitem__(1, p["workload"]["devices"][0]),
        "workload.devices must name 4 distinct devices (degree 4)",
    ),
    "a device not in the cluster": (
        lambda p: [
            p["workload"]["devices"].__setitem__(0, "node9/a5000:0"),
            p["kv_shards"][0].update(device="node9/a5000:0"),
        ],
        "device 'node9/a5000:0' is not in the plan's cluster",
    ),
    "context not an integer": (
        lambda p: p["workload"].update(context="32K"),
        "workload.context must be a positive integer",
    ),
    "memory beyond capacity": (
        lambda p: p["predicted"]["memory_per_device"].update(total=10**12),
        "predicted memory per device 1000000000000 bytes exceeds its capacity",
    ),
    # Each of these passed validate, then crashed launch with exit 1 (or decoded nonsense).
    "no batch": (lambda p: p["workload"].update(batch=0), "workload.batch must be a positive integer, got 0"),
    "heads missing": (lambda p: p["llm"].pop("heads"), "llm.heads must be a positive integer, got None"),
    "hidden a string": (lambda p: p["llm"].update(hidden="abc"), "llm.hidden must be a positive integer"),
    "kv_heads not dividing heads": (
        lambda p: p["llm"].update(kv_heads=p["llm"]["heads"] - 1),
        "must divide llm.heads",
    ),
    "kv block null": (
        lambda p: p["predicted"]["cost_model"].update(kv_block=None),
        "predicted.cost_model.kv_block must be a positive integer, got None",
    ),
    "tokens per second a string": (
        lambda p: p["predicted"].update(tokens_per_s="fast"),
        "predicted.tokens_per_s must be a number, got 'fast'",
    ),
    "negative tokens per second": (
        lambda p: p["predicted"].update(tokens_per_s=-5),
        "predicted.tokens_per_s is -5.0: predictions are finite and not negative",
    ),
    "a context of 2**40 tokens": (
        lambda p: [p["workload"].update(context=2**40), p.update(kv_shards=[])],
        "workload.context 1099511627776 is beyond the planner's 1073741824 tokens",
    ),
    "degree beyond the cluster": (
        lambda p: [p.update(degree=64, kv_shards=[]), p["workload"].pop("devices")],
        "degree 64 is more than the",
    ),
    "tp shards that split the context": (
        lambda p: [
            p.update(strategy="tp"),
            _shards(p, [[0, 8192], [8192, 16384], [16384, 24576], [24576, 32768]]),
        ],
        "tp kv_shards must each hold positions 0..32768",
    ),
}


@pytest.mark.parametrize("edit", sorted(CP_HAND_EDITS))
def test_validate_checks_what_a_cp_plan_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: str
) -> None:
    """``validate`` passed any cp plan whose schema parsed: it now checks the KV shards against the
    strategy and context, the devices against degree and cluster, and memory against capacity."""
    path = tmp_path / "plan.json"
    assert run([*THESIS, "--context", "32K", "-o", str(path)], capsys)[0] == 0
    assert run(["validate", str(path)], capsys)[0] == 0
    plan = json.loads(path.read_text())
    assert plan["strategy"] == "cp" and plan["degree"] == 4
    change, fragment = CP_HAND_EDITS[edit]
    change(plan)
    path.write_text(json.dumps(plan))
    code, _, err = run(["validate", str(path)], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and str(path) in lines[0] and fragment in lines[0], err
