"""Host memory a CP launch's workers will allocate, estimated from the plan before any starts.

:func:`host_memory_need` adds up, per local rank, the decoder weights as built, the KV cache, the
prefill's activations, the KV layout and the worker process itself; :func:`check_host_memory`
refuses (exit 2) a launch that would not fit, rather than let the OOM killer stop it half-way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessera.core.errors import InputError
from tessera.core.plans import DENSE_FFN, CpPlan
from tessera.executor.kv_layout import KvLayout, request_slices
from tessera.executor.launcher import available_memory_bytes

WORKER_BASE_BYTES = 256 * 2**20
"""A worker's memory before it builds anything (interpreter, torch, gloo): a tiny plan's ranks
measure about 350 MiB of peak RSS, part of it shared libraries."""


def llm_ints(llm: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    """A plan's ``llm`` block as (layers, hidden, heads, kv_heads, head_dim, ffn, vocab)."""
    heads = int(llm["heads"])
    kv_heads = int(llm.get("kv_heads") or heads)
    head_dim = int(llm.get("head_dim") or int(llm["hidden"]) // heads)
    return (
        int(llm["layers"]), int(llm["hidden"]), heads, kv_heads, head_dim, int(llm["ffn"]), int(llm["vocab"]),
    )  # fmt: skip


def weight_elements(llm: dict[str, Any], positions: int | None) -> int:
    """Elements of the decoder's weights (fp32 whatever the plan's dtype; a tied LM head counted
    as a copy of its own: an upper estimate)."""
    layers, hidden, heads, kv_heads, head_dim, ffn, vocab = llm_ints(llm)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    ffn_matrices = 3 if llm.get("gated_ffn") else 2
    experts, shared = (int({**DENSE_FFN, **llm}[key]) for key in ("experts", "shared_ffn"))
    dense_layers, dense_ffn = int(llm.get("dense_layers", 0)), int(llm.get("dense_ffn", 0))
    # two norms (scale, bias), the biased Q, K and V projections, the output projection and its bias
    attention = 4 * hidden + (hidden + 1) * q_dim + 2 * (hidden + 1) * kv_dim + q_dim * hidden + hidden

    def ffn_of(width: int) -> int:  # one FFN's matrices and biases
        return ffn_matrices * hidden * width + (ffn_matrices - 1) * width

    experts_ffn = (
        experts * ffn_of(ffn)
        + (hidden * experts if experts > 1 else 0)  # the router
        + ffn_matrices * hidden * shared  # a shared expert
    )
    # ``dense_layers`` of the layers hold a dense FFN of width ``dense_ffn`` instead of the experts
    ffns = (layers - dense_layers) * experts_ffn + dense_layers * ffn_of(dense_ffn) + layers * hidden
    return layers * attention + ffns + 2 * vocab * hidden + 2 * hidden + (positions or 0) * hidden


def host_memory_need(
    plan: CpPlan,
    prompt_lens: Sequence[int],
    new_tokens: int,
    ranks: Sequence[int],
    *,
    layout: KvLayout | None,
    positions: int | None,
    on_gpu: bool,
) -> dict[str, int]:
    """Bytes the workers of ``ranks`` will allocate on this host, by what for (an upper estimate,
    computed from the plan without building anything): ``weights`` as built (fp32; the model is
    held while the torch module copies its tensors: twice), ``kv_cache`` (K and V as the graph hands
    them to attention: grouped-query heads repeated, so ``heads`` of them; a TP rank its share),
    ``prefill`` (one request's causal attention scores ``heads × S × S``, three live at once, its
    prompt's K/V and FFN activations),
    ``layout`` (each request's position owners) and ``workers`` (:data:`WORKER_BASE_BYTES` each).
    On a GPU the KV cache and the prefill live on the device, not here."""
    layers, hidden, heads, kv_heads, head_dim, ffn, _ = llm_ints(plan.llm)
    n = plan.degree
    built = 2 * 4 * weight_elements(plan.llm, positions)
    hq = hkv = heads // n if plan.strategy == "tp" else heads
    total = [p + new_tokens - 1 for p in prompt_lens]
    slices = request_slices(len(total), plan.degree)
    need = {"weights": 0, "kv_cache": 0, "prefill": 0, "layout": 0, "workers": 0}
    for rank in ranks:
        cached = range(*slices[rank]) if plan.strategy == "dp" else range(len(total))
        if layout is not None:
            cap = max((layout.most_held(rank, total[b]) for b in cached), default=0)
        else:
            cap = max((total[b] for b in cached), default=0)
        s = max((prompt_lens[b] for b in cached), default=0)
        need["weights"] += built
        need["layout"] += 8 * sum(total[b] for b in cached)
        need["workers"] += WORKER_BASE_BYTES
        if not on_gpu:
            need["kv_cache"] += 2 * layers * len(cached) * hkv * max(cap, 1) * head_dim * 4
            scores = 3 * hq * s * s  # q·kᵀ, masked, softmax: [heads, S, S] each
            kv_and_ffn = 4 * layers * hkv * s * head_dim + 2 * s * max(ffn, hidden, hq * head_dim)
            need["prefill"] += 4 * (scores + kv_and_ffn) + s * s  # and the [S, S] causal mask
    return need


def check_host_memory(need: dict[str, int], plan_path: str) -> None:
    """Refuse (InputError, exit 2) a launch whose workers would allocate more than this host has
    available: better than the OOM killer stopping a worker (or the machine) half-way."""
    from tessera.core.units import format_bytes

    available = available_memory_bytes()
    total = sum(need.values())
    if available is None or total <= available:
        return
    parts = ", ".join(f"{what.replace('_', ' ')} {format_bytes(n)}" for what, n in need.items() if n)
    raise InputError(
        f"the workers on this host would need about {format_bytes(total)} of memory ({parts}) but "
        f"{format_bytes(available)} is available; give a smaller model, shorter --prompt-lens or "
        "fewer --new-tokens, or run the plan over more nodes",
        source=plan_path,
    )
