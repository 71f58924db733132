"""``tessera launch`` end to end: a 2-rank run, a worker killed mid-run, refused plans."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_cli
from executor.plans import chain_halves, make_plan, save_model, write
from executor.processes import interrupt_launch, still_running

from tessera.core.plans import ModelRef, PlacementGroup, PlacementPlan, write_plan
from tessera.executor.launcher import FAULT_ENV
from tessera.executor.training import TrainingData, TrainOptions, train_reference
from tessera.models import build


@pytest.fixture
def chain_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """candle_uno cut into two halves (2 ranks), written next to its model (relative path)."""
    monkeypatch.chdir(tmp_path)
    graph = save_model(build("candle_uno", "tiny", 0), Path("candle.onnx"))
    plan = make_plan(graph, [(s, [f"cpu:{i}"], 2) for i, s in enumerate(chain_halves(graph))], 4)
    return graph, write(plan, tmp_path / "plan.json")


def _worker_children() -> list[int]:
    """Live spawned worker processes that are children of this (test) process."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z" and "spawn_main" in cmd:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_two_rank_launch_reports_loss_times_and_memory_against_predicted(chain_plan) -> None:
    graph, plan_path = chain_plan
    res = run_cli("launch", str(plan_path), "--steps", "3", "--lr", "0.05", "--seed", "4", "--json")
    assert res.code == 0, res.err
    report = json.loads(res.out)
    assert report["kind"] == "gpp" and report["world_size"] == 2 and report["backend"] == "gloo"
    ref = train_reference(graph, 3, 4, seed=4, lr=0.05)
    np.testing.assert_allclose([s["loss"] for s in report["steps"]], ref.losses, rtol=1e-5)
    assert set(report["steps"][0]["busy_s"]) == {"0", "1"}
    assert report["predicted"]["iteration_time_s"] == pytest.approx(0.01)
    assert report["ratio"]["iteration_time"] == pytest.approx(report["measured"]["iteration_time_s"] / 0.01)
    for st in report["stages"]:
        assert st["busy_s"] > 0 and st["peak_memory_bytes"] > 0 and st["memory_ratio"] > 0
    # One thread each on this 2-core machine: each rank pinned to a core of its own.
    cores = [r["cores"] for r in sorted(report["ranks"], key=lambda r: r["rank"])]
    if len(os.sched_getaffinity(0)) >= 2:
        allowed = sorted(os.sched_getaffinity(0))
        assert cores == [[allowed[0]], [allowed[1]]]
    _check_fidelity(report)
    text = run_cli("launch", str(plan_path), "--steps", "2")
    assert text.code == 0, text.err
    line = next(x for x in text.out.splitlines() if x.startswith("fidelity (measured/predicted): iteration "))
    assert (
        " (median step " in line
        and "stage 0 busy " in line
        and "stage 1 busy " in line
        and "all-reduce " in line
        and "idle " in line
    )
    assert _worker_children() == []


def _check_fidelity(report: dict) -> None:
    """Every stage's busy, all-reduce and idle time add up to the iteration, measured and predicted."""
    fidelity = report["fidelity"]
    iteration = fidelity["iteration"]
    assert iteration["measured_s"] == report["measured"]["iteration_time_s"]
    assert iteration["predicted_s"] == pytest.approx(0.01)
    assert iteration["error"] == pytest.approx(iteration["measured_s"] / 0.01 - 1)
    # The typical step too: the median over the steps the mean counts (all but the first).
    counted = sorted(s["iteration_s"] for s in report["steps"][1:])
    assert iteration["median_s"] == pytest.approx(float(np.median(counted)))
    assert iteration["median_error"] == pytest.approx(iteration["median_s"] / 0.01 - 1)
    assert [st["id"] for st in fidelity["stages"]] == [st["id"] for st in report["stages"]]
    for st, row in zip(report["stages"], fidelity["stages"], strict=True):
        assert (
            row["busy"]["measured_s"] == st["busy_s"] and row["busy"]["predicted_s"] == st["predicted_busy_s"]
        )
        parts = [row[k]["measured_s"] for k in ("busy", "allreduce", "idle")]
        assert all(x >= 0 for x in parts)
        assert sum(parts) == pytest.approx(max(iteration["measured_s"], parts[0] + parts[1]))
        # The hand-built plan predicts busy 5 ms of a 10 ms iteration and no all-reduce.
        assert row["idle"]["predicted_s"] == pytest.approx(0.005) and row["allreduce"]["predicted_s"] is None


@pytest.mark.slow
def test_every_rank_runs_with_the_threads_its_plan_measured(tmp_path: Path, chain_plan) -> None:
    """A CPU device type's ``cores`` are the torch threads its rank uses (the stage profiler
    measured with them), not this machine's cores shared out over the ranks."""
    graph, plan_path = chain_plan
    data = json.loads(plan_path.read_text())
    (kind,) = data["cluster"]["device_types"]
    data["cluster"]["device_types"][kind]["cores"] = 3  # not cpu_count // 2 on this 2-core machine
    edited = tmp_path / "cores3.json"
    edited.write_text(json.dumps(data))
    res = run_cli("launch", str(edited), "--steps", "1", "--json")
    assert res.code == 0, res.err
    assert [r["threads"] for r in json.loads(res.out)["ranks"]] == [3, 3]
    # 2 ranks x 3 threads do not fit 2 cores: left to the scheduler, on every core.
    assert all(r["cores"] == sorted(os.sched_getaffinity(0)) for r in json.loads(res.out)["ranks"]) or (
        len(os.sched_getaffinity(0)) >= 6
    )
    ref = train_reference(graph, 1, 4, seed=0, lr=0.01)  # and it trains as before
    np.testing.assert_allclose(json.loads(res.out)["steps"][0]["loss"], ref.losses[0], rtol=1e-5)


def test_a_worker_that_dies_mid_run_stops_the_launch_with_exit_4(chain_plan, monkeypatch) -> None:
    _, plan_path = chain_plan
    monkeypatch.setenv(FAULT_ENV, "1:2:exit")  # test-only: rank 1 calls os._exit(3) at step 2
    start = time.monotonic()
    res = run_cli("launch", str(plan_path), "--steps", "4", "--timeout", "20")
    elapsed = time.monotonic() - start
    assert res.code == 4, res.err
    assert "rank 1 (stage 1, replica 0, device host0/cpu:1) failed: exited with code 3" in res.err
    assert elapsed < 60
    assert _worker_children() == []


def test_a_changed_model_is_refused_with_exit_2(chain_plan) -> None:
    _, plan_path = chain_plan
    Path("candle.onnx").write_bytes(build("candle_uno", "tiny", 1).SerializeToString())
    res = run_cli("launch", str(plan_path))
    assert res.code == 2
    assert "model changed" in res.err


def test_placement_plans_run_their_composite_model(tmp_path: Path, chain_plan) -> None:
    graph, _ = chain_plan
    half = len(graph.order) // 2
    plan = PlacementPlan(
        model=ModelRef.of(graph),
        groups=[
            PlacementGroup(id=0, backend="onnxruntime", nodes=list(graph.order[:half]), pattern="*"),
            PlacementGroup(id=1, backend="openvino", nodes=list(graph.order[half:]), pattern="*"),
        ],
    )
    path = write_plan(plan, tmp_path / "placement.json")
    res = run_cli("launch", str(path), "--repeat", "3", "--json")
    assert res.code == 0, res.err
    report = json.loads(res.out)
    assert report["kind"] == "placement"
    refused = run_cli("launch", str(path), "--compile")
    assert refused.code == 2 and "--compile does not apply to a placement plan" in refused.err


@pytest.mark.slow
def test_compiled_stages_train_as_the_fx_program_does(chain_plan) -> None:
    graph, plan_path = chain_plan
    res = run_cli("launch", str(plan_path), "--steps", "2", "--lr", "0.05", "--compile", "--json")
    assert res.code == 0, res.err
    ref = train_reference(graph, 2, 4, lr=0.05)
    # inductor fuses and reorders: close to the fx program's training, not bit-identical
    np.testing.assert_allclose([s["loss"] for s in json.loads(res.out)["steps"]], ref.losses, rtol=1e-4)


def test_bad_launch_options_are_input_errors(chain_plan) -> None:
    _, plan_path = chain_plan
    res = run_cli("launch", str(plan_path), "--nproc-per-node", "3")
    assert res.code == 2 and "the plan has 2 devices" in res.err
    res = run_cli("launch", str(plan_path), "--nnodes", "2", "--nproc-per-node", "1")
    assert res.code == 2 and "--master-port is required" in res.err


@pytest.mark.slow
def test_ctrl_c_stops_every_worker(chain_plan) -> None:
    _, plan_path = chain_plan
    code, err, workers = interrupt_launch([str(plan_path), "--timeout", "60"], signal.SIGINT)
    assert code == 130, err
    time.sleep(0.5)
    assert still_running(workers) == []


@pytest.mark.slow
def test_the_optimizer_flags_train_as_one_process_does(chain_plan) -> None:
    graph, plan_path = chain_plan
    flags = ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.05", "--lr-schedule", "linear",
             "--warmup-steps", "1", "--max-grad-norm", "0.5"]  # fmt: skip
    res = run_cli("launch", str(plan_path), "--steps", "4", "--seed", "4", *flags, "--json")
    assert res.code == 0, res.err
    report = json.loads(res.out)
    assert report["training"]["optimizer"] == "AdamW(lr=0.01, weight_decay=0.05, linear, warmup 1, clip 0.5)"
    options = TrainOptions(
        steps=4, lr=0.01, seed=4, optimizer="adamw", weight_decay=0.05, lr_schedule="linear",
        warmup_steps=1, max_grad_norm=0.5,
    )  # fmt: skip
    ref = train_reference(graph, 4, 4, seed=4, options=options)
    np.testing.assert_allclose([s["loss"] for s in report["steps"]], ref.losses, rtol=1e-5)


def test_bad_optimizer_flags_are_usage_errors(chain_plan) -> None:
    _, plan_path = chain_plan
    for args, says in (
        (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum is SGD's"),
        (["--max-grad-norm", "0"], "greater than 0"),
        (["--max-grad-norm", "nan"], "greater than 0"),
        (["--weight-decay", "-1"], "0 or more"),
        (["--optimizer", "lamb"], "'lamb' is not one of"),
        (["--warmup-steps", "-1"], "-1"),
    ):
        res = run_cli("launch", str(plan_path), *args)
        assert res.code == 2, (args, res.err)
        assert says in res.err, (args, res.err)


def test_a_token_file_for_a_model_without_token_ids_is_refused_naming_it(chain_plan, tmp_path: Path) -> None:
    _, plan_path = chain_plan
    tokens = tmp_path / "text.npy"
    np.save(tokens, np.arange(100))
    res = run_cli("launch", str(plan_path), "--data", str(tokens))
    assert res.code == 2, res.err
    assert str(tokens) in res.err and "token ids [batch, sequence]" in res.err
    res = run_cli("launch", str(plan_path), "--data", str(tokens), "--loss", "mse")
    assert res.code == 2 and "--loss ce, not mse" in res.err, res.err


def test_cross_entropy_without_labels_is_refused_not_trained_as_nothing(chain_plan, tmp_path: Path) -> None:
    """Synthetic inputs, or an .npz without target:<output> arrays, give cross-entropy no labels: every
    output would score nothing and the run would train nothing at loss 0."""
    graph, plan_path = chain_plan
    res = run_cli("launch", str(plan_path), "--loss", "ce")
    assert res.code == 2, res.err
    assert "--loss ce" in res.err and "synthetic inputs have none" in res.err and "Traceback" not in res.err
    data = tmp_path / "inputs.npz"
    inputs, _ = TrainingData(graph, 4, seed=0).batch(0)
    np.savez(data, **inputs)
    res = run_cli("launch", str(plan_path), "--loss", "ce", "--data", str(data))
    assert res.code == 2 and str(data) in res.err and "no target:<output> array" in res.err, res.err


def test_options_of_another_plan_kind_are_refused_not_ignored(chain_plan) -> None:
    _, plan_path = chain_plan
    for args in (["--new-tokens", "4"], ["--repeat", "3"], ["--attention", "triton"]):
        res = run_cli("launch", str(plan_path), *args)
        assert res.code == 2, (args, res.err)
        assert f"{args[0]} does not apply to a" in res.err


def test_an_operator_the_executor_lacks_is_refused_before_workers_start(tmp_path: Path) -> None:
    """A standard ONNX operator with no torch function (Acos): ``tessera plan`` costs it, but the
    workers cannot build their stage. Each found that after start-up (exit 4, one failure per
    rank); launch's check of the plan now refuses it first: exit 2, one line naming it and the operator."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], [0.1] * 64)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Acos", ["h"], ["y"], name="acos"),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], [w]), opset_imports=[helper.make_opsetid("", 17)]
    )
    graph = save_model(model, tmp_path / "cos.onnx")
    plan = write(make_plan(graph, [(["mm"], ["c0"], 2), (["acos"], ["c1"], 2)], 4), tmp_path / "plan.json")
    res = run_cli("launch", str(plan))
    lines = res.err.strip().splitlines()
    assert res.code == 2 and len(lines) == 1, res.err
    assert f"{plan}: launch cannot train it" in lines[0] and "no function for Acos ('acos')" in lines[0]
    assert "rank" not in lines[0]  # the launcher's refusal, not a worker's failure


@pytest.mark.parametrize(
    "args,code,fragment",
    [
        (["--master-addr", "nosuchhost.invalid"], 2, "--master-addr 'nosuchhost.invalid': the host name does not resolve"),
        (["--master-addr", "nosuchhost.invalid", "--master-port", "29611"], 2, "the host name does not resolve"),
        (["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "nosuchhost.invalid",
          "--master-port", "29612"], 2, "the host name does not resolve"),
        (["--master-addr", "192.0.2.1"], 2, "--master-addr '192.0.2.1': cannot listen there"),
        (["--master-port", "{busy}"], 4, "--master-port {busy} on 127.0.0.1 is in use (another job?)"),
        (["--master-addr", "0.0.0.0"], 2, "--master-addr '0.0.0.0' means every interface"),
        (["--master-addr", "::"], 2, "--master-addr '::' means every interface"),
        (["--master-addr", "0.0.0.0", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1",
          "--master-port", "29613"], 2, "means every interface; the rendezvous store is unauthenticated"),
    ],
)  # fmt: skip
def test_rendezvous_address_and_port_are_checked_before_workers_start(
    chain_plan, args, code, fragment
) -> None:
    """A host that does not resolve, an address that is not this machine's (192.0.2.1 is
    TEST-NET-1) and a port another process listens on were internal errors (exit 1, torch's
    gaierror or DistNetworkError). Now: one line naming the option, exit 2 for the address, 4 for
    a busy port (a launch failure: nothing wrong with the command, the port is taken)."""
    import socket

    _, plan_path = chain_plan
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        res = run_cli("launch", str(plan_path), *[a.replace("{busy}", port) for a in args])
    lines = res.err.strip().splitlines()
    assert res.code == code and len(lines) == 1, res.err
    assert fragment.replace("{busy}", port) in lines[0] and "rank" not in lines[0]


@pytest.mark.slow
def test_a_decoder_trained_on_a_token_file_is_saved_and_onnxruntime_computes_its_next_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zoo GPT on 2 stages, a token file, cross-entropy and AdamW: --save-model writes the trained
    model, whose logits under onnxruntime give the loss one process computes after those steps (the
    next mini-batch's loss before its update), and inspect reads it."""
    import onnxruntime as ort

    monkeypatch.chdir(tmp_path)
    graph = save_model(build("gpt", "tiny", 0), Path("gpt.onnx"))
    plan = write(
        make_plan(graph, [(graph.order[:2], ["cpu:0"], 2), (graph.order[2:], ["cpu:1"], 4)], 8),
        tmp_path / "p.json",
    )
    np.save(
        "text.npy", np.frombuffer(Path(__file__).read_bytes()[:6000], dtype=np.uint8).astype(np.int64) % 128
    )
    flags = ["--data", "text.npy", "--optimizer", "adamw", "--lr", "3e-3", "--steps", "5", "--seed", "1"]
    res = run_cli("launch", str(plan), *flags, "--save-model", "trained.onnx", "--json")
    assert res.code == 0, res.err
    report = json.loads(res.out)
    assert report["training"]["saved_model"] == ["trained.onnx"]
    options = TrainOptions(steps=6, lr=3e-3, seed=1, data="text.npy", loss="ce", optimizer="adamw")
    ref = train_reference(graph, 6, 8, options=options)
    np.testing.assert_allclose([s["loss"] for s in report["steps"]], ref.losses[:5], rtol=1e-5)
    from tessera.core.data import TrainingData

    inputs, targets = TrainingData(graph, 8, 1, "text.npy", "ce").batch(5)
    session = ort.InferenceSession("trained.onnx")  # the zoo GPT declares a batch of 1: row by row
    logits = np.concatenate([session.run(None, {"input_ids": row[None]})[0] for row in inputs["input_ids"]])
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    loss = -np.take_along_axis(logp, targets["logits"][..., None], axis=-1).mean()
    assert loss == pytest.approx(ref.losses[5], rel=1e-4)
    assert run_cli("inspect", "trained.onnx").code == 0


def test_save_model_refuses_a_path_it_cannot_write_before_training(chain_plan, tmp_path: Path) -> None:
    _, plan_path = chain_plan
    res = run_cli("launch", str(plan_path), "--save-model", "/proc/trained.onnx")
    assert res.code == 2 and "/proc/trained.onnx" in res.err and "cannot write" in res.err, res.err
    res = run_cli("launch", str(plan_path), "--save-model", "candle.onnx")
    assert res.code == 2 and "is also the model" in res.err, res.err


@pytest.mark.parametrize("fault", [None, "1:1:raise"])
def test_a_launch_leaves_nothing_in_the_temporary_directory(chain_plan, tmp_path: Path, fault) -> None:
    """Every launch left a ``torchelastic_*`` folder in TMPDIR (the agent's logs), and a failed one
    ``pytorch-errorfile-*.pickle`` files too; the launcher's own files go with the run."""
    import subprocess
    import sys

    _, plan_path = chain_plan
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TESSERA_DEBUG", FAULT_ENV)}
    env.update({"TMPDIR": str(scratch), **({FAULT_ENV: fault} if fault else {})})
    # torch's compile cache (made in TMPDIR where unset, by torch.optim's first optimizer): torch's
    # own files, kept on purpose, not the launch's
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "torchinductor")
    proc = subprocess.run(
        [sys.executable, "-m", "tessera", "launch", str(plan_path), "--steps", "2"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == (4 if fault else 0), proc.stderr
    left = sorted(p.name for p in scratch.iterdir())
    # onnxruntime writes one shared .ses file in TMPDIR when imported: not the launch's
    assert [name for name in left if name != ".ses"] == [], left


def test_precision_is_a_training_flag(chain_plan, tmp_path: Path) -> None:
    """--precision bf16 trains in bf16 products (the report says so, and how the device computes
    them); it does not apply to a cp plan, and a checkpoint of one precision does not resume in
    the other."""
    graph, plan_path = chain_plan
    res = run_cli("launch", str(plan_path), "--steps", "2", "--precision", "bf16", "--json")
    assert res.code == 0, res.err
    report = json.loads(res.out)
    assert report["training"]["precision"].startswith("bf16")
    assert report["training"]["optimizer"] == "SGD(lr=0.01, bf16)"
    ref = train_reference(graph, 2, 4, options=TrainOptions(steps=2, precision="bf16"))
    np.testing.assert_allclose([s["loss"] for s in report["steps"]], ref.losses, rtol=1e-5)
    assert "timed in fp32" in res.err  # the profiled plan's prediction is fp32's
    res = run_cli("launch", str(plan_path), "--precision", "fp16")
    assert res.code == 2 and "'fp16' is not one of" in res.err, res.err
    folder = tmp_path / "ckpt"
    res = run_cli(
        "launch", str(plan_path), "--steps", "1", "--checkpoint", str(folder), "--precision", "bf16"
    )
    assert res.code == 0, res.err
    res = run_cli("launch", str(plan_path), "--steps", "2", "--checkpoint", str(folder), "--resume")
    assert res.code == 2 and "precision: checkpoint 'bf16', this run 'fp32'" in res.err, res.err


@pytest.mark.slow
def test_the_saved_model_declares_its_inputs_as_the_original_does(tmp_path: Path) -> None:
    """A model whose batch and sequence are symbolic, planned at a sequence of 5 (plan warns when
    a symbolic dim other than the batch is left at 1): the trained model declares both symbols
    again, and onnxruntime runs it at another batch and length with the trained weights."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"])],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])],
        [w],
    )
    model = tmp_path / "seq.onnx"
    model.write_bytes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    )
    plan = tmp_path / "p.json"
    args = ["plan", str(model), "--cluster", "local-cpu-split", "--mini-batch", "8", "-o", str(plan)]
    res = run_cli(*args)
    assert res.code == 0 and "symbolic dims bound to 1: x:1 (seq)" in res.err, res.err
    res = run_cli(*args, "--input-shape", "x=1x5x8")
    assert res.code == 0 and "symbolic dims bound" not in res.err, res.err
    saved = tmp_path / "trained.onnx"
    res = run_cli("launch", str(plan), "--steps", "2", "--lr", "0.1", "--save-model", str(saved), "--json")
    assert res.code == 0, res.err
    out = onnx.load(str(saved)).graph
    declared = [
        [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        for vi in (*out.input, *out.output)
    ]
    assert declared == [["batch", "seq", 8], ["batch", "seq", 8]]
    trained = numpy_helper.to_array(next(t for t in out.initializer if t.name == "w"))
    assert not np.array_equal(trained, numpy_helper.to_array(w))
    x = np.random.default_rng(1).normal(size=(3, 7, 8)).astype(np.float32)
    (y,) = ort.InferenceSession(str(saved)).run(None, {"x": x})
    np.testing.assert_allclose(y, np.maximum(x @ trained, 0), rtol=1e-5, atol=1e-6)


def test_a_bf16_model_trains_tensor_parallel_and_is_saved_in_bf16(tmp_path: Path) -> None:
    """bf16 weights (an export in bf16) come back whole from a 2-way tensor-parallel stage and are
    written in the model's own dtype, as one process trains them (to bf16's rounding)."""
    import ml_dtypes
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from tessera.core.graph import load_graph

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.normal(size=shape).astype(ml_dtypes.bfloat16), name)
        for name, shape in (("w1", (8, 16)), ("w2", (16, 8)))
    ]
    nodes = [
        helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
        helper.make_node("MatMul", ["xb", "w1"], ["h"], name="up"),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="down"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["batch", 8])],
        weights,
    )
    model = tmp_path / "bf16.onnx"
    model.write_bytes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    )
    plan = tmp_path / "tp.json"
    args = ("--cluster", "local-cpu-split", "--mini-batch", "4", "--tensor-parallel", "2", "-o", str(plan))
    assert run_cli("plan", str(model), *args).code == 0
    saved = tmp_path / "trained.onnx"
    res = run_cli(
        "launch", str(plan), "--steps", "2", "--lr", "0.05", "--loss", "mse", "--save-model", str(saved)
    )
    assert res.code == 0, res.err
    trained = {t.name: t for t in onnx.load(str(saved)).graph.initializer}
    assert {t.data_type for t in trained.values()} == {TensorProto.BFLOAT16}
    reference = train_reference(load_graph(str(model)), 2, 4, seed=0, lr=0.05)  # mse, fp32
    for name, want in reference.weights.items():
        got = numpy_helper.to_array(trained[name]).astype(np.float32)
        assert not np.array_equal(got, numpy_helper.to_array(weights[int(name[1]) - 1]).astype(np.float32))
        want = want.astype(np.float32)  # (the row-parallel sum's order differs: a few bf16 steps)
        assert np.abs(got - want).max() <= 0.02 * np.abs(want).max(), name
