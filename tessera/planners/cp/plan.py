"""``plan_cp``: choose how to parallelize LLM decoding over a cluster, and write it as a CP plan.

Every strategy (CP, TP, DP; thesis ch. 4) at every degree the cluster offers is predicted by
:mod:`tessera.planners.cp.cost`; the plan is the feasible one with the most tokens/s (ties: fewer
devices, then TP, CP, DP), and lists all others under ``alternatives``. The plan names the devices'
KV-cache sequence ranges (``kv_shards``, block-aligned) and the collectives every layer runs.

:func:`sweep_context` repeats the prediction over context lengths: the thesis's Fig. 4.2 question,
which strategy wins as the prompt grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.core.errors import InfeasibleError, InputError
from tessera.core.kv_blocks import block_aligned_split
from tessera.core.plans import CpPlan, KvShard, LlmConfigRef, ModelRef
from tessera.core.specs import ClusterSpec
from tessera.planners.cp.cost import STRATEGIES, CostParams, Estimate, Strategy, estimate_all
from tessera.planners.cp.llm import LlmConfig, LlmSource
from tessera.planners.cp.serving import serving_configs
from tessera.planners.cp.workload import MAX_TOKENS, OutputLengths, Workload

__all__ = ["SweepRow", "best_estimate", "plan_cp", "plan_cp_request", "sweep_context", "sweep_to_json"]


def best_estimate(
    estimates: list[Estimate], *, strategy: str | None = None, degree: int | None = None
) -> Estimate | None:
    """The feasible estimate with the most tokens/s (ties: fewer devices, then TP, CP, DP order),
    of ``strategy`` and at ``degree`` when given."""
    feasible = [
        e for e in estimates if e.feasible and strategy in (None, e.strategy) and degree in (None, e.degree)
    ]
    if not feasible:
        return None
    return min(feasible, key=lambda e: (-e.tokens_per_s, e.degree, STRATEGIES.index(e.strategy)))


def plan_cp(  # noqa: PLR0913 - the --kind cp options
    llm: LlmConfig,
    cluster: ClusterSpec,
    workload: Workload,
    *,
    model: ModelRef | None = None,
    source: LlmSource | None = None,
    layers: int | None = None,
    params: CostParams | None = None,
    strategy: str | None = None,
    degree: int | None = None,
) -> CpPlan:
    """The best decode parallelization of ``llm`` for ``workload`` on ``cluster`` (thesis ch. 4).

    Parameters: the LLM (recognized from ``model`` or read from ``source``), the cluster, the
    workload; ``layers`` evaluates that many layers without embedding and LM head (the thesis's
    per-layer measurement, §4.5.1). Returns a :class:`CpPlan`. Raises
    :class:`~tessera.core.errors.InfeasibleError` when no strategy fits in device memory, naming the
    smallest memory one would need. ``strategy`` (cp, tp or dp) and ``degree`` restrict the choice
    (``plan --strategy``/``--degree``); InputError when the cluster offers no such degree.
    """
    p = params or CostParams()
    if layers is not None and not 1 <= layers <= llm.layers:
        raise ValueError(f"layers must be in 1..{llm.layers}; got {layers}")
    estimates = estimate_all(llm, cluster, workload, layers=layers, params=p)
    chosen = [e for e in estimates if strategy in (None, e.strategy) and degree in (None, e.degree)]
    if not chosen:
        offered = sorted({e.degree for e in estimates})
        raise InputError(f"--degree {degree}: the cluster offers degrees {', '.join(map(str, offered))}")
    best = best_estimate(chosen)
    if best is None:
        raise InfeasibleError(_infeasible_message(chosen, workload))
    return CpPlan(
        model=model,
        llm_config=None
        if model is not None or source is None or source.kind == "onnx"
        else LlmConfigRef(kind=source.kind, path=source.path, sha256=source.sha256),  # type: ignore[arg-type]
        cluster=cluster.to_json_dict(),
        predicted={
            **{
                k: v
                for k, v in best.summary().items()
                if k not in ("strategy", "degree", "feasible", "reason")
            },
            "layers_evaluated": llm.layers if layers is None else layers,
            "per_layer": layers is not None,
            "cost_model": p.to_json(),
        },
        strategy=best.strategy,
        degree=best.degree,
        llm={**llm.to_json(), "source": None if source is None else source.model_dump()},
        workload={
            **workload.to_json(),
            "kv_split": best.kv_split,
            **({"expert_split": best.expert_split} if best.expert_split else {}),
            "devices": list(best.devices),
        },
        kv_shards=_kv_shards(best, workload, p.kv_block),
        collectives=[c.to_json() for c in best.collectives],
        alternatives=[e.summary() for e in estimates if e is not best],
        serving=serving_configs(best.strategy, best.degree, llm.heads, int(llm.kv_heads or llm.heads)),
    )


def _kv_shards(best: Estimate, workload: Workload, block: int) -> list[KvShard]:
    """Each device's range of prompt positions: a block-aligned split for CP, everything otherwise.

    TP devices hold every position (for their heads); a DP replica holds every position of its own
    requests. CP devices hold consecutive block-aligned ranges; blocks of generated tokens continue
    to be dealt out so the shards stay within one block of each other.
    """
    if best.strategy == "cp":
        ranges = block_aligned_split(workload.context, best.degree, block=block)
    else:
        ranges = [(0, workload.context)] * best.degree
    return [KvShard(device=d, start=a, stop=b) for d, (a, b) in zip(best.devices, ranges, strict=True)]


def _infeasible_message(estimates: list[Estimate], workload: Workload) -> str:
    memory_bound = [e for e in estimates if e.memory_bytes > e.capacity_bytes]
    if not memory_bound:  # each fits in memory and cannot run for another reason: say that first
        return "no strategy fits: " + "; ".join(f"{e.label}: {e.reason}" for e in estimates)
    smallest = min(memory_bound, key=lambda e: (e.memory_bytes, e.degree, STRATEGIES.index(e.strategy)))
    return (
        f"no strategy fits: batch {workload.batch} at up to {workload.max_kv_length} KV positions per request "
        f"needs at least {smallest.memory_bytes / 2**30:.2f} GiB per device ({smallest.label}: weights "
        f"{smallest.weights_bytes / 2**30:.2f} GiB, KV cache {smallest.kv_cache_bytes / 2**30:.2f} GiB); "
        f"the devices have {smallest.capacity_bytes / 2**30:.2f} GiB"
    )


# -- context sweep --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepRow:
    """One context length: each strategy's best feasible degree (None when none fits)."""

    context: int
    best: dict[Strategy, Estimate | None]

    @property
    def winner(self) -> Strategy | None:
        found = best_estimate([e for e in self.best.values() if e is not None])
        return None if found is None else found.strategy


def sweep_context(
    llm: LlmConfig,
    cluster: ClusterSpec,
    workload: Workload,
    contexts: list[int],
    *,
    layers: int | None = None,
    params: CostParams | None = None,
) -> list[SweepRow]:
    """Tokens/s of each strategy's best degree at each context length (thesis Fig. 4.2)."""
    rows = []
    for context in contexts:
        estimates = estimate_all(llm, cluster, workload.with_context(context), layers=layers, params=params)
        rows.append(
            SweepRow(
                context=context,
                best={s: best_estimate([e for e in estimates if e.strategy == s]) for s in STRATEGIES},
            )
        )
    return rows


def sweep_to_json(rows: list[SweepRow]) -> list[dict[str, Any]]:
    return [
        {
            "context": row.context,
            "winner": row.winner,
            "strategies": {
                s: None
                if e is None
                else {
                    "degree": e.degree,
                    "tokens_per_s": e.summary()["tokens_per_s"],
                    "per_token_latency_s": e.summary()["per_token_latency_s"],
                }
                for s, e in row.best.items()
            },
        }
        for row in rows
    ]


def plan_cp_request(  # noqa: PLR0913
    llm: LlmConfig,
    cluster: ClusterSpec,
    *,
    batch: int,
    context: int | None,
    output_lengths: OutputLengths,
    sweep_contexts: list[int] | None = None,
    layers: int | None = None,
    model: ModelRef | None = None,
    source: LlmSource | None = None,
    positions: int | None = None,
    strategy: str | None = None,
    degree: int | None = None,
    params: CostParams | None = None,
) -> tuple[CpPlan | None, list[SweepRow]]:
    """What ``tessera plan --kind cp`` asks: the plan at ``context`` (None: the sweep alone) and the
    prediction at each of ``sweep_contexts``. ``positions``: the model's position table, when it has
    one. InputError when ``layers`` is out of range or a request would hold more positions than the
    model or the executor can (a request feeds back all but its last token: context + output − 1)."""
    contexts = sweep_contexts or []
    if layers is not None and not 1 <= layers <= llm.layers:
        raise InputError(f"--layers: must be in 1..{llm.layers} (the model's layers); got {layers}")
    base_context = context if context is not None else contexts[0]
    workload = Workload(batch, base_context, output_lengths)
    widest = max([base_context, *contexts])
    longest = widest + output_lengths.max - 1
    needs = f"context {widest} plus output lengths up to {output_lengths.max} needs {longest} positions"
    if positions is not None and longest > positions:
        raise InputError(
            f"{needs}, but the model holds {positions} positions (its position tables' rows): give a shorter --context or --output-len",
            source=model.path if model is not None else None,
        )
    if longest > MAX_TOKENS:  # what launch can decode (and what a plan's context may be)
        raise InputError(f"{needs}; a request may hold at most {MAX_TOKENS} (1024M)")
    plan = None
    if context is not None:
        plan = plan_cp(
            llm,
            cluster,
            workload,
            model=model,
            source=source,
            layers=layers,
            params=params,
            strategy=strategy,
            degree=degree,
        )
    rows = sweep_context(llm, cluster, workload, contexts, layers=layers, params=params) if contexts else []
    return plan, rows
