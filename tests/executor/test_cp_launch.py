"""``tessera launch`` of cp plans: greedy decode on gloo ranks equals a single-process reference.

Plans come from the real planner (``tessera plan --kind cp``); where the cost model would pick
another strategy for these tiny models (on CPUs DP wins: no collectives), the test pins the choice
with :func:`pin_choice` so the plan is the planner's own plan of that strategy and degree.
Prompts have different lengths per request, so KV shards are uneven and later shards are empty for
short requests. Exactness: the tokens equal onnxruntime's greedy tokens of the model's whole graph
(each request alone, no cache: ``decode_reference``); an ``--llm`` plan's model is its config's GPT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runner import run_cli
from decode_reference import free_session, plan_tokens

import tessera.planners.cp.plan as cp_planner
from tessera.cli.launch_cmd import _cp_summary
from tessera.core.errors import InputError
from tessera.core.plans import load_plan
from tessera.executor.cp_run import check_cp_plan, run_cp_plan
from tessera.executor.decode_program import SCORED_OPERATIONS, compile_step, step_operations
from tessera.executor.decode_worker import DecodeOptions
from tessera.executor.graph_decode_worker import graph_decoder
from tessera.executor.kv_cache import GroupCache, attention_partial
from tessera.executor.kv_layout import KvLayout
from tessera.executor.launcher import FAULT_ENV, LaunchOptions
from tessera.models import build

FOUR_CPUS = """\
# Four one-core CPU devices (oversubscribed on a 2-core VM): a degree-4 plan for gloo ranks.
name: local-cpu-4
device_types:
  cpu-core: {kind: cpu, cores: 1, memory: 4GiB, flops: {fp32: 70GFLOPS}, memory_bandwidth: 6GB/s}
nodes:
  - {name: local, devices: [{type: cpu-core, count: 4}]}
links:
  intra_node: {bandwidth: 2GB/s, latency: 80us}
"""

SMALL_LLM = """\
name: small-gqa
layers: 3
hidden: 48
heads: 6
kv_heads: 2
ffn: 96
vocab: 200
dtype: fp32
gated_ffn: {gated}
tied_embeddings: {tied}
"""


def pin_choice(monkeypatch: pytest.MonkeyPatch, strategy: str, degree: int) -> None:
    """Make ``plan_cp`` choose ``strategy`` at ``degree`` instead of the fastest estimate."""
    monkeypatch.setattr(
        cp_planner,
        "best_estimate",
        lambda es: next(e for e in es if e.strategy == strategy and e.degree == degree),
    )


def make_plan(tmp_path: Path, source: list[str], cluster: str, batch: int, context: int, *extra: str) -> Path:
    out = tmp_path / "plan.json"
    res = run_cli("plan", *source, "--kind", "cp", "--cluster", cluster, "--batch", str(batch),
                  "--context", str(context), "--output-len", "8", "-o", str(out), *extra)  # fmt: skip
    assert res.code == 0, res.err
    return out


@pytest.fixture
def gpt(tmp_path: Path) -> Path:
    path = tmp_path / "gpt.onnx"
    path.write_bytes(build("gpt", "tiny", seed=3, kv_heads=2, seq=96).SerializeToString())
    return path


def llm_config(tmp_path: Path, *, gated: bool = False, tied: bool = False) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL_LLM.format(gated=str(gated).lower(), tied=str(tied).lower()))
    return path


def expected_tokens(
    plan_path: Path, model: Path | None, lens: list[int], seed: int, n: int
) -> list[list[int]]:
    return plan_tokens(load_plan(plan_path), model, lens, seed, n)


# -- without workers -------------------------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True], ids=["interpreted", "traced"])
def test_the_graph_decoders_prefill_is_onnx_runtimes(gpt: Path, compiled: bool) -> None:
    """The zoo GPT decoded from its graph: attention over a static cache gives onnxruntime's logits,
    at the prompt and one token after it (positions offset by the cached tokens), interpreted node
    by node or as the traced programs of the prefill and the decode step."""
    decoder = graph_decoder(str(gpt))
    prompt = [5, 17, 3, 99, 42, 7, 64, 1]
    if compiled:
        assert compile_step(decoder, 1, len(prompt)) is None
        assert compile_step(decoder, 1, 1) is None
    cache = GroupCache(np.zeros(len(prompt) + 1, dtype=np.int64), 0, torch.device("cpu"))

    def attend(layer: int, q, k, v, scores, past: int) -> torch.Tensor:
        keys, values, at = cache.read(layer, cache.write(layer, k, v, past))
        return attention_partial(q, keys, values, torch.arange(past, past + q.shape[2]), at, scores)[0]

    session = free_session(gpt)
    ours = decoder.logits(torch.tensor([prompt]), 0, attend)[0]
    np.testing.assert_allclose(
        ours.numpy(), session.run(None, {"input_ids": np.array([prompt])})[0][0], rtol=1e-4, atol=1e-5
    )
    ours = decoder.logits(torch.tensor([[11]]), len(prompt), attend)[0, -1]
    want = session.run(None, {"input_ids": np.array([[*prompt, 11]])})[0][0, -1]
    np.testing.assert_allclose(ours.numpy(), want, rtol=1e-4, atol=1e-5)
    assert cache.positions_held == len(prompt) + 1 and cache.slots == len(prompt) + 1


def test_kv_layout_follows_the_plan_then_deals_blocks() -> None:
    layout = KvLayout([(0, 32), (32, 40), (40, 40)], block=16)
    owners = layout.owners(100)
    assert list(owners[:40]) == [0] * 32 + [1] * 8
    assert list(owners[40:48]) == [1] * 8  # the rest of the partial block [32, 48)
    assert list(owners[48:64]) == [2] * 16  # then whole blocks to the least-loaded shard
    held = np.bincount(owners, minlength=3)
    assert held.max() - held.min() <= 16 + 4  # within a block (+ the partial tail)
    with pytest.raises(InputError, match="consecutive"):
        KvLayout([(0, 16), (20, 40)])


def test_unsupported_strategy_is_refused(tmp_path: Path, gpt: Path) -> None:
    plan = load_plan(make_plan(tmp_path, [str(gpt)], "local-cpu-split", 2, 20))
    with pytest.raises(InputError, match="runs cp, tp, dp plans"):
        check_cp_plan(plan.model_copy(update={"strategy": "cp+tp"}), DecodeOptions())


def test_a_changed_model_is_refused_with_exit_2(tmp_path: Path, gpt: Path, monkeypatch) -> None:
    pin_choice(monkeypatch, "cp", 2)
    plan = make_plan(tmp_path, [str(gpt)], "local-cpu-split", 4, 40)
    gpt.write_bytes(build("gpt", "tiny", seed=4, kv_heads=2, seq=96).SerializeToString())
    res = run_cli("launch", str(plan))
    assert res.code == 2 and "model changed" in res.err


# -- on gloo ranks -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_onnx_gpt_cp_on_2_ranks_through_the_cli(tmp_path: Path, gpt: Path, monkeypatch) -> None:
    pin_choice(monkeypatch, "cp", 2)
    plan = make_plan(tmp_path, [str(gpt)], "local-cpu-split", 5, 40)
    lens = [40, 17, 3, 33, 45]
    res = run_cli("launch", str(plan), "--new-tokens", "6", "--prompt-lens", ",".join(map(str, lens)),
                  "--seed", "1", "--json")  # fmt: skip
    assert res.code == 0, res.err
    report = json.loads(res.out)
    assert report["strategy"] == "cp" and report["world_size"] == 2 and report["backend"] == "gloo"
    assert report["tokens"] == expected_tokens(plan, gpt, lens, 1, 6)
    # Shards [0, 32) and [32, 40) (+ blocks past the context): short requests leave rank 1 empty.
    held = [r["kv_positions_by_request"] for r in report["ranks"]]
    assert held[1]["1"] == 0 and held[1]["2"] == 0 and held[1]["0"] == 45 - 32
    assert sum(h[str(b)] for h in held for b in range(5)) == sum(lens) + 5 * 5
    m, p, r = report["measured"], report["predicted"], report["ratio"]
    assert m["tokens_per_s"] > 0 and 0 < m["communication_fraction"] < 1
    assert r["tokens_per_s"] == pytest.approx(m["tokens_per_s"] / p["tokens_per_s"])
    assert r["per_token_latency"] == pytest.approx(m["per_token_latency_s"] / p["per_token_latency_s"])
    # measured against the step this executor runs (the dense part on both ranks, a gather a layer)
    launch = json.loads(plan.read_text())["predicted"]["launch"]
    assert (
        p["per_token_latency_s"] == launch["step_time_s"]
        and p["communication_s"] == launch["communication_s"]
    )
    text = _cp_summary(report)  # what the launch prints without --json
    assert "CP x2" in text and "measured/predicted" in text


@pytest.mark.slow
def test_onnx_gpt_cp_on_4_ranks(tmp_path: Path, gpt: Path, monkeypatch) -> None:
    cluster = tmp_path / "cpu4.yaml"
    cluster.write_text(FOUR_CPUS)
    pin_choice(monkeypatch, "cp", 4)
    plan_path = make_plan(tmp_path, [str(gpt)], str(cluster), 6, 50)
    plan = load_plan(plan_path)
    assert [(s.start, s.stop) for s in plan.kv_shards] == [(0, 16), (16, 32), (32, 48), (48, 50)]
    lens = [50, 2, 31, 64, 18, 7]
    run = run_cp_plan(plan, str(gpt), DecodeOptions(new_tokens=5, prompt_lens=tuple(lens), seed=2),
                      LaunchOptions(timeout_s=60))  # fmt: skip
    assert run.tokens == expected_tokens(plan_path, gpt, lens, 2, 5)
    assert [r["requests"] for r in run.ranks] == [[0, 6]] * 4  # every cp rank runs the whole graph
    assert run.ranks[3]["kv_positions_by_request"]["1"] == 0


@pytest.mark.slow
def test_llm_config_cp_on_4_ranks_through_the_cli(tmp_path: Path, monkeypatch) -> None:
    cluster = tmp_path / "cpu4.yaml"
    cluster.write_text(FOUR_CPUS)
    pin_choice(monkeypatch, "cp", 4)
    config = llm_config(tmp_path, tied=True)
    plan = make_plan(tmp_path, ["--llm", str(config)], str(cluster), 3, 70)
    res = run_cli("launch", str(plan), "--new-tokens", "7", "--prompt-lens", "70,9,40", "--json")
    assert res.code == 0, res.err
    report = json.loads(res.out)
    assert report["degree"] == 4 and report["decode"]["weights"].startswith("seeded random (seed 0")
    assert report["tokens"] == expected_tokens(plan, None, [70, 9, 40], 0, 7)
    assert report["ranks"][3]["kv_positions_by_request"]["1"] == 0  # request 1: 15 positions, shard 0 only
    config.write_text(SMALL_LLM.format(gated="true", tied="true"))
    res = run_cli("launch", str(plan))
    assert res.code == 2 and "LLM config changed" in res.err


@pytest.mark.slow
def test_llm_config_tp_on_2_ranks_with_swiglu(tmp_path: Path, monkeypatch) -> None:
    pin_choice(monkeypatch, "tp", 2)
    config = llm_config(tmp_path, gated=True)
    plan_path = make_plan(tmp_path, ["--llm", str(config)], "local-cpu-split", 3, 24)
    plan = load_plan(plan_path)
    run = run_cp_plan(plan, None, DecodeOptions(new_tokens=5, prompt_lens=(24, 5, 11), seed=3),
                      LaunchOptions(timeout_s=60))  # fmt: skip
    assert run.tokens == expected_tokens(plan_path, None, [24, 5, 11], 3, 5)
    assert run.measured["communication_s"] > 0  # two all-reduces per layer


@pytest.mark.slow
def test_the_planners_own_choice_dp_on_2_ranks(tmp_path: Path, gpt: Path) -> None:
    plan = make_plan(tmp_path, [str(gpt)], "local-cpu-split", 4, 30)  # DP wins on these CPUs
    res = run_cli("launch", str(plan), "--new-tokens", "4", "--prompt-lens", "30,3,12,25", "--json")
    assert res.code == 0, res.err
    report = json.loads(res.out)
    assert report["strategy"] == "dp" and report["measured"]["communication_s"] == 0
    assert report["tokens"] == expected_tokens(plan, gpt, [30, 3, 12, 25], 0, 4)


@pytest.mark.slow
def test_a_plan_for_the_compiled_step_launches_compiled_and_warns_when_launched_traced(
    tmp_path: Path, gpt: Path
) -> None:
    plan = make_plan(
        tmp_path, [str(gpt)], "local-cpu-split", 2, 30, "--strategy", "dp", "--degree", "1", "--compile"
    )
    res = run_cli("launch", str(plan), "--new-tokens", "5", "--prompt-lens", "30,12", "--compile", "--json")
    assert res.code == 0 and "warning" not in res.err, res.err
    report = json.loads(res.out)
    assert report["decode"]["step"] == "inductor" and report["decode"]["compile_s"] > 0
    assert report["tokens"] == expected_tokens(plan, gpt, [30, 12], 0, 5)  # greedy tokens survive the fusion
    res = run_cli("launch", str(plan), "--new-tokens", "2", "--prompt-lens", "30,12")
    assert res.code == 0 and "the plan predicts the decode step compiled" in res.err
    assert "plan without --compile for a prediction of it" in res.err


@pytest.mark.slow
def test_a_rank_that_fails_mid_decode_stops_the_launch_with_exit_4(
    tmp_path: Path, gpt: Path, monkeypatch
) -> None:
    pin_choice(monkeypatch, "cp", 2)
    plan = make_plan(tmp_path, [str(gpt)], "local-cpu-split", 2, 20)
    monkeypatch.setenv(FAULT_ENV, "1:1:raise")  # test-only: rank 1 raises at decode step 1
    res = run_cli("launch", str(plan), "--new-tokens", "4", "--timeout", "20")
    assert res.code == 4, res.err
    assert "rank 1 (cp 1/2, device local0/cpu-core:1) failed: RuntimeError: injected fault" in res.err
    assert "Traceback" not in res.err
    monkeypatch.setenv("TESSERA_DEBUG", "1")  # the worker's own traceback, for a bug report
    res = run_cli("launch", str(plan), "--new-tokens", "4", "--timeout", "20")
    assert res.code == 4 and "Traceback" in res.err and "in inject_test_fault" in res.err, res.err


def test_triton_attention_on_cpu_workers_is_refused_before_they_start(tmp_path: Path) -> None:
    """Without Triton's interpreter the CPU workers cannot run the Triton kernel. That was found by
    every worker after start-up (exit 4, seconds later); now the launcher refuses it first (exit 2,
    one line with the reason). A subprocess, so that Triton is imported without TRITON_INTERPRET."""
    plan_path = make_plan(tmp_path, ["--llm", "gpt2"], "local-cpu-split", 2, 64)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TESSERA_DEBUG")}
    proc = subprocess.run(
        [sys.executable, "-m", "tessera", "launch", str(plan_path), "--attention", "triton"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "--attention triton is unavailable on the plan's cpu workers" in lines[0]
    assert "TRITON_INTERPRET=1" in lines[0] and "rank" not in lines[0]


def test_triton_attention_on_heads_narrower_than_the_kernel_is_refused_before_workers_start(
    tmp_path: Path, gpt: Path
) -> None:
    """The zoo's tiny GPT has 8-wide heads, below the Triton kernel's 16 (tl.dot): on a GPU that
    was each worker's ValueError at its first decode step (exit 4); now one line first (exit 2).
    A subprocess with Triton's interpreter, so that Triton counts as available on CPU workers."""
    plan_path = make_plan(tmp_path, [str(gpt)], "local-cpu-split", 2, 40)
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_DEBUG"} | {"TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tessera", "launch", str(plan_path), "--attention", "triton"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    lines = [line for line in proc.stderr.strip().splitlines() if "warning" not in line]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "the model's head dim 8 is below the kernel's minimum of 16; use --attention torch" in lines[0]


def test_launch_checks_an_llm_plans_devices_against_its_cluster(tmp_path: Path) -> None:
    """A plan made from ``--llm`` has no model to check it against; launch still checks what the
    plan says (as validate does) before starting workers."""
    plan_path = make_plan(tmp_path, ["--llm", "gpt2"], "local-cpu-split", 2, 64)
    plan = json.loads(plan_path.read_text())
    plan["workload"]["devices"][0] = plan["kv_shards"][0]["device"] = "nowhere/cpu:0"
    plan_path.write_text(json.dumps(plan))
    res = run_cli("launch", str(plan_path))
    lines = res.err.strip().splitlines()
    assert res.code == 2 and len(lines) == 1, res.err
    assert f"{plan_path}: device 'nowhere/cpu:0' is not in the plan's cluster" in lines[0]


def test_launch_refuses_an_llm_plan_of_experts_it_would_run_as_a_dense_model(tmp_path: Path) -> None:
    """A config has no weights: launch builds a dense GPT of its sizes, which is not a mixture of
    experts; it says so and points at the export, before any worker starts."""
    config = tmp_path / "moe.yaml"
    config.write_text(SMALL_LLM.format(gated="true", tied="false") + "experts: 4\nexperts_per_token: 2\n")
    plan_path = make_plan(tmp_path, ["--llm", str(config)], "local-cpu-split", 2, 64)
    assert json.loads(plan_path.read_text())["llm"]["experts"] == 4
    res = run_cli("launch", str(plan_path))
    lines = res.err.strip().splitlines()
    assert res.code == 2 and len(lines) == 1, res.err
    assert "4 experts" in lines[0] and "ONNX export" in lines[0]


def test_logits_that_are_not_finite_fail_the_launch_naming_the_request(tmp_path: Path) -> None:
    """A graph that computes NaN for some token (an exporter that dropped a norm's epsilon does so for
    a zeroed padding row) must not have the argmax of NaN, token 0, reported as the model's next token:
    the launch fails (exit 4) naming the request and the position."""
    import onnx
    from onnx import numpy_helper

    model = build("gpt", "tiny", seed=3, kv_heads=2, seq=96)
    table = next(t for t in model.graph.initializer if numpy_helper.to_array(t).shape[0] == 128)
    rows = numpy_helper.to_array(table).copy()
    rows[7] = np.nan
    table.CopyFrom(numpy_helper.from_array(rows, table.name))
    path = tmp_path / "nan.onnx"
    onnx.save(model, str(path))
    plan = make_plan(tmp_path, [str(path), "--strategy", "dp", "--degree", "1"], "local-cpu-split", 2, 16)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5 17 3 99\n42 7 64 1\n")
    res = run_cli("launch", str(plan), "--prompts", str(prompts), "--new-tokens", "3")
    assert res.code == 4, res.err
    assert "request 1" in res.err and "position 3" in res.err and "NaN or inf" in res.err


def test_a_plan_without_the_expert_fields_still_validates_as_a_dense_decoder(
    gpt: Path, tmp_path: Path
) -> None:
    """Plans of dense decoders written before mixtures of experts have no experts fields: they are
    one expert, and the model's re-derived config agrees."""
    plan_path = make_plan(tmp_path, [str(gpt)], "local-cpu-split", 2, 16)
    plan = json.loads(plan_path.read_text())
    for key in ("experts", "experts_per_token", "shared_ffn"):
        del plan["llm"][key]
    plan_path.write_text(json.dumps(plan))
    res = run_cli("validate", str(plan_path))
    assert res.code == 0, res.err
    plan["llm"]["experts"] = 4
    plan_path.write_text(json.dumps(plan))
    res = run_cli("validate", str(plan_path))
    assert res.code == 2 and "llm.experts is 4 but the model has 1" in res.err


@pytest.mark.parametrize(
    ("change", "kind"),
    [({"window": 4}, "window"), ({"alibi": (0.5,) * 4}, "alibi"), ({"softcap": 2.0, "window": 4}, "softcap"),
     ({"sinks": (0.0,) * 4, "alibi": (0.5,) * 4}, "sinks")],
)  # fmt: skip
def test_a_step_of_scored_attention_counts_what_its_cores_add(gpt: Path, change: dict, kind: str) -> None:
    """A window, ALiBi, soft-capping or a sink costs a core more than torch's fused kernel with a
    plain score: the step's count (what the plan charges) has what the costliest of them adds, per core."""
    import dataclasses

    decoder = graph_decoder(str(gpt))
    plain = step_operations(decoder)
    assert plain is not None and all(core.scores.plain for core in decoder.cores)
    decoder.cores = [
        dataclasses.replace(core, scores=dataclasses.replace(core.scores, **change)) for core in decoder.cores
    ]
    assert step_operations(decoder) == plain + SCORED_OPERATIONS[kind] * len(decoder.cores)
