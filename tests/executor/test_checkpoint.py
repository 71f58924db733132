"""Checkpoints: written every N steps with torch.distributed.checkpoint, complete or absent; a
resumed run continues exactly where the uninterrupted one was; another run's checkpoint is refused."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_cli
from executor.plans import make_plan, save_model, write
from onnx_builders import tied_chain

from tessera.core.errors import InputError
from tessera.executor.gpp_run import run_gpp_plan
from tessera.executor.launcher import LaunchOptions
from tessera.executor.training import TrainOptions

pytestmark = pytest.mark.slow


@pytest.fixture
def tied(tmp_path: Path):
    """The tied chain on 2 stages, the second data-parallel over 2 ranks: 3 gloo ranks."""
    path = tmp_path / "tied.onnx"
    graph = save_model(tied_chain(), path)
    plan = make_plan(graph, [(graph.order[:6], ["d0"], 2), (graph.order[6:], ["d1", "d2"], 2)], 8)
    return graph, plan, path


def test_a_resumed_run_continues_exactly_where_the_whole_run_was(tied, tmp_path: Path) -> None:
    graph, plan, path = tied
    folder = tmp_path / "ckpt"
    options = TrainOptions(
        steps=8, lr=0.05, seed=3, optimizer="adamw", lr_schedule="cosine", warmup_steps=2, max_grad_norm=0.1,
        checkpoint=str(folder), checkpoint_every=3,
    )  # fmt: skip
    whole = run_gpp_plan(plan, graph, str(path), options, LaunchOptions(timeout_s=60), return_weights=True)
    assert sorted(p.name for p in folder.iterdir()) == ["step-3", "step-6", "step-8"]
    shutil.rmtree(folder / "step-8")
    shutil.rmtree(folder / "step-6")
    (folder / ".step-6.partial").mkdir()  # a run killed while writing: ignored
    resumed = run_gpp_plan(
        plan,
        graph,
        str(path),
        replace(options, resume=True),
        LaunchOptions(timeout_s=60),
        return_weights=True,
    )
    assert [s["step"] for s in resumed.steps] == [3, 4, 5, 6, 7]
    assert resumed.losses == whole.losses[3:]  # exactly
    for name, want in whole.weights.items():
        np.testing.assert_array_equal(resumed.weights[name], want, err_msg=name)


def test_another_runs_checkpoint_is_refused_naming_what_differs(tied, tmp_path: Path) -> None:
    graph, plan, path = tied
    folder = tmp_path / "ckpt"
    options = TrainOptions(steps=2, lr=0.05, optimizer="adamw", checkpoint=str(folder))
    run_gpp_plan(plan, graph, str(path), options, LaunchOptions(timeout_s=60))
    other = replace(options, optimizer="sgd", steps=4, resume=True)
    with pytest.raises(InputError, match="optimizer: checkpoint 'adamw', this run 'sgd'") as err:
        run_gpp_plan(plan, graph, str(path), other, LaunchOptions(timeout_s=60))
    assert err.value.source == str(folder / "step-2")
    with pytest.raises(InputError, match="leaves nothing to train"):
        run_gpp_plan(plan, graph, str(path), replace(options, resume=True), LaunchOptions(timeout_s=60))


def test_a_checkpoint_of_another_plan_or_model_is_refused_naming_it(tied, tmp_path: Path) -> None:
    """Resuming with another plan (the same stages, another prediction) or another model (the same
    graph, other weights) is refused before any worker starts, naming which differs."""
    graph, plan, path = tied
    folder = tmp_path / "ckpt"
    options = TrainOptions(steps=2, lr=0.05, checkpoint=str(folder))
    run_gpp_plan(plan, graph, str(path), options, LaunchOptions(timeout_s=60))
    resume = replace(options, steps=4, resume=True)
    other_plan = plan.model_copy(update={"predicted": {**plan.predicted, "iteration_time_s": 1.0}})
    with pytest.raises(InputError, match="another run \\(plan_sha256: checkpoint '[0-9a-f]{64}'"):
        run_gpp_plan(other_plan, graph, str(path), resume, LaunchOptions(timeout_s=60))
    model = tied_chain()
    model.graph.initializer[0].raw_data = bytes(len(model.graph.initializer[0].raw_data))
    other = save_model(model, tmp_path / "other.onnx")
    with pytest.raises(InputError, match="another run \\(model_sha256: checkpoint"):
        run_gpp_plan(plan, other, str(tmp_path / "other.onnx"), resume, LaunchOptions(timeout_s=60))


def test_checkpoint_flags_on_the_command_line(tied, tmp_path: Path) -> None:
    _, plan, _ = tied
    plan_path = write(plan, tmp_path / "plan.json")
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = run_cli("launch", str(plan_path), "--resume")
    assert res.code == 2 and "need --checkpoint DIR" in res.err, res.err
    res = run_cli("launch", str(plan_path), "--checkpoint", str(afile), "--resume")
    assert res.code == 2 and "is a file" in res.err and str(afile) in res.err, res.err


def test_sigterm_ends_the_run_with_a_checkpoint_that_resumes_exactly(tied, tmp_path: Path) -> None:
    """A launch asked to stop (SIGTERM, as a scheduler does) with --checkpoint finishes the step in
    progress on every rank, writes its checkpoint, and exits 143; --resume continues to the same
    losses as the run that was never stopped."""
    import json
    import os
    import subprocess
    import sys
    import time

    from tessera.executor.launcher import FAULT_ENV

    graph, plan, path = tied
    plan_path = write(plan, tmp_path / "plan.json")
    folder = tmp_path / "ckpt"
    flags = ["--steps", "8", "--lr", "0.05", "--seed", "3", "--optimizer", "adamw", "--max-grad-norm", "0.1"]
    env = {k: v for k, v in os.environ.items() if k not in ("TESSERA_DEBUG", FAULT_ENV)}

    def launch(*extra: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tessera", "launch", str(plan_path), *flags, *extra, "--timeout", "60", "--json"],
            capture_output=True, text=True, timeout=300, env={**env, **({FAULT_ENV: fault} if fault else {})},
        )  # fmt: skip

    started = time.monotonic()
    stopped = launch("--checkpoint", str(folder), fault="0:3:term")
    # The ranks leave once the checkpoint is written, not when the agent's 60 s grace runs out
    # (a scheduler sends SIGKILL 30 s after SIGTERM): start-up and 4 steps take about 11 s here.
    assert time.monotonic() - started < 50
    assert stopped.returncode == 143, stopped.stderr
    written = [p.name for p in folder.iterdir() if p.name.startswith("step-")]
    assert len(written) == 1 and 4 <= int(written[0][5:]) < 8, written
    assert f"stopped after step {written[0][5:]}: checkpoint" in stopped.stderr
    resumed = launch("--checkpoint", str(folder), "--resume")
    whole = launch()
    assert resumed.returncode == 0 and whole.returncode == 0, resumed.stderr + whole.stderr
    done = int(written[0][5:])
    losses = [s["loss"] for s in json.loads(resumed.stdout)["steps"]]
    assert losses == [s["loss"] for s in json.loads(whole.stdout)["steps"]][done:]
