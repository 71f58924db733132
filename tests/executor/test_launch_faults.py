"""``tessera launch`` refuses, before any worker starts, what would otherwise fail after start-up:
memory the host does not have, unbounded decode lengths, misshapen targets, a plan whose llm block
is not its config's; and every refusal of a plan names the plan's file.

Workers must not start in these tests: ``launch_workers`` is replaced by a function that fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_cli
from executor.plans import chain_halves, make_plan, save_model, write
from executor.processes import interrupt_launch, listening_addresses, start_launch, still_running, workers_of
from onnx import numpy_helper

import tessera.executor.cp_memory as cp_memory
import tessera.executor.cp_run as cp_run
import tessera.executor.gpp_run as gpp_run
from tessera.core.errors import InputError
from tessera.core.plans import load_plan
from tessera.core.weights import materialize
from tessera.executor.cp_run import check_cp_plan
from tessera.executor.decode_worker import DecodeOptions
from tessera.executor.kv_layout import KvLayout
from tessera.models import build
from tessera.models.gpt import llm_gpt

TINY_LLM = """\
name: tiny
layers: 2
hidden: 64
heads: 4
kv_heads: 4
head_dim: 16
ffn: 256
vocab: 256
dtype: fp32
"""


@pytest.fixture(autouse=True)
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("workers started: the launch should have been refused before")

    monkeypatch.setattr(cp_run, "launch_workers", refuse)
    monkeypatch.setattr(gpp_run, "launch_workers", refuse)


def _cp_plan(
    tmp_path: Path, *source: str, context: str = "8K", batch: int = 4, output_len: str = "8"
) -> Path:
    out = tmp_path / "cp.json"
    res = run_cli("plan", *source, "--kind", "cp", "--cluster", "local-cpu-split", "--batch", str(batch),
                  "--context", context, "--output-len", output_len, "-o", str(out))  # fmt: skip
    assert res.code == 0, res.err
    return out


@pytest.fixture
def tiny_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    Path("tiny.yaml").write_text(TINY_LLM)
    plan = _cp_plan(tmp_path, "--llm", "tiny.yaml", output_len="uniform:1-1024")
    assert (load_plan(plan).strategy, load_plan(plan).degree) == ("cp", 2)
    return plan


def _one_line_error(err: str, plan: Path | str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"tessera: error: {plan}: "), err
    return lines[0]


# -- 1. memory ---------------------------------------------------------------------------------------


def test_a_model_larger_than_host_memory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-7b built in fp32 by every rank (27 GB each) on an 8 GiB host: exit 2, not the OOM killer."""
    monkeypatch.setattr(cp_memory, "available_memory_bytes", lambda: 8 * 2**30)
    plan = _cp_plan(tmp_path, "--llm", "llama-7b", context="64", batch=2)
    res = run_cli("launch", str(plan))
    assert res.code == 2
    line = _one_line_error(res.err, plan)
    assert "would need about" in line and "weights" in line and "8.0 GiB is available" in line


def test_a_prompt_whose_prefill_scores_do_not_fit_is_refused(
    tiny_plan: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill attention is quadratic in the prompt: 200000 tokens need terabytes of scores."""
    monkeypatch.setattr(cp_memory, "available_memory_bytes", lambda: 16 * 2**30)
    res = run_cli("launch", str(tiny_plan), "--prompt-lens", "200000")
    assert res.code == 2
    line = _one_line_error(res.err, tiny_plan)
    assert "prefill" in line and "TiB" in line


def test_the_estimate_covers_what_a_tiny_launch_builds(tiny_plan: Path) -> None:
    plan = load_plan(tiny_plan)
    need = cp_memory.host_memory_need(
        plan, [16] * 4, 8, range(2), layout=KvLayout([(0, 4096), (4096, 8192)]), positions=None,
        on_gpu=False,
    )  # fmt: skip
    model = materialize(llm_gpt(plan.llm))  # what the workers build
    weights = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer if t.data_type == 1)
    assert 2 * weights <= need["weights"] <= 4 * weights  # the model and its torch module; an upper bound
    assert 0 < need["kv_cache"] and 0 < need["prefill"] < 2**20
    assert sum(need.values()) < 2**30


# -- 2. decode length --------------------------------------------------------------------------------


def test_new_tokens_are_bounded_before_start(tiny_plan: Path) -> None:
    started = time.perf_counter()
    res = run_cli(
        "launch", str(tiny_plan), "--prompt-lens", "16", "--new-tokens", "100000000", "--timeout", "20"
    )
    assert res.code == 2 and "kv cache" in _one_line_error(res.err, tiny_plan)
    assert time.perf_counter() - started < 10
    res = run_cli("launch", str(tiny_plan), "--new-tokens", str(2**30 + 1))
    assert res.code == 2 and "--new-tokens" in res.err and "Traceback" not in res.err


@pytest.mark.timeout(30)
def test_kv_layout_owners_is_linear_and_deals_blocks_as_before() -> None:
    layout = KvLayout([(0, 8), (8, 10)], block=4)
    # the partial block 8..11 finishes on rank 1, then whole blocks go to the rank holding fewer
    expected = [0] * 8 + [1] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    assert layout.owners(24).tolist() == expected
    assert layout.owners(5).tolist() == [0] * 5
    for rank in range(2):
        for length in range(1, 40):
            assert layout.most_held(rank, length) >= int((layout.owners(length) == rank).sum())
    started = time.perf_counter()
    owners = KvLayout([(0, 4096), (4096, 8192)]).owners(4_000_000)  # quadratic: minutes
    assert time.perf_counter() - started < 10
    assert np.bincount(owners).tolist() == [2_000_000, 2_000_000]


# -- 3. targets --------------------------------------------------------------------------------------


def test_a_misshapen_target_array_is_refused_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    graph = save_model(build("candle_uno", "tiny", 0), Path("candle.onnx"))
    plan = write(make_plan(graph, [(s, [f"cpu:{i}"], 2) for i, s in enumerate(chain_halves(graph))], 4),
                 tmp_path / "plan.json")  # fmt: skip
    rng = np.random.default_rng(0)
    arrays = {
        n: rng.standard_normal((4, *info.shape[1:])).astype(np.float32) for n, info in graph.inputs.items()
    }
    output, info = next(iter(graph.outputs.items()))
    bad = (4, *info.shape[1:-1], info.shape[-1] + 1)
    np.savez("data.npz", **arrays, **{f"target:{output}": np.zeros(bad, np.float32)})
    res = run_cli("launch", str(plan), "--data", "data.npz", "--steps", "1")
    assert res.code == 2
    line = _one_line_error(res.err, "data.npz")
    assert f"'target:{output}'" in line and "sample shape" in line


# -- 4. refusals name the plan -----------------------------------------------------------------------


def test_plan_problems_found_by_the_executor_name_the_plan(tiny_plan: Path) -> None:
    plan = load_plan(tiny_plan)
    tp = plan.model_copy(update={"strategy": "tp", "llm": {**plan.llm, "heads": 3, "kv_heads": 3}})
    with pytest.raises(InputError) as caught:
        check_cp_plan(tp, DecodeOptions(), str(tiny_plan))
    assert caught.value.one_line().startswith(f"{tiny_plan}: tp over 2 ranks needs heads (3)")
    no_shards = plan.model_copy(update={"kv_shards": []})
    with pytest.raises(InputError) as caught:
        check_cp_plan(no_shards, DecodeOptions(), str(tiny_plan))
    assert caught.value.one_line().startswith(f"{tiny_plan}: a cp plan of degree 2 needs 2 kv_shards")


def test_a_request_longer_than_the_position_table_names_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("gpt.onnx").write_bytes(build("gpt", "tiny", seed=0).SerializeToString())  # 16 positions
    plan = _cp_plan(tmp_path, "gpt.onnx", context="8", batch=2)
    res = run_cli("launch", str(plan), "--prompt-lens", "16", "--new-tokens", "2")
    assert res.code == 2 and "model holds 16 positions" in _one_line_error(res.err, plan)


# -- 6. the plan's llm block is its config's ---------------------------------------------------------


def test_a_plan_whose_llm_block_differs_from_its_config_is_refused(tiny_plan: Path) -> None:
    data = json.loads(tiny_plan.read_text())
    data["llm"]["hidden"] = 128
    edited = tiny_plan.with_name("hidden128.json")
    edited.write_text(json.dumps(data))
    for command in ("launch", "validate"):
        res = run_cli(command, str(edited))
        assert res.code == 2, (command, res.err)
        assert "hidden" in _one_line_error(res.err, edited)
    assert run_cli("validate", str(tiny_plan)).code == 0


# -- 8. options ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["--prompt-lens", " "], ["--prompt-lens", ","], ["--model", "x.onnx"]],
    ids=["blank-prompt-lens", "comma-prompt-lens", "model-for-an-llm-plan"],
)
def test_options_that_would_be_ignored_are_refused(tiny_plan: Path, args: list[str]) -> None:
    res = run_cli("launch", str(tiny_plan), *args)
    assert res.code == 2 and args[0] in res.err and "Traceback" not in res.err


@pytest.mark.slow
def test_sigterm_prints_one_line_and_no_torch_warning(tiny_plan: Path) -> None:
    code, err, _ = interrupt_launch(
        [str(tiny_plan), "--prompt-lens", "16", "--timeout", "60"], signal.SIGTERM
    )
    assert code == 143, err  # 128 + SIGTERM, as a shell reports it (Ctrl-C is 130)
    assert err.split() == ["tessera:", "terminated"], err  # not torch's "Received 15 death signal"


@pytest.mark.slow
def test_a_stopped_rank_ends_the_launch_within_the_timeout(tiny_plan: Path) -> None:
    """SIGSTOP of one rank: no worker can end it (its watchdog is stopped too, torch waits 30 s
    before SIGKILL); the launcher sees no progress for --timeout and stops every worker."""
    timeout = 8.0
    proc, workers = start_launch(
        [str(tiny_plan), "--prompt-lens", "16", "--new-tokens", "200000", "--timeout", str(timeout)]
    )
    try:
        time.sleep(0.5)  # decoding
        os.kill(max(workers), signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - stopped_at
    finally:
        for pid in workers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 4, err
    # The workers are stopped --timeout after the last beat; then the launcher's interpreter ends
    # (torch's native libraries take ~0.6 s to tear down on an idle machine, seconds on a loaded
    # one). The bound tells the watchdog apart from torch's own 30 s wait and from a hang.
    assert took <= timeout + 6, f"ended {took:.1f} s after the stop (--timeout {timeout:g})"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err  # not c10d's socket warnings
    assert re.match(r"tessera: error: rank [01] \(cp [12]/2, .*\) is stopped", lines[0]), err
    assert f"no rank went on for {timeout:g} s" in lines[0], err
    assert still_running(workers) == []


@pytest.mark.slow
def test_nothing_listens_beyond_the_master_address(tiny_plan: Path) -> None:
    """The rendezvous store and gloo listen on --master-addr (127.0.0.1 by default) only."""
    proc, workers = start_launch([str(tiny_plan), "--prompt-lens", "16", "--timeout", "30"], fault="1:1:hang")
    try:
        deadline = time.monotonic() + 20
        addresses: list[str] = []
        while time.monotonic() < deadline and len(addresses) < 3:  # the store and each worker's gloo
            time.sleep(0.2)
            addresses = listening_addresses([proc.pid, *workers_of(proc.pid)])
    finally:
        proc.kill()
        proc.communicate()
        for pid in workers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert len(addresses) >= 3, addresses
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
