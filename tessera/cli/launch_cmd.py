"""``tessera launch PLAN.json``: run a plan, measured against predicted.

Parses the options, checks the plan and its model (a changed model is refused with exit 2), calls
the plan kind's runner (:data:`tessera.executor.RUNNERS`) and prints its report. A worker that
fails stops the launch with exit 4 and the failing rank named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from tessera.api.models import plan_graph
from tessera.cli.launch_warnings import warn_if_stepped_otherwise, warn_if_timed_otherwise
from tessera.cli.options import FiniteFloat, check_outputs, json_option, plan_model_option, warn_line
from tessera.cli.render import emit_json, human_bytes
from tessera.core.errors import InputError, LaunchError
from tessera.core.files import check_writable
from tessera.core.graph import Graph
from tessera.core.plans import CpPlan, GppPlan, Plan, load_plan
from tessera.core.tokens import default_loss
from tessera.core.user_files import MAX_TEXT_BYTES, read_user_file
from tessera.executor import RUNNERS, LaunchRequest
from tessera.executor.launcher import LaunchOptions
from tessera.executor.placement import worst_output
from tessera.planners.cp.workload import MAX_TOKENS

TRAINING_OPTIONS = (
    "optimizer",
    "momentum",
    "weight_decay",
    "lr_schedule",
    "warmup_steps",
    "max_grad_norm",
    "loss",
    "save_model",
    "checkpoint",
    "checkpoint_every",
    "resume",
    "precision",
)
# Options that only some plan kinds read; giving one for another kind is a usage error, not ignored.
_KIND_OPTIONS: dict[str, frozenset[str]] = {
    "gpp": frozenset({"steps", "lr", "data", "compile_", "distributed", "trace", *TRAINING_OPTIONS}),
    "spp": frozenset({"steps", "lr", "data", "compile_", "distributed", "trace", *TRAINING_OPTIONS}),
    "cp": frozenset({"new_tokens", "prompt_lens", "prompts", "attention", "compile_", "distributed"}),
    "placement": frozenset({"repeat", "data"}),
}
_DISTRIBUTED = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "timeout_s")

MAX_TIMEOUT_S = 86400.0
"""The longest ``--timeout`` accepted: a day (the workers' timers and process-group timeouts overflow
on absurd values, and a hang should not be waited out for longer)."""


def _refuse_options_of_other_kinds(kind: str) -> None:
    ctx = click.get_current_context()
    allowed = _KIND_OPTIONS.get(kind, frozenset())
    specific = set().union(*_KIND_OPTIONS.values()) - {"distributed"}
    names = sorted(specific - allowed) + ([] if "distributed" in allowed else list(_DISTRIBUTED))
    for name in names:
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
            flag = "--" + name.removesuffix("_s").rstrip("_").replace("_", "-")
            raise click.UsageError(f"{flag} does not apply to a {kind} plan")


@click.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False, path_type=str))
@plan_model_option
@click.option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes on this node (default: every rank of the plan / --nnodes).",
)
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True, help="Nodes taking part.")
@click.option(
    "--node-rank", type=click.IntRange(min=0), default=0, show_default=True, help="This node's rank."
)
@click.option("--master-addr", default="127.0.0.1", show_default=True, help="Rendezvous address (node 0).")
@click.option(
    "--master-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Rendezvous port (default: a free one; required with --nnodes > 1).",
)
@click.option(
    "--steps", type=click.IntRange(min=1), default=5, show_default=True, help="Training steps (mini-batches)."
)
@click.option(
    "--lr", type=FiniteFloat(), default=0.01, show_default=True, help="Peak learning rate (finite, > 0)."
)
@click.option(
    "--checkpoint",
    type=click.Path(file_okay=False, path_type=str),
    default=None,
    help="[gpp/spp] A folder of checkpoints (torch.distributed.checkpoint): DIR/step-N after N steps, "
    "complete or absent.",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=1),
    default=None,
    help="[gpp/spp] Steps between checkpoints (default: after the last step only).",
)
@click.option(
    "--resume",
    is_flag=True,
    help="[gpp/spp] Continue from the newest complete checkpoint in --checkpoint (none yet: from the start); "
    "--steps counts from the start of the run.",
)
@click.option(
    "--save-model",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="[gpp/spp] Write the trained model there (ONNX, atomically; weights past 1 GiB as OUT.data beside it).",
)
@click.option(
    "--trace",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="[gpp/spp] Write the run's timeline as a trace (Chrome trace-event JSON: open it in ui.perfetto.dev): "
    "every rank's forwards, backwards, waits, sends and receives (arrows), all-reduce and optimizer step, and "
    "beside each rank the plan's simulated iteration from the start of every step.",
)
@click.option(
    "--loss",
    type=click.Choice(["mse", "ce", "graph"]),
    default=None,
    help="[gpp/spp] mse: mean squared error to the data's targets (0 without); ce: cross-entropy of the "
    "logits against integer labels (target:<output> arrays, or a token file's next tokens); graph: the "
    "model's own scalar loss output (an exported training graph; its labels are inputs in --data). "
    "Default: ce for a token file, else mse.",
)
@click.option(
    "--optimizer",
    type=click.Choice(["sgd", "adamw", "adam"]),
    default="sgd",
    show_default=True,
    help="[gpp/spp] torch.optim optimizer of every stage.",
)
@click.option("--momentum", type=FiniteFloat(minimum=0), default=0.0, help="[gpp/spp] SGD momentum.")
@click.option(
    "--weight-decay",
    type=FiniteFloat(minimum=0),
    default=None,
    help="[gpp/spp] Weight decay (default: the optimizer's own: 0.01 for AdamW, else 0).",
)
@click.option(
    "--lr-schedule",
    type=click.Choice(["constant", "cosine", "linear"]),
    default="constant",
    show_default=True,
    help="[gpp/spp] After the warm-up, the learning rate stays, or falls to 0 at the last step.",
)
@click.option(
    "--warmup-steps", type=click.IntRange(min=0), default=0, help="[gpp/spp] Steps of linear warm-up to --lr."
)
@click.option(
    "--max-grad-norm",
    type=FiniteFloat(),
    default=None,
    help="[gpp/spp] Clip the gradients to this global norm (over every stage and replica).",
)
@click.option(
    "--precision",
    type=click.Choice(["fp32", "bf16"]),
    default="fp32",
    show_default=True,
    help="[gpp/spp] bf16: matrix products and convolutions compute in bf16 (fp32 operands cast, results "
    "back in fp32), the rest and the weights stay fp32; refused on a GPU without bf16, slow on a CPU "
    "without AVX512-BF16 or AMX.",
)
@click.option(
    "--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the synthetic data."
)
@click.option(
    "--data",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="An .npz with one array per model input (rows = samples), optionally target:<output> arrays; "
    "or [gpp/spp] a flat token file (.bin of uint16 ids, nanoGPT's format, or a 1-D integer .npy) whose "
    "windows of the model's sequence length train next-token prediction (memory-mapped).",
)
@click.option(
    "--compile",
    "compile_",
    is_flag=True,
    help="Run through torch.compile (inductor): [gpp/spp] every stage's program (slower here; not "
    "bit-exact); [cp] the decode step's program (seconds to compile per rank, then faster; not bit-exact).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=FiniteFloat(maximum=MAX_TIMEOUT_S),
    default=60.0,
    show_default=True,
    help="Seconds a worker may wait on a peer before the launch is stopped (a step stuck elsewhere: 1.5x); "
    "0 < SECONDS <= 86400 (a day).",
)
@click.option(
    "--new-tokens",
    type=click.IntRange(min=2, max=MAX_TOKENS),
    default=8,
    show_default=True,
    help="[cp] Tokens generated per request (the first by the prefill, then decode steps); 2..1024M.",
)
@click.option(
    "--prompt-lens",
    metavar="LIST",
    default=None,
    help="[cp] Prompt length of each request, comma-separated, repeated over the batch "
    "(default: the plan's context).",
)
@click.option(
    "--prompts",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="[cp] A file of requests, one per line as space-separated token ids (at most the plan's batch).",
)
@click.option(
    "--attention",
    type=click.Choice(["torch", "triton"]),
    default="torch",
    show_default=True,
    help="[cp] Shard attention kernel (triton: CUDA, or CPU with TRITON_INTERPRET=1; slow).",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=7,
    show_default=True,
    help="[placement] Timing rounds of the placed model (median reported).",
)
@json_option
def launch(  # noqa: PLR0913
    plan_path: str,
    model: str | None,
    nproc_per_node: int | None,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int | None,
    steps: int,
    lr: float,
    optimizer: str,
    momentum: float,
    weight_decay: float | None,
    lr_schedule: str,
    warmup_steps: int,
    max_grad_norm: float | None,
    loss: str | None,
    save_model: str | None,
    trace: str | None,
    checkpoint: str | None,
    checkpoint_every: int | None,
    resume: bool,
    precision: str,
    seed: int,
    data: str | None,
    compile_: bool,
    timeout_s: float,
    new_tokens: int,
    prompt_lens: str | None,
    prompts: str | None,
    attention: str,
    repeat: int,
    as_json: bool,
) -> None:
    """Run PLAN on worker processes and report measured against predicted.

    gpp/spp plans: every device of the plan is one process running one stage replica; it trains
    STEPS mini-batches (loss = mean of squared outputs; --optimizer, default SGD) and reports loss, iteration time,
    per-stage busy time and peak memory per step. cp plans: one process per device decodes the
    plan's batch greedily (NEW_TOKENS per request) and reports tokens/s and per-token latency.
    Exit codes: 0 done, 2 bad plan/model/data, 4 a worker failed (the rank and reason are printed).
    """
    if checkpoint is None and (resume or checkpoint_every is not None):
        raise click.UsageError("--resume and --checkpoint-every need --checkpoint DIR")
    if momentum and optimizer != "sgd":
        raise click.UsageError(f"--momentum is SGD's; {optimizer} keeps its own moments (betas)")
    if prompts is not None and prompt_lens is not None:
        raise click.UsageError("--prompts gives the requests' tokens, their lengths too: drop --prompt-lens")
    plan = load_plan(plan_path)
    _refuse_options_of_other_kinds(plan.kind)
    if isinstance(plan, GppPlan) and plan.predicted.get("cost_model") != "roofline":
        warn_if_timed_otherwise(
            plan, plan_path, optimizer, loss or default_loss(data), precision, max_grad_norm
        )
    if isinstance(plan, CpPlan):
        warn_if_stepped_otherwise(plan, plan_path, compile_)
    source = model or (plan.model.path if plan.model is not None else None)
    for flag, path in (("--save-model", save_model), ("--trace", trace)):
        if path is not None:  # before the run: a path that cannot be written loses nothing
            check_outputs({flag: path}, {"plan": plan_path, "model": source, "data": data})
            check_writable(path)
    runner = RUNNERS.get(plan.kind)
    if runner is None:
        raise InputError(
            f"launching a {plan.kind!r} plan is not available yet "
            f"(tessera launch runs {', '.join(RUNNERS)} plans)",
            source=plan_path,
        )
    request = LaunchRequest(
        plan_path=plan_path,
        graph=_checked_model(plan, plan_path, model),
        launch=LaunchOptions(
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            timeout_s=timeout_s,
        ),
        seed=seed,
        data=data,
        steps=steps,
        lr=lr,
        training={
            "optimizer": optimizer,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "lr_schedule": lr_schedule,
            "warmup_steps": warmup_steps,
            "max_grad_norm": max_grad_norm,
            "checkpoint": checkpoint,
            "checkpoint_every": checkpoint_every or 0,
            "resume": resume,
            "loss": loss or default_loss(data),
            "precision": precision,
        },
        compile=compile_,
        save_model=save_model,
        trace=trace,
        new_tokens=new_tokens,
        prompt_lens=_prompt_lens(prompt_lens),
        prompts=None if prompts is None else read_prompts(prompts),
        attention=attention,
        repeat=repeat,
    )
    report = runner(plan, request)
    if as_json:
        emit_json(report.to_json())
    else:
        click.echo(_SUMMARIES[plan.kind](report.to_json()))
    if report.failure is not None:
        raise LaunchError(report.failure)


def _checked_model(plan: Plan, plan_path: str, model: str | None) -> Graph | None:
    """The plan's model, loaded and checked against the plan (ONNX: its sha256); None for a cp plan
    made from --llm (its config file's sha256 checked when it can be read)."""
    if plan.model is None and model is not None:
        raise click.UsageError(
            "--model does not apply to a plan made from --llm (it runs seeded random weights)"
        )
    return plan_graph(plan, plan_path, model, warn=warn_line)


def _prompt_lens(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        lens = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        lens = ()
    if not lens:
        raise InputError(f"--prompt-lens {text!r}: expected integers such as 64,17,1")
    return lens


def read_prompts(path: str) -> tuple[tuple[int, ...], ...]:
    """``--prompts FILE``: one request per non-blank line, its token ids separated by spaces."""
    raw = read_user_file(path, what="prompts", limit=MAX_TEXT_BYTES)
    try:
        lines = [
            (i, line.split()) for i, line in enumerate(raw.decode("utf-8").splitlines(), 1) if line.strip()
        ]
    except UnicodeDecodeError:
        raise InputError("not a prompts file: not UTF-8 text", source=path) from None
    prompts = []
    for number, words in lines:
        bad = next((w for w in words if not w.isdigit() or len(w) > 12), None)
        if bad is not None:
            raise InputError(
                f"line {number}: {bad[:20]!r} is not a token id (a non-negative integer)", source=path
            )
        prompts.append(tuple(int(w) for w in words))
    if not prompts:
        raise InputError(
            "no prompts: expected one request per line, as space-separated token ids", source=path
        )
    return tuple(prompts)


def _captured(programs: dict[str, str | None]) -> str:
    """``, captured as a CUDA graph`` where every group's step was; else why one was not."""
    graphs = {k: v for k, v in programs.items() if k.startswith("cuda graph")}
    if not graphs:
        return ""
    failed = next((why for why in graphs.values() if why is not None), None)
    return ", captured as a CUDA graph" if failed is None else f", not captured ({failed})"


def _ratio(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None else "-"


def _summary(report: dict[str, Any]) -> str:
    t = report["training"]
    lines = [
        f"launched {report['kind']} plan {report['plan']}: {report['world_size']} rank(s) ({report['backend']}), "
        f"mini-batch {report['mini_batch_size']}, {t['steps']} step(s), {t['optimizer']}, data {t['data']}",
        f"{'step':>4} {'loss':>12} {'iteration':>11}  busy per stage",
    ]
    for s in report["steps"]:
        busy = "  ".join(f"{k}: {v * 1e3:.2f} ms" for k, v in s["busy_s"].items())
        lines.append(f"{s['step']:>4} {s['loss']:>12.6g} {s['iteration_s'] * 1e3:>8.2f} ms  {busy}")
    recomputes = any(st.get("recompute") for st in report["stages"])  # the column only where used
    zero = any(st.get("zero") for st in report["stages"])
    tp = any(st.get("tensor_parallel", 1) > 1 for st in report["stages"])
    lines.append(
        f"{'stage':>5} {'ranks':>7} {'busy':>10} {'predicted':>10} {'ratio':>7} {'peak mem':>10} "
        f"{'predicted':>10} {'ratio':>8}"
        + (f" {'recompute':>9}" if recomputes else "")
        + (f" {'zero':>4}" if zero else "")
        + (f" {'tp':>3}" if tp else "")
    )
    for st in report["stages"]:
        p_busy = st["predicted_busy_s"]
        lines.append(
            f"{st['id']:>5} {','.join(map(str, st['ranks'])):>7} {st['busy_s'] * 1e3:>7.2f} ms "
            f"{'-' if p_busy is None else f'{p_busy * 1e3:.2f} ms':>10} {_ratio(st['busy_ratio']):>7} "
            f"{human_bytes(st['peak_memory_bytes']):>10} {human_bytes(st['predicted_peak_memory_bytes']):>10} "
            f"{_ratio(st['memory_ratio']):>8}"
            + (f" {'yes' if st.get('recompute') else 'no':>9}" if recomputes else "")
            + (f" {st.get('zero', 0):>4}" if zero else "")
            + (f" {st.get('tensor_parallel', 1):>3}" if tp else "")
        )
    m, p, r = report["measured"], report["predicted"], report["ratio"]
    predicted = p.get("iteration_time_s")
    lines.append(
        f"iteration: measured {m['iteration_time_s'] * 1e3:.2f} ms"
        + (
            f", predicted {predicted * 1e3:.2f} ms (measured/predicted {r['iteration_time']:.2f}x)"
            if predicted
            else ", no prediction in the plan"
        )
        + f"; final loss {m['final_loss']:.6g}"
    )
    lines.append(_fidelity_line(report["fidelity"]))
    lines.append(
        "(busy: forward + backward compute, slowest replica, mean over steps after the first; "
        "peak mem: weights + gradients + optimizer state + activations in flight, slowest replica; "
        "on GPU the allocator's peak"
        + (
            "; recompute: the stage runs its forward again in the backward, keeping only its inputs"
            if recomputes
            else ""
        )
        + ("; zero 1: the replicas keep 1/d of the optimizer state each (ZeRO-1)" if zero else "")
        + ")"
    )
    return "\n".join(lines)


def _fidelity_line(fidelity: dict[str, Any]) -> str:
    """``fidelity: iteration +12% (median step +3%); stage 0 busy 4.26/3.90 ms, all-reduce …``
    (measured/predicted; the iteration: the mean step, and the typical one)."""

    def ms(part: dict[str, Any]) -> str:
        p = part["predicted_s"]
        return f"{part['measured_s'] * 1e3:.2f}/{'-' if p is None else f'{p * 1e3:.2f}'} ms"

    def pct(error: float | None) -> str:
        return "-" if error is None else f"{error:+.0%}"

    iteration = fidelity["iteration"]
    stages = "; ".join(
        f"stage {st['id']} busy {ms(st['busy'])}, all-reduce {ms(st['allreduce'])}, idle {ms(st['idle'])}"
        for st in fidelity["stages"]
    )
    return (
        f"fidelity (measured/predicted): iteration {pct(iteration['error'])} "
        f"(median step {pct(iteration['median_error'])}); {stages}"
    )


def _cp_summary(report: dict[str, Any]) -> str:
    d, m, p, r = report["decode"], report["measured"], report["predicted"], report["ratio"]
    lines = [
        f"launched cp plan {report['plan']}: {report['strategy'].upper()} x{report['degree']} "
        f"({report['backend']}), batch {d['batch']}, prompts {_lens(d['prompt_lens'])}, "
        f"{d['new_tokens']} tokens each (greedy), attention {d['attention']}, weights {d['weights']}",
        f"{'rank':>4} {'device':>22} {'requests':>9} {'kv pos':>7} {'step':>10} {'comm':>10}",
    ]
    for rk in report["ranks"]:
        lo, hi = rk["requests"]
        lines.append(
            f"{rk['rank']:>4} {rk['device']:>22} {f'{lo}-{hi}':>9} {rk['kv_positions']:>7} "
            f"{rk['step_s'] * 1e3:>7.3f} ms {rk['comm_s'] * 1e3:>7.3f} ms"
        )
    for key, label, unit, scale in (
        ("tokens_per_s", "tokens/s", "", 1.0),
        ("per_token_latency_s", "per-token latency", " ms", 1e3),
    ):
        got = m[key] * scale
        want = p.get(key)
        ratio = r.get("tokens_per_s" if key == "tokens_per_s" else "per_token_latency")
        lines.append(
            f"{label}: measured {got:.4g}{unit}"
            + (
                f", predicted {want * scale:.4g}{unit} (measured/predicted {_ratio(ratio)})"
                if want
                else ", no prediction in the plan"
            )
        )
    lines.append(
        f"time to first token {m['ttft_s'] * 1e3:.2f} ms; inter-token latency p50 {m['itl_p50_s'] * 1e3:.3f} "
        f"p90 {m['itl_p90_s'] * 1e3:.3f} p99 {m['itl_p99_s'] * 1e3:.3f} ms; output {m['output_throughput']:.4g} "
        f"tokens/s; decode step {d['step']}{_captured(d.get('programs', {}))} (compiled in {d['compile_s']:.2f} s, "
        "before the clock starts)"
    )
    lines.append(
        f"communication {m['communication_fraction'] * 100:.0f}% of a step; prefill {m['prefill_s'] * 1e3:.1f} ms "
        "(replicated, not in tokens/s); first request's tokens: "
        + " ".join(map(str, report["tokens"][0] if report["tokens"] else []))
    )
    return "\n".join(lines)


def _lens(lens: list[int]) -> str:
    shown = ",".join(map(str, lens[:8]))
    return shown + (f",… ({len(lens)})" if len(lens) > 8 else "")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _placement_summary(report: dict[str, Any]) -> str:
    m, p, verify = report["measured"], report["predicted"], report["verify"]
    ratio = report["ratio"]["latency"]
    return "\n".join(
        [
            f"launched placement plan {report['plan']}: {report['groups']} group(s) on "
            f"{', '.join(report['backends'])}, built in {report['build_s']:.2f} s; inputs {report['data']}",
            f"latency: measured {_ms(m['latency_s'])} (median of {m['rounds']} rounds)"
            + (
                f", predicted {_ms(p['latency_s'])} (measured/predicted {ratio:.2f}x)"
                if ratio is not None
                else ""
            )
            + f", measured by place {_ms(report['planned_measurement']['latency_s'])}",
            ("outputs match onnxruntime" if verify["ok"] else "OUTPUTS DIFFER")
            + f" ({worst_output(verify)})",
        ]
    )


# How each plan kind's report is printed without --json.
_SUMMARIES: dict[str, Callable[[dict[str, Any]], str]] = {
    "gpp": _summary,
    "spp": _summary,
    "cp": _cp_summary,
    "placement": _placement_summary,
}
