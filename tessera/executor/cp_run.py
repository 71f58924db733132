"""Run a CP (cache-parallel, TP or DP) decode plan: check it, start a decode worker per device, report.

:func:`check_cp_plan` refuses what the executor cannot run; :func:`run_cp_plan` also refuses an
unmappable model and a launch the host cannot hold (:mod:`~tessera.executor.cp_memory`), launches
:func:`~tessera.executor.decode_worker.cp_worker` on every rank and returns a :class:`CpRun`:
the tokens, tokens/s and per-token latency measured against the plan's prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tessera.core.errors import InputError
from tessera.core.plans import CpPlan
from tessera.executor.cp_memory import check_host_memory, host_memory_need, llm_ints
from tessera.executor.decode_worker import CpWorkerSpec, DecodeOptions, cp_worker
from tessera.executor.graph_decode_worker import graph_decoder
from tessera.executor.kv_layout import DEFAULT_KV_BLOCK, KvLayout
from tessera.executor.launcher import LaunchOptions, choose_backend, launch_workers, local_ranks
from tessera.executor.report import RunReport, gathered, ratios, slowest, steady_mean
from tessera.planners.cp.workload import MAX_TOKENS

SUPPORTED_STRATEGIES = ("cp", "tp", "dp")


@dataclass(kw_only=True)
class CpRun(RunReport):
    """What ``tessera launch`` reports for a cp plan (``to_json`` is the ``--json`` output)."""

    kind: str = "cp"
    strategy: str
    degree: int
    backend: str
    options: DecodeOptions
    weights: str
    prompt_lens: list[int]
    tokens: list[list[int]]
    extra: dict[str, Any] = field(default_factory=dict)

    def details(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "degree": self.degree,
            "world_size": self.degree,
            "backend": self.backend,
            "decode": {
                "batch": len(self.prompt_lens),
                "prompt_lens": self.prompt_lens,
                "new_tokens": self.options.new_tokens,
                "decode_steps": self.options.new_tokens - 1,
                "seed": self.options.seed,
                "attention": self.options.attention,
                "weights": self.weights,
                "greedy": True,
                "prefill": "replicated on every rank that keeps KV of the request",
                **self.extra,
            },
            "tokens": self.tokens,
        }


def _devices(plan: CpPlan) -> list[str]:
    devices = list(plan.workload.get("devices") or [s.device for s in plan.kv_shards])
    if not devices:
        devices = [f"rank{r}" for r in range(plan.degree)]
    return devices


def check_cp_plan(plan: CpPlan, options: DecodeOptions, source: str | None = None) -> list[int]:
    """Refuse what the executor cannot run (InputError, exit 2; a problem of the plan names
    ``source``, the plan's file); return the prompt lengths."""
    if plan.strategy not in SUPPORTED_STRATEGIES:
        raise InputError(
            f"strategy {plan.strategy!r} cannot be launched; the executor runs "
            f"{', '.join(SUPPORTED_STRATEGIES)} plans",
            source=source,
        )
    n = plan.degree
    if len(_devices(plan)) != n:
        raise InputError(f"the plan has degree {n} but {len(_devices(plan))} devices", source=source)
    if plan.strategy == "cp" and len(plan.kv_shards) != n:
        raise InputError(
            f"a cp plan of degree {n} needs {n} kv_shards; it has {len(plan.kv_shards)}", source=source
        )
    _, _, heads, kv_heads, _, _, _ = llm_ints(plan.llm)
    if plan.strategy == "tp" and (heads % n or (kv_heads % n and n % kv_heads)):
        raise InputError(
            f"tp over {n} ranks needs heads ({heads}) divisible by {n} and kv_heads ({kv_heads}) a multiple "
            f"or a divisor of {n}",
            source=source,
        )
    if not 2 <= options.new_tokens <= MAX_TOKENS:
        raise InputError(
            f"--new-tokens {options.new_tokens}: must be in 2..{MAX_TOKENS} "
            "(one prefill token, at least one decode step)"
        )
    if options.attention not in ("torch", "triton"):
        raise InputError(f"--attention {options.attention!r}: expected torch or triton")
    if options.attention == "triton":
        from tessera.kernels.triton_decode import MIN_HEAD_DIM, triton_unavailable_reason

        # The workers' device (a GPU under NCCL, else the CPU), asked before any worker starts.
        device = "cuda" if choose_backend(plan.cluster, _devices(plan)) == "nccl" else "cpu"
        why = triton_unavailable_reason(device)
        if why is not None:
            raise InputError(f"--attention triton is unavailable on the plan's {device} workers: {why}")
        if int(plan.llm["head_dim"]) < MIN_HEAD_DIM:
            raise InputError(
                f"--attention triton: the model's head dim {plan.llm['head_dim']} is below the kernel's "
                f"minimum of {MIN_HEAD_DIM}; use --attention torch"
            )
    return _prompt_lens(plan, options, source)


def _prompt_lens(plan: CpPlan, options: DecodeOptions, source: str | None) -> list[int]:
    """Each request's prompt length: ``--prompts``' lines, else ``--prompt-lens`` cycled over the
    plan's batch, else the plan's context."""
    batch, n = int(plan.workload["batch"]), plan.degree
    requests = batch if options.prompts is None else len(options.prompts)
    if requests > batch:
        raise InputError(
            f"--prompts: {requests} requests, more than the plan's batch of {batch}", source=source
        )
    if plan.strategy == "dp" and requests < n:
        raise InputError(f"dp over {n} ranks needs at least {n} requests ({requests} given)", source=source)
    if options.prompts is not None:
        given = tuple(len(p) for p in options.prompts)
    else:
        given = options.prompt_lens or (int(plan.workload["context"]),)
    if any(p < 1 for p in given):
        raise InputError(f"--prompt-lens {list(given)}: every prompt needs at least 1 token")
    if any(p + options.new_tokens - 1 > MAX_TOKENS for p in given):
        raise InputError(
            f"--prompt-lens {max(given)} with --new-tokens {options.new_tokens}: a request may hold at "
            f"most {MAX_TOKENS} positions (1024M)"
        )
    return [int(given[b % len(given)]) for b in range(requests)]


def run_cp_plan(
    plan: CpPlan,
    model_path: str | None,
    options: DecodeOptions,
    launch: LaunchOptions | None = None,
    *,
    plan_path: str = "<plan>",
) -> CpRun:
    """Launch ``plan`` (its model checked by the caller) on torch.distributed workers, decode, and
    report measured tokens/s and per-token latency against the plan's prediction. Raises InputError
    (exit 2) for a plan or model the executor cannot run, LaunchError (exit 4) when a worker fails."""
    launch = launch or LaunchOptions()
    prompt_lens = check_cp_plan(plan, options, plan_path)
    model = _checked_model(plan, model_path, options, plan_path)
    longest = max(prompt_lens) + options.new_tokens - 1
    if model.max_positions is not None and longest > model.max_positions:
        raise InputError(
            f"the longest request needs {longest} positions (prompt {max(prompt_lens)} + "
            f"{options.new_tokens - 1} decode steps) but the model holds {model.max_positions} positions (its position tables' rows)",
            source=plan_path,
        )
    backend = choose_backend(plan.cluster, _devices(plan))
    devices = _devices(plan)
    block = int((plan.predicted.get("cost_model") or {}).get("kv_block", DEFAULT_KV_BLOCK))
    shards = [(s.start, s.stop) for s in plan.kv_shards]
    layout = _kv_layout(plan, shards, block, plan_path)
    need = host_memory_need(
        plan,
        prompt_lens,
        options.new_tokens,
        local_ranks(launch, plan.degree),
        layout=layout,
        positions=model.max_positions,
        on_gpu=backend == "nccl",
    )
    check_host_memory(need, plan_path)
    spec = CpWorkerSpec(
        strategy=plan.strategy,
        world_size=plan.degree,
        devices=devices,
        llm=dict(plan.llm),
        model_path=model.path,
        prompts=_prompts(options, model.vocab, prompt_lens),
        options=options,
        kv_shards=shards,
        kv_block=block,
        timeout_s=launch.timeout_s,
        backend=backend,
    )

    def describe(rank: int) -> str:
        return f"rank {rank} ({plan.strategy} {rank}/{plan.degree}, device {devices[rank]})"

    results = launch_workers(cp_worker, (spec,), plan.degree, launch, describe_rank=describe)
    return cp_report(plan, plan_path, backend, options, prompt_lens, model.source, gathered(results))


def make_prompts(vocab: int, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Request ``b``'s prompt: ``lengths[b]`` ids uniform in ``[0, vocab)`` from
    ``numpy.random.default_rng([seed, b])`` (the same in every process)."""
    return [
        np.random.default_rng([seed, b]).integers(0, vocab, size=n).tolist() for b, n in enumerate(lengths)
    ]


def _prompts(options: DecodeOptions, vocab: int, prompt_lens: list[int]) -> list[list[int]]:
    """The requests' token ids: ``--prompts`` (checked against the vocabulary), else seeded random."""
    if options.prompts is None:
        return make_prompts(vocab, prompt_lens, options.seed)
    for i, prompt in enumerate(options.prompts):
        if any(not 0 <= t < vocab for t in prompt):
            bad = next(t for t in prompt if not 0 <= t < vocab)
            raise InputError(
                f"--prompts: request {i + 1} has token id {bad}, outside the vocabulary 0..{vocab - 1}"
            )
    return [list(p) for p in options.prompts]


@dataclass(frozen=True)
class _Model:
    """What the launcher needs of the decoder the workers will build."""

    path: str | None  # the ONNX model (resolved), None for seeded random weights
    vocab: int
    max_positions: int | None  # the position table's length; None: rotary or sinusoidal (no limit)
    source: str


def _checked_model(plan: CpPlan, model_path: str | None, options: DecodeOptions, plan_path: str) -> _Model:
    """The plan's decoder; an ONNX model that cannot be decoded from its graph is refused before
    any worker starts. An ``--llm`` plan's GPT (models.gpt.llm_gpt) is built by the workers."""
    if plan.model is None:
        if plan.llm.get("experts", 1) > 1:  # the seeded GPT has a dense FFN: not what was planned
            raise InputError(
                f"the plan's LLM config has {plan.llm['experts']} experts, and launch builds a config's model "
                "with a dense FFN: launch a mixture of experts from its ONNX export (plan MODEL.onnx --kind cp)",
                source=plan_path,
            )
        source = f"seeded random (seed {options.seed}; --llm config {plan.llm.get('name', '?')}, sinusoidal positions)"
        return _Model(None, int(plan.llm["vocab"]), None, source)
    if model_path is None:
        raise InputError("the plan names an ONNX model; give its path", source=plan_path)
    path = str(Path(model_path).resolve())
    decoder = graph_decoder(path)
    # The workers build their own: only these facts are kept (no copy held while they run).
    return _Model(path, decoder.vocab, decoder.max_positions, f"{path} (its own graph)")


def _kv_layout(plan: CpPlan, shards: list[tuple[int, int]], block: int, plan_path: str) -> KvLayout | None:
    """The KV layout of a cp plan (checked: a bad one names the plan); None for tp and dp."""
    if plan.strategy != "cp":
        return None
    try:
        return KvLayout(shards, block)
    except InputError as exc:
        raise InputError(exc.message, source=plan_path) from None


def cp_report(
    plan: CpPlan,
    plan_path: str,
    backend: str,
    options: DecodeOptions,
    prompt_lens: list[int],
    source: str,
    per_rank: list[dict[str, Any]],
) -> CpRun:
    """The report of a decode from its ranks' results (a step's time: its slowest rank's)."""
    batch = len(prompt_lens)
    tokens_by_request: dict[int, list[int]] = {}
    for r in per_rank:
        tokens_by_request.update({int(b): t for b, t in r["tokens"].items()})
    steps = [
        {"step": k, "step_s": slowest(per_rank, k, "step_s"), "comm_s": slowest(per_rank, k, "comm_s")}
        for k in range(options.new_tokens - 1)
    ]
    latency = steady_mean([s["step_s"] for s in steps])
    comm = steady_mean([s["comm_s"] for s in steps])
    measured = {
        "tokens_per_s": batch / latency if latency > 0 else 0.0,
        "per_token_latency_s": latency,
        "communication_s": comm,
        "communication_fraction": comm / latency if latency > 0 else 0.0,
        "prefill_s": max(r["prefill_s"] for r in per_rank),
        **serving_metrics(batch, max(r["prefill_s"] for r in per_rank), [s["step_s"] for s in steps]),
    }
    extra: dict[str, Any] = {
        "layers_evaluated": plan.predicted.get("layers_evaluated"),
        "step": options.step,
        "compile_s": max(r.get("compile_s", 0.0) for r in per_rank),
        "programs": per_rank[0].get("programs", {}),
    }
    if plan.predicted.get("per_layer"):
        extra["note"] = "the plan predicts only some layers (--layers); the run decodes all of them"
    predicted = _predicted(plan)
    return CpRun(
        plan_path=plan_path,
        strategy=plan.strategy,
        degree=plan.degree,
        backend=backend,
        options=options,
        weights=source,
        prompt_lens=prompt_lens,
        tokens=[tokens_by_request.get(b, []) for b in range(batch)],
        steps=steps,
        ranks=[_rank_row(r) for r in sorted(per_rank, key=lambda r: r["rank"])],
        measured=measured,
        predicted=predicted,
        ratio=ratios(
            measured,
            predicted,
            {"tokens_per_s": "tokens_per_s", "per_token_latency": "per_token_latency_s"},
        ),
        extra=extra,
    )


def serving_metrics(batch: int, prefill_s: float, step_s: list[float]) -> dict[str, float]:
    """What serving users read (vLLM's ``bench serve`` names, in seconds): time to first token (the
    prefill, every request's first token), inter-token latency percentiles over the decode steps,
    time per output token after the first, and output tokens per second over the whole decode."""
    itl = np.asarray(step_s, dtype=np.float64)
    total = prefill_s + float(itl.sum())
    return {
        "ttft_s": prefill_s,
        "itl_p50_s": float(np.percentile(itl, 50)),
        "itl_p90_s": float(np.percentile(itl, 90)),
        "itl_p99_s": float(np.percentile(itl, 99)),
        "tpot_s": float(itl.mean()),
        "output_throughput": batch * (len(itl) + 1) / total if total > 0 else 0.0,
    }


def _predicted(plan: CpPlan) -> dict[str, float]:
    """The plan's prediction of this run: its ``launch`` step where it has one (tp: the layers'
    split the model allows and its all-reduces; cp: the dense part on every rank, one gather a
    layer; as this executor runs them)."""
    predicted = {
        k: float(plan.predicted[k])
        for k in ("tokens_per_s", "per_token_latency_s", "step_time_s")
        if plan.predicted.get(k) is not None
    }
    breakdown = plan.predicted.get("breakdown") or {}
    if breakdown.get("communication_s") is not None:
        predicted["communication_s"] = float(breakdown["communication_s"])
    launch = plan.predicted.get("launch") or {}
    if launch.get("step_time_s"):
        step = float(launch["step_time_s"])
        batch = int(plan.workload.get("batch", 1))
        predicted.update(
            tokens_per_s=batch / step,
            per_token_latency_s=step,
            step_time_s=step,
            communication_s=float(launch["communication_s"]),
        )
    return predicted


def _rank_row(r: dict[str, Any]) -> dict[str, Any]:
    """One rank: its requests, the KV positions it holds, its memory and steady step times."""
    return {
        "rank": r["rank"],
        "device": r["device"],
        "requests": r["requests"],
        "kv_positions": r["kv_positions"],
        "kv_positions_by_request": r["kv_positions_by_request"],
        "kv_cache_bytes": r["kv_cache_bytes"],
        "weight_bytes": r["weight_bytes"],
        "peak_rss_bytes": r["peak_rss_bytes"],
        "prefill_s": r["prefill_s"],
        "compile_s": r.get("compile_s", 0.0),
        "step_s": steady_mean([s["step_s"] for s in r["steps"]]),
        "tokens_per_s": (r["requests"][1] - r["requests"][0])
        / max(steady_mean([s["step_s"] for s in r["steps"]]), 1e-12),
        "comm_s": steady_mean([s["comm_s"] for s in r["steps"]]),
    }
