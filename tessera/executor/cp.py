"""CP decode workers: run a cache-parallel (or TP / DP) LLM decode plan on torch.distributed ranks.

The plan is data; this module only interprets it. Rank ``r`` is the plan's ``r``-th device
(``workload.devices``, the order of ``kv_shards``). ``B`` requests with prompts of their own lengths
are prefilled, then decoded greedily (argmax), one token per request per step, for ``new_tokens``
tokens each (the first from the prefill, the rest from ``new_tokens - 1`` decode steps).

Strategies (thesis ch. 4; :mod:`tessera.planners.cp.cost` predicts the same three):

- ``cp`` (§4.4): every rank holds a *sequence shard* of every request's KV cache: the positions of the
  plan's ``kv_shards`` range; positions past the plan's context (generated tokens, longer prompts)
  go on in whole ``kv_block`` blocks — first the rest of the last, partial block, then each block
  to the shard holding the fewest positions (ties: the lower rank) — so shards stay within one block
  of each other (:class:`KvLayout`). A short request has empty shards on the later ranks. The
  projections and the FFN are data-parallel over requests: rank ``r`` owns a contiguous slice of the
  requests (``numpy.array_split`` sizes). Per layer and step:

  1. the owner computes its requests' Q, K, V (after ``ln1``);
  2. **all-gather** of Q/K/V (``torch.distributed.all_gather``, slices padded to the largest);
  3. the rank that owns the new token's position appends its K/V to its shard; every rank attends
     all ``B`` queries to its shard: :func:`tessera.kernels.decode_attention_partial` →
     ``(o, lse)``, ``o = 0, lse = -inf`` where the shard is empty for a request;
  4. **all-to-all** of the partials (``all_to_all_single`` with uneven split sizes: gloo supports
     it): each rank receives its requests' ``(o, lse)`` from every shard;
  5. exact log-sum-exp merge (:func:`tessera.kernels.merge_partials`), output projection, FFN.

- ``dp`` (§4.2.3): requests split over the ranks as above, each rank decodes its own requests with
  their whole KV cache; no communication.
- ``tp`` (§4.2.3, Megatron): every rank runs all requests on ``heads / N`` query heads and
  ``kv_heads / N`` KV heads (the KV cache of those heads, all positions) and ``ffn / N`` FFN
  columns; the output projection's and FFN-down's partial sums are **all-reduced** (their biases
  added by rank 0 only). Embedding, norms and LM head are replicated.

``cp+tp`` plans are refused (:class:`InputError`).

Prefill: every rank computes the whole prompt of every request it keeps KV for (replicated: cp and
tp ranks all requests, dp ranks their own) with plain causal attention, and keeps its part of the
KV cache: its positions (cp), its heads (tp), its requests (dp). No prefill communication; it is
timed separately and not part of tokens/s (the plans predict the decode step).

Weights: from the ONNX model the plan names — the zoo GPT layout (:func:`onnx_decoder_weights`
states the initializer-name mapping and refuses a model it cannot map) — or, for a plan made from
an ``--llm`` config, seeded random weights of that shape (:func:`random_decoder_weights`). Both are
GPT-2-style pre-norm decoders computed in fp32 whatever the plan's dtype (the dtype only changes the
prediction).

Exactness: :func:`reference_decode` is the single-process ground truth (per request, full KV cache,
a plain masked softmax); the distributed run must produce the same tokens.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from tessera.core.errors import InputError
from tessera.core.plans import CpPlan
from tessera.executor.launcher import (
    WATCHDOG_FACTOR,
    LaunchOptions,
    Watchdog,
    available_memory_bytes,
    choose_backend,
    inject_test_fault,
    launch_workers,
    local_ranks,
    memory_status,
    worker_setup,
)
from tessera.planners.cp.workload import MAX_TOKENS

__all__ = [
    "CpRun",
    "DecodeOptions",
    "DecoderWeights",
    "KvLayout",
    "LayerWeights",
    "decoder_weights",
    "make_prompts",
    "onnx_decoder_weights",
    "random_decoder_weights",
    "reference_decode",
    "run_cp_plan",
]

SUPPORTED_STRATEGIES = ("cp", "tp", "dp")
DEFAULT_KV_BLOCK = 16


@dataclass(frozen=True)
class DecodeOptions:
    """One decode run: ``new_tokens`` generated per request; ``prompt_lens`` per request (None:
    every request has the plan's context; fewer than the batch are repeated cyclically); the
    ``seed`` of the prompts' token ids (and of the weights of an ``--llm`` plan); the shard
    attention implementation (``torch`` reference or ``triton``)."""

    new_tokens: int = 8
    prompt_lens: tuple[int, ...] | None = None
    seed: int = 0
    attention: str = "torch"


# -- the decoder: weights and math shared by the reference and the workers ------------------------


@dataclass
class LayerWeights:
    """One pre-norm transformer layer. Matrices are ``[in, out]`` (ONNX MatMul layout)."""

    ln1: tuple[Tensor, Tensor]
    wq: Tensor
    bq: Tensor
    wk: Tensor
    bk: Tensor
    wv: Tensor
    bv: Tensor
    wo: Tensor
    bo: Tensor
    ln2: tuple[Tensor, Tensor]
    w_up: Tensor
    b_up: Tensor
    w_down: Tensor
    b_down: Tensor
    w_gate: Tensor | None = None  # SwiGLU: down(silu(gate(h)) * up(h)); else down(gelu(up(h)))
    b_gate: Tensor | None = None


@dataclass
class DecoderWeights:
    """A GPT-2-style decoder: token (+ learned or sinusoidal position) embedding, layers, final norm,
    LM head. ``position_embedding`` None means sinusoidal positions (no length limit)."""

    heads: int
    kv_heads: int
    head_dim: int
    token_embedding: Tensor  # [vocab, hidden]
    position_embedding: Tensor | None  # [max positions, hidden]
    layers: list[LayerWeights]
    final_norm: tuple[Tensor, Tensor]
    lm_head: Tensor  # [hidden, vocab]
    epsilon: float = 1e-5
    source: str = ""

    @property
    def hidden(self) -> int:
        return int(self.token_embedding.shape[1])

    @property
    def vocab(self) -> int:
        return int(self.lm_head.shape[1])

    @property
    def max_positions(self) -> int | None:
        return None if self.position_embedding is None else int(self.position_embedding.shape[0])

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def nbytes(self) -> int:
        tensors = [self.token_embedding, self.lm_head, *self.final_norm]
        if self.position_embedding is not None:
            tensors.append(self.position_embedding)
        for layer in self.layers:
            tensors.extend(t for t in vars(layer).values() if isinstance(t, Tensor))
            tensors.extend([*layer.ln1, *layer.ln2])
        return sum(t.numel() * t.element_size() for t in tensors)


def _sinusoidal(positions: Tensor, hidden: int) -> Tensor:
    """Vaswani et al. (2017) §3.5 position encodings ``[n, hidden]`` (for ``--llm`` plans)."""
    half = (hidden + 1) // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    angles = positions.to(torch.float64)[:, None] * freq[None, :]
    table = torch.cat([angles.sin(), angles.cos()], dim=1)[:, :hidden]
    return table.to(torch.float32)


def embed(w: DecoderWeights, tokens: Tensor, positions: Tensor) -> Tensor:
    """``[n]`` token ids at ``[n]`` positions -> ``[n, hidden]``."""
    x = w.token_embedding[tokens]
    if w.position_embedding is not None:
        return x + w.position_embedding[positions]
    return x + _sinusoidal(positions, w.hidden).to(x.device)


def _norm(w: DecoderWeights, x: Tensor, params: tuple[Tensor, Tensor]) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), params[0], params[1], w.epsilon)


def qkv(w: DecoderWeights, layer: LayerWeights, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``ln1`` and the Q, K, V projections: ``[n, Hq, D]``, ``[n, Hkv, D]``, ``[n, Hkv, D]``
    (head counts are those of ``layer``'s matrices: all heads, or a TP rank's)."""
    h = _norm(w, x, layer.ln1)
    n, d = x.shape[0], w.head_dim
    q = (h @ layer.wq + layer.bq).reshape(n, layer.wq.shape[1] // d, d)
    k = (h @ layer.wk + layer.bk).reshape(n, layer.wk.shape[1] // d, d)
    v = (h @ layer.wv + layer.bv).reshape(n, layer.wv.shape[1] // d, d)
    return q, k, v


def attention_out(layer: LayerWeights, attn: Tensor) -> Tensor:
    """The output projection of ``[n, Hq·D]`` attention outputs."""
    return attn @ layer.wo + layer.bo


def feed_forward(w: DecoderWeights, layer: LayerWeights, x: Tensor) -> Tensor:
    """``ln2`` and the FFN (GELU, exact erf form as the zoo GPT; SwiGLU when gated)."""
    h = _norm(w, x, layer.ln2)
    up = h @ layer.w_up + layer.b_up
    if layer.w_gate is not None:
        assert layer.b_gate is not None
        up = F.silu(h @ layer.w_gate + layer.b_gate) * up
    else:
        up = F.gelu(up)
    return up @ layer.w_down + layer.b_down


def lm_logits(w: DecoderWeights, x: Tensor) -> Tensor:
    return _norm(w, x, w.final_norm) @ w.lm_head


def _causal_attention(w: DecoderWeights, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Plain causal softmax attention of a whole sequence: q ``[S, Hq, D]``, k/v ``[S, Hkv, D]`` ->
    ``[S, Hq·D]`` (KV heads repeated to the query heads, GQA)."""
    s, hq, d = q.shape
    group = hq // k.shape[1]
    kr = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    vr = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.transpose(0, 1) @ kr.transpose(1, 2)) * w.scale  # [Hq, S, S]
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return (probs @ vr).transpose(0, 1).reshape(s, hq * d)


def prefill(
    w: DecoderWeights, prompt: Tensor, reduce: Callable[[Tensor], Tensor] = lambda t: t
) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """Run one request's prompt ``[S]`` through the decoder (causal): the last position's logits
    ``[vocab]`` and every layer's K, V ``[Hkv, S, D]``. ``reduce`` sums TP partial results."""
    positions = torch.arange(prompt.shape[0], device=prompt.device)
    x = embed(w, prompt, positions)
    cache = []
    for layer in w.layers:
        q, k, v = qkv(w, layer, x)
        cache.append((k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()))
        x = x + reduce(attention_out(layer, _causal_attention(w, q, k, v)))
        x = x + reduce(feed_forward(w, layer, x))
    return lm_logits(w, x[-1:])[0], cache


@torch.no_grad()
def reference_decode(w: DecoderWeights, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """The single-process ground truth: each request alone, its whole KV cache, plain softmax
    attention over it; greedy (argmax, first index on ties). Returns ``new_tokens`` ids per request."""
    out: list[list[int]] = []
    for prompt in prompts:
        logits, cache = prefill(w, torch.tensor(list(prompt), dtype=torch.long))
        tokens = [int(torch.argmax(logits))]
        ks = [k for k, _ in cache]
        vs = [v for _, v in cache]
        position = len(prompt)
        while len(tokens) < new_tokens:
            x = embed(w, torch.tensor([tokens[-1]]), torch.tensor([position]))
            for i, layer in enumerate(w.layers):
                q, k, v = qkv(w, layer, x)  # [1, H, D]
                ks[i] = torch.cat([ks[i], k.transpose(0, 1)], dim=1)  # [Hkv, S+1, D]
                vs[i] = torch.cat([vs[i], v.transpose(0, 1)], dim=1)
                group = w.heads // w.kv_heads
                kr = ks[i].repeat_interleave(group, dim=0)  # [Hq, S+1, D]
                vr = vs[i].repeat_interleave(group, dim=0)
                probs = torch.softmax(torch.einsum("hd,hsd->hs", q[0], kr) * w.scale, dim=-1)
                attn = torch.einsum("hs,hsd->hd", probs, vr).reshape(1, -1)
                x = x + attention_out(layer, attn)
                x = x + feed_forward(w, layer, x)
            tokens.append(int(torch.argmax(lm_logits(w, x)[0])))
            position += 1
        out.append(tokens)
    return out


# -- weights ---------------------------------------------------------------------------------------


def _llm_ints(llm: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    heads = int(llm["heads"])
    kv_heads = int(llm.get("kv_heads") or heads)
    head_dim = int(llm.get("head_dim") or int(llm["hidden"]) // heads)
    return (
        int(llm["layers"]),
        int(llm["hidden"]),
        heads,
        kv_heads,
        head_dim,
        int(llm["ffn"]),
        int(llm["vocab"]),
    )


def onnx_decoder_weights(model_path: str | os.PathLike[str], llm: dict[str, Any]) -> DecoderWeights:
    """The weights of a zoo GPT (:mod:`tessera.models.gpt`) by initializer name::

        embed/token/weight [V, E]         token embedding      embed/position/weight [P, E]  positions
        layer{i}/ln1/{scale,bias}         ln1                  layer{i}/ln2/{scale,bias}     ln2
        layer{i}/attn/{q,k,v,out}/weight  projections [in, out], with .../bias
        layer{i}/ffn/fc1/{weight,bias}    up [E, F]            layer{i}/ffn/fc2/{weight,bias} down [F, E]
        final_norm/{scale,bias}           final norm           lm_head/weight [E, V]        LM head

    with ``i`` in ``0..layers-1`` and the shapes of the plan's ``llm`` (layers, hidden, heads,
    kv_heads, head_dim, ffn, vocab); the FFN is the exact-erf GELU, the norm epsilon the first
    ``LayerNormalization``'s. Raises :class:`InputError` naming what is missing or misshapen when
    the model is not laid out so (another exporter's decoder: re-export it from the zoo layout).
    """
    import onnx
    from onnx import numpy_helper

    from tessera.core.weights import is_lazy

    path = str(model_path)
    try:
        model = onnx.load(path)
    except Exception as exc:  # noqa: BLE001 - onnx raises several types for unreadable files
        raise InputError(f"cannot read the model: {exc}", source=path) from None
    if is_lazy(model):
        raise InputError(
            "the model's weights are lazy placeholders (a paper-size zoo build): materialize them first",
            source=path,
        )
    layers, hidden, heads, kv_heads, head_dim, ffn, vocab = _llm_ints(llm)
    inits = {t.name: t for t in model.graph.initializer}
    expected: dict[str, tuple[int, ...]] = {
        "embed/token/weight": (vocab, hidden),
        "final_norm/scale": (hidden,),
        "final_norm/bias": (hidden,),
        "lm_head/weight": (hidden, vocab),
    }
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"layer{i}"
        for norm in ("ln1", "ln2"):
            expected[f"{p}/{norm}/scale"] = (hidden,)
            expected[f"{p}/{norm}/bias"] = (hidden,)
        for proj, width in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
            expected[f"{p}/attn/{proj}/weight"] = (hidden, width)
            expected[f"{p}/attn/{proj}/bias"] = (width,)
        expected[f"{p}/attn/out/weight"] = (q_dim, hidden)
        expected[f"{p}/attn/out/bias"] = (hidden,)
        expected[f"{p}/ffn/fc1/weight"] = (hidden, ffn)
        expected[f"{p}/ffn/fc1/bias"] = (ffn,)
        expected[f"{p}/ffn/fc2/weight"] = (ffn, hidden)
        expected[f"{p}/ffn/fc2/bias"] = (hidden,)
    problems = []
    for name, shape in expected.items():
        if name not in inits:
            problems.append(f"no initializer {name!r}")
        elif tuple(inits[name].dims) != shape:
            problems.append(f"initializer {name!r} is {list(inits[name].dims)}, expected {list(shape)}")
    position = inits.get("embed/position/weight")
    if position is None or len(position.dims) != 2 or position.dims[1] != hidden:
        problems.append("no position table 'embed/position/weight' [positions, hidden]")
    if f"layer{layers}/ln1/scale" in inits:
        problems.append(f"the model has more than the plan's {layers} layers")
    gelu = {n.op_type for n in model.graph.node if n.name.startswith("layer0/ffn/gelu/")}
    if not problems and "Erf" not in gelu:
        problems.append("layer0/ffn has no exact (Erf) GELU")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InputError(
            f"cannot map the model's weights to a decoder: {problems[0]}{more}; the executor runs "
            "decoders laid out like the zoo GPT (tessera zoo build gpt)",
            source=path,
        )
    epsilon = 1e-5
    for node in model.graph.node:
        if node.op_type == "LayerNormalization":
            epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
            break

    def t(name: str) -> Tensor:
        return torch.from_numpy(numpy_helper.to_array(inits[name]).astype(np.float32).copy())

    def pair(prefix: str) -> tuple[Tensor, Tensor]:
        return t(f"{prefix}/scale"), t(f"{prefix}/bias")

    return DecoderWeights(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        token_embedding=t("embed/token/weight"),
        position_embedding=t("embed/position/weight"),
        layers=[
            LayerWeights(
                ln1=pair(f"layer{i}/ln1"),
                wq=t(f"layer{i}/attn/q/weight"),
                bq=t(f"layer{i}/attn/q/bias"),
                wk=t(f"layer{i}/attn/k/weight"),
                bk=t(f"layer{i}/attn/k/bias"),
                wv=t(f"layer{i}/attn/v/weight"),
                bv=t(f"layer{i}/attn/v/bias"),
                wo=t(f"layer{i}/attn/out/weight"),
                bo=t(f"layer{i}/attn/out/bias"),
                ln2=pair(f"layer{i}/ln2"),
                w_up=t(f"layer{i}/ffn/fc1/weight"),
                b_up=t(f"layer{i}/ffn/fc1/bias"),
                w_down=t(f"layer{i}/ffn/fc2/weight"),
                b_down=t(f"layer{i}/ffn/fc2/bias"),
            )
            for i in range(layers)
        ],
        final_norm=pair("final_norm"),
        lm_head=t("lm_head/weight"),
        epsilon=float(epsilon),
        source=f"onnx:{path}",
    )


def random_decoder_weights(llm: dict[str, Any], seed: int = 0) -> DecoderWeights:
    """Seeded random weights of the plan's ``llm`` shape (``--llm`` plans have no weights).

    One ``torch.Generator(seed)`` draws every tensor in a fixed order, so every process gets the
    same weights. Matrices ~ N(0, 1/fan_in) and embeddings ~ N(0, 1) keep activations and logits
    O(1) (clear argmax margins); biases ~ N(0, 0.02²); norms are identity; sinusoidal positions;
    SwiGLU when ``gated_ffn``; the LM head is the token embedding transposed when ``tied_embeddings``.
    """
    layers, hidden, heads, kv_heads, head_dim, ffn, vocab = _llm_ints(llm)
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> Tensor:
        return torch.randn(*shape, generator=gen) * std

    def matrix(rows: int, cols: int) -> Tensor:
        return normal(rows, cols, std=1.0 / math.sqrt(rows))

    def bias(n: int) -> Tensor:
        return normal(n, std=0.02)

    def norm() -> tuple[Tensor, Tensor]:
        return torch.ones(hidden), torch.zeros(hidden)

    gated = bool(llm.get("gated_ffn", False))
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    token = normal(vocab, hidden, std=1.0)
    blocks = []
    for _ in range(layers):
        blocks.append(
            LayerWeights(
                ln1=norm(),
                wq=matrix(hidden, q_dim),
                bq=bias(q_dim),
                wk=matrix(hidden, kv_dim),
                bk=bias(kv_dim),
                wv=matrix(hidden, kv_dim),
                bv=bias(kv_dim),
                wo=matrix(q_dim, hidden),
                bo=bias(hidden),
                ln2=norm(),
                w_up=matrix(hidden, ffn),
                b_up=bias(ffn),
                w_down=matrix(ffn, hidden),
                b_down=bias(hidden),
                w_gate=matrix(hidden, ffn) if gated else None,
                b_gate=bias(ffn) if gated else None,
            )
        )
    tied = bool(llm.get("tied_embeddings", False))
    head = token.t().contiguous() / math.sqrt(hidden) if tied else matrix(hidden, vocab)
    return DecoderWeights(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        token_embedding=token,
        position_embedding=None,
        layers=blocks,
        final_norm=norm(),
        lm_head=head,
        source=f"seeded random (seed {seed})",
    )


def decoder_weights(plan: CpPlan, model_path: str | None, seed: int = 0) -> DecoderWeights:
    """The weights a plan decodes with: its ONNX model's, or seeded random ones for ``--llm``."""
    if plan.model is not None:
        if model_path is None:
            raise InputError("the plan names an ONNX model; give its path")
        return onnx_decoder_weights(model_path, plan.llm)
    return random_decoder_weights(plan.llm, seed)


def tp_shard(w: DecoderWeights, rank: int, n: int) -> DecoderWeights:
    """Rank ``rank``'s tensor-parallel share: query heads ``[r·Hq/N, (r+1)·Hq/N)`` and their KV heads
    (GQA groups stay whole), FFN columns ``numpy.array_split``; biases of the all-reduced outputs on
    rank 0 only, so the sum adds them once."""
    d = w.head_dim
    hq, hkv = w.heads // n, w.kv_heads // n
    qs = slice(rank * hq * d, (rank + 1) * hq * d)
    ks = slice(rank * hkv * d, (rank + 1) * hkv * d)
    layers = []
    for layer in w.layers:
        ffn = layer.w_up.shape[1]
        lo = sum(len(c) for c in np.array_split(np.arange(ffn), n)[:rank])
        fs = slice(lo, lo + len(np.array_split(np.arange(ffn), n)[rank]))
        keep = rank == 0
        layers.append(
            LayerWeights(
                ln1=layer.ln1,
                wq=layer.wq[:, qs].contiguous(),
                bq=layer.bq[qs].contiguous(),
                wk=layer.wk[:, ks].contiguous(),
                bk=layer.bk[ks].contiguous(),
                wv=layer.wv[:, ks].contiguous(),
                bv=layer.bv[ks].contiguous(),
                wo=layer.wo[qs].contiguous(),
                bo=layer.bo if keep else torch.zeros_like(layer.bo),
                ln2=layer.ln2,
                w_up=layer.w_up[:, fs].contiguous(),
                b_up=layer.b_up[fs].contiguous(),
                w_down=layer.w_down[fs].contiguous(),
                b_down=layer.b_down if keep else torch.zeros_like(layer.b_down),
                w_gate=None if layer.w_gate is None else layer.w_gate[:, fs].contiguous(),
                b_gate=None if layer.b_gate is None else layer.b_gate[fs].contiguous(),
            )
        )
    return replace(w, heads=hq, kv_heads=hkv, layers=layers)


def make_prompts(vocab: int, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Request ``b``'s prompt: ``lengths[b]`` ids uniform in ``[0, vocab)`` from
    ``numpy.random.default_rng([seed, b])`` (the same in every process)."""
    return [
        np.random.default_rng([seed, b]).integers(0, vocab, size=n).tolist() for b, n in enumerate(lengths)
    ]


# -- who holds what ----------------------------------------------------------------------------------


class KvLayout:
    """The rank holding each KV position of a request under cache parallelism (see the module
    docstring): the plan's ``kv_shards`` ranges, then whole blocks to the least-loaded shard."""

    def __init__(self, shards: Sequence[tuple[int, int]], block: int = DEFAULT_KV_BLOCK) -> None:
        starts = [a for a, _ in shards]
        if not shards or starts[0] != 0 or any(b < a for a, b in shards):
            raise InputError(f"kv_shards {list(shards)} must be ranges [start, stop) starting at 0")
        if any(shards[i][1] != shards[i + 1][0] for i in range(len(shards) - 1)):
            raise InputError(f"kv_shards {list(shards)} must be consecutive ranges along the sequence")
        if block < 1:
            raise InputError(f"kv_block {block} must be at least 1")
        self.shards = [(int(a), int(b)) for a, b in shards]
        self.block = block
        self.context = self.shards[-1][1]
        self._owner = np.concatenate(
            [np.full(b - a, r, dtype=np.int64) for r, (a, b) in enumerate(self.shards)]
            or [np.zeros(0, np.int64)]
        )
        self._held = np.array([b - a for a, b in self.shards], dtype=np.int64)

    @property
    def world_size(self) -> int:
        return len(self.shards)

    def owners(self, length: int) -> np.ndarray:
        """The owning rank of positions ``0..length-1``."""
        p = len(self._owner)
        if p >= length:
            return self._owner[:length]
        chunks, rank = [self._owner], int(self._owner[-1]) if p else 0
        while p < length:  # one concatenation at the end: linear in length, not quadratic
            if p % self.block:  # finish the partial block its last position is in
                n = self.block - p % self.block
            else:
                rank = int(np.argmin(self._held))  # first minimum: the lower rank on ties
                n = self.block
            chunks.append(np.full(n, rank, dtype=np.int64))
            self._held[rank] += n
            p += n
        self._owner = np.concatenate(chunks)
        return self._owner[:length]

    def most_held(self, rank: int, length: int) -> int:
        """An upper bound on the positions ``rank`` holds of a request of ``length`` positions,
        without dealing the blocks out: past the plan's context a rank takes a block only while it
        holds the fewest, so it ends at most one block above the even share (or its own shard)."""
        start, stop = self.shards[rank]
        if length <= self.context:
            return max(0, min(stop, length) - start)
        return max(stop - start, -(-length // self.world_size)) + self.block


def request_slices(batch: int, world: int) -> list[tuple[int, int]]:
    """Requests ``[lo, hi)`` of each rank for the data-parallel parts (``numpy.array_split`` sizes)."""
    q, r = divmod(batch, world)
    out, lo = [], 0
    for i in range(world):
        hi = lo + q + (1 if i < r else 0)
        out.append((lo, hi))
        lo = hi
    return out


# -- the worker ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpWorkerSpec:
    """What every rank gets (picklable)."""

    strategy: str
    world_size: int
    devices: list[str]
    llm: dict[str, Any]
    model_path: str | None
    prompts: list[list[int]]
    options: DecodeOptions
    kv_shards: list[tuple[int, int]]
    kv_block: int
    timeout_s: float
    backend: str


class DecodeWorker:
    """One rank's share of the decode (see the module docstring for what each strategy holds)."""

    def __init__(self, spec: CpWorkerSpec, rank: int, device: torch.device) -> None:
        from tessera.kernels import get_partial_attention

        self.spec, self.rank, self.device = spec, rank, device
        self.world = spec.world_size
        self.strategy = spec.strategy
        self.attend = get_partial_attention(spec.options.attention)
        full = (
            onnx_decoder_weights(spec.model_path, spec.llm)
            if spec.model_path is not None
            else random_decoder_weights(spec.llm, spec.options.seed)
        )
        self.w = tp_shard(full, rank, self.world) if self.strategy == "tp" else full
        self.w = _to_device(self.w, device)
        self.weight_bytes = self.w.nbytes()
        batch = len(spec.prompts)
        self.slices = request_slices(batch, self.world)
        self.lo, self.hi = self.slices[rank]
        self.prompt_lens = [len(p) for p in spec.prompts]
        # Requests whose dense part (projections, FFN, LM head) this rank computes, and whose KV it holds.
        if self.strategy == "tp":
            self.dense = list(range(batch))
        else:
            self.dense = list(range(self.lo, self.hi))
        self.cached = self.dense if self.strategy != "cp" else list(range(batch))
        # Positions fed to the model: prompt, then new_tokens - 1 decode steps.
        total = [n + spec.options.new_tokens - 1 for n in self.prompt_lens]
        if self.strategy == "cp":
            layout = KvLayout(spec.kv_shards, spec.kv_block)
            self.owner = [layout.owners(t) for t in total]
        else:
            self.owner = [np.full(t, rank, dtype=np.int64) for t in total]
        cap = max((int((self.owner[b] == rank).sum()) for b in self.cached), default=0)
        hkv, d = self.w.kv_heads, self.w.head_dim
        shape = (len(self.cached), hkv, max(cap, 1), d)
        self.k = [torch.zeros(shape, device=device) for _ in self.w.layers]
        self.v = [torch.zeros(shape, device=device) for _ in self.w.layers]
        self.kv_len = torch.zeros(len(self.cached), dtype=torch.int64, device=device)
        self.kv_cache_bytes = 2 * len(self.w.layers) * len(self.cached) * hkv * cap * d * 4
        self.tokens: dict[int, list[int]] = {b: [] for b in self.dense}
        self.comm_s = 0.0

    # -- communication --

    def _timed(self, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.comm_s += time.perf_counter() - t0
        return out

    def _all_reduce(self, t: Tensor) -> Tensor:
        if self.world > 1:
            self._timed(lambda: dist.all_reduce(t))
        return t

    def _all_gather_requests(self, mine: Tensor) -> Tensor:
        """``[hi - lo, W]`` rows of this rank's requests -> ``[B, W]`` of all requests (padded gather)."""
        width = mine.shape[1]
        most = max(hi - lo for lo, hi in self.slices)
        padded = torch.zeros(most, width, device=self.device)
        padded[: mine.shape[0]] = mine
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        self._timed(lambda: dist.all_gather(parts, padded))
        return torch.cat([p[: hi - lo] for p, (lo, hi) in zip(parts, self.slices, strict=True)])

    def _all_to_all_requests(self, rows: Tensor) -> Tensor:
        """``[B, W]`` rows for every request -> ``[N, hi - lo, W]``: each rank's rows of my requests."""
        counts = [hi - lo for lo, hi in self.slices]
        mine = self.hi - self.lo
        out = torch.empty(self.world * mine, rows.shape[1], device=self.device)
        self._timed(
            lambda: dist.all_to_all_single(
                out, rows.contiguous(), output_split_sizes=[mine] * self.world, input_split_sizes=counts
            )
        )
        return out.reshape(self.world, mine, rows.shape[1])

    # -- prefill --

    @torch.no_grad()
    def prefill(self) -> None:
        """Every cached request's prompt (replicated compute); keep this rank's positions / heads."""
        reduce = self._all_reduce if self.strategy == "tp" else (lambda t: t)
        for i, b in enumerate(self.cached):
            prompt = torch.tensor(self.spec.prompts[b], dtype=torch.long, device=self.device)
            logits, cache = prefill(self.w, prompt, reduce)
            keep = torch.from_numpy(np.flatnonzero(self.owner[b][: len(prompt)] == self.rank)).to(self.device)
            n = keep.numel()
            for layer, (k, v) in enumerate(cache):
                self.k[layer][i, :, :n] = k[:, keep]
                self.v[layer][i, :, :n] = v[:, keep]
            self.kv_len[i] = n
            if b in self.tokens:
                self.tokens[b].append(int(torch.argmax(logits)))

    # -- one decode step --

    @torch.no_grad()
    def step(self, step: int) -> None:
        """Feed each request's last token (position ``prompt_len + step``), append one token."""
        w, d = self.w, self.w.head_dim
        tokens = torch.tensor([self.tokens[b][-1] for b in self.dense], dtype=torch.long, device=self.device)
        positions = torch.tensor([self.prompt_lens[b] + step for b in self.dense], device=self.device)
        own = torch.tensor(
            [bool(self.owner[b][self.prompt_lens[b] + step] == self.rank) for b in self.cached],
            device=self.device,
        )
        rows = own.nonzero().flatten()
        x = embed(w, tokens, positions)
        for layer_index, layer in enumerate(w.layers):
            q, k, v = qkv(w, layer, x)
            if self.strategy == "cp":
                hq, hkv = q.shape[1], k.shape[1]
                packed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
                gathered = self._all_gather_requests(packed) if self.world > 1 else packed
                q = gathered[:, : hq * d].reshape(gathered.shape[0], hq, d)
                k = gathered[:, hq * d : (hq + hkv) * d].reshape(gathered.shape[0], hkv, d)
                v = gathered[:, (hq + hkv) * d :].reshape(gathered.shape[0], hkv, d)
            kc, vc = self.k[layer_index], self.v[layer_index]
            if rows.numel():
                slots = self.kv_len[rows]
                kc[rows, :, slots] = k[rows]
                vc[rows, :, slots] = v[rows]
            kv_len = self.kv_len + own.to(torch.int64)
            o, lse = self.attend(q, kc, vc, kv_len=kv_len, scale=w.scale)
            if self.strategy == "cp" and self.world > 1:
                hq = q.shape[1]
                parts = self._all_to_all_requests(torch.cat([o.flatten(1), lse], dim=1))
                o, _ = _merge(parts, hq, d)
            attn = o.flatten(1)
            x = x + self._reduce_tp(attention_out(layer, attn))
            x = x + self._reduce_tp(feed_forward(w, layer, x))
        self.kv_len += own.to(torch.int64)
        nxt = torch.argmax(lm_logits(w, x), dim=-1).tolist()
        for b, t in zip(self.dense, nxt, strict=True):
            self.tokens[b].append(int(t))

    def _reduce_tp(self, t: Tensor) -> Tensor:
        return self._all_reduce(t) if self.strategy == "tp" else t


def _merge(parts: Tensor, hq: int, d: int) -> tuple[Tensor, Tensor]:
    """``[N, b, Hq·D + Hq]`` partials (o, lse) of ``b`` requests from N shards -> merged (o, lse)."""
    from tessera.kernels import merge_partials

    n, b = parts.shape[0], parts.shape[1]
    os = parts[..., : hq * d].reshape(n, b, hq, d)
    lses = parts[..., hq * d :]
    return merge_partials(os, lses)


def _to_device(w: DecoderWeights, device: torch.device) -> DecoderWeights:
    if device.type == "cpu":
        return w

    def mv(t: Any) -> Any:
        if isinstance(t, Tensor):
            return t.to(device)
        if isinstance(t, tuple):
            return tuple(mv(x) for x in t)
        return t

    layers = [LayerWeights(**{k: mv(v) for k, v in vars(layer).items()}) for layer in w.layers]
    return replace(
        w,
        token_embedding=mv(w.token_embedding),
        position_embedding=mv(w.position_embedding),
        layers=layers,
        final_norm=mv(w.final_norm),
        lm_head=mv(w.lm_head),
    )


def cp_worker(spec: CpWorkerSpec) -> dict[str, Any]:
    """The entry point of every rank (started by :func:`tessera.executor.launcher.launch_workers`):
    join the process group, prefill, run ``new_tokens - 1`` decode steps; rank 0 returns every
    rank's report (gathered)."""
    rank, device = worker_setup(spec.world_size, spec.backend)
    watchdog = Watchdog(WATCHDOG_FACTOR * spec.timeout_s, rank)
    try:
        watchdog.arm("start-up")
        dist.init_process_group(spec.backend, timeout=timedelta(seconds=spec.timeout_s))
        worker = DecodeWorker(spec, rank, device)
        watchdog.arm("prefill")
        dist.barrier()
        t0 = time.perf_counter()
        worker.prefill()
        _sync(device)
        prefill_s = time.perf_counter() - t0
        dist.barrier()  # decode steps start together
        steps = []
        for k in range(spec.options.new_tokens - 1):
            inject_test_fault(rank, k)
            watchdog.arm(f"decode step {k}")
            comm0 = worker.comm_s
            t0 = time.perf_counter()
            worker.step(k)
            _sync(device)
            steps.append({"step": k, "step_s": time.perf_counter() - t0, "comm_s": worker.comm_s - comm0})
        watchdog.disarm()
        result: dict[str, Any] = {
            "rank": rank,
            "device": spec.devices[rank],
            "requests": [worker.lo, worker.hi] if spec.strategy != "tp" else [0, len(spec.prompts)],
            "prefill_s": prefill_s,
            "steps": steps,
            "tokens": {b: t for b, t in worker.tokens.items() if spec.strategy != "tp" or rank == 0},
            "kv_positions": int(worker.kv_len.sum()),
            "kv_positions_by_request": {
                str(b): n for b, n in zip(worker.cached, worker.kv_len.tolist(), strict=True)
            },
            "kv_cache_bytes": worker.kv_cache_bytes,
            "weight_bytes": worker.weight_bytes,
            "peak_rss_bytes": memory_status("VmHWM"),
        }
        gathered: list[Any] | None = [None] * spec.world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if gathered is not None:
            result["all"] = gathered
    except BaseException:
        # Leave the process group up: the error is recorded and the process exits before the peers
        # see their links drop, so the launcher names this rank, not a peer that lost it.
        watchdog.disarm()
        raise
    watchdog.disarm()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the launch side -------------------------------------------------------------------------------


@dataclass
class CpRun:
    """What ``tessera launch`` reports for a cp plan (``to_json`` is the ``--json`` output)."""

    plan_path: str
    strategy: str
    degree: int
    backend: str
    options: DecodeOptions
    weights: str
    prompt_lens: list[int]
    tokens: list[list[int]]
    steps: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    measured: dict[str, float]
    predicted: dict[str, float]
    ratio: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan_path,
            "kind": "cp",
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
            "steps": self.steps,
            "ranks": self.ranks,
            "measured": self.measured,
            "predicted": self.predicted,
            "ratio": self.ratio,
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
    _, _, heads, kv_heads, _, _, _ = _llm_ints(plan.llm)
    if plan.strategy == "tp" and (heads % n or kv_heads % n):
        raise InputError(
            f"tp over {n} ranks needs heads ({heads}) and kv_heads ({kv_heads}) divisible by {n}",
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
        from tessera.kernels.triton_decode import triton_unavailable_reason

        # The workers' device (a GPU under NCCL, else the CPU), asked before any worker starts.
        device = "cuda" if choose_backend(plan.cluster, _devices(plan)) == "nccl" else "cpu"
        why = triton_unavailable_reason(device)
        if why is not None:
            raise InputError(f"--attention triton is unavailable on the plan's {device} workers: {why}")
    batch = int(plan.workload["batch"])
    context = int(plan.workload["context"])
    given = options.prompt_lens or (context,)
    if any(p < 1 for p in given):
        raise InputError(f"--prompt-lens {list(given)}: every prompt needs at least 1 token")
    if any(p + options.new_tokens - 1 > MAX_TOKENS for p in given):
        raise InputError(
            f"--prompt-lens {max(given)} with --new-tokens {options.new_tokens}: a request may hold at "
            f"most {MAX_TOKENS} positions (1024M)"
        )
    if plan.strategy == "dp" and batch < n:
        raise InputError(f"dp over {n} ranks needs at least {n} requests (batch {batch})", source=source)
    return [int(given[b % len(given)]) for b in range(batch)]


WORKER_BASE_BYTES = 256 * 2**20
"""A worker's memory before it builds anything (interpreter, torch, gloo): a tiny plan's ranks
measure about 350 MiB of peak RSS, part of it shared libraries."""


def _weight_elements(llm: dict[str, Any], positions: int | None) -> int:
    """Elements of the tensors :func:`onnx_decoder_weights` / :func:`random_decoder_weights` build
    (fp32 whatever the plan's dtype; a tied LM head is a copy of its own)."""
    layers, hidden, heads, kv_heads, head_dim, ffn, vocab = _llm_ints(llm)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    ffn_matrices = 3 if llm.get("gated_ffn") else 2
    layer = (
        4 * hidden  # ln1, ln2
        + (hidden + 1) * q_dim
        + 2 * (hidden + 1) * kv_dim
        + q_dim * hidden
        + hidden
        + ffn_matrices * hidden * ffn
        + (ffn_matrices - 1) * ffn
        + hidden
    )
    return layers * layer + 2 * vocab * hidden + 2 * hidden + (positions or 0) * hidden


def host_memory_need(
    plan: CpPlan,
    prompt_lens: Sequence[int],
    new_tokens: int,
    ranks: Sequence[int],
    *,
    layout: KvLayout | None,
    positions: int | None,
    onnx: bool,
    on_gpu: bool,
) -> dict[str, int]:
    """Bytes the workers of ``ranks`` will allocate on this host, by what for (an upper estimate,
    computed from the plan without building anything): ``weights`` as built (fp32; an ONNX model's
    file is held while its tensors are made; a TP rank cuts its share from the full weights),
    ``kv_cache`` (:class:`DecodeWorker`'s buffers), ``prefill`` (one request's causal attention
    scores ``heads × S × S``, three live at once, its prompt's K/V and FFN activations),
    ``layout`` (each request's position owners) and ``workers`` (:data:`WORKER_BASE_BYTES` each).
    On a GPU the KV cache and the prefill live on the device, not here."""
    layers, hidden, heads, kv_heads, head_dim, ffn, _ = _llm_ints(plan.llm)
    n = plan.degree
    weights = 4 * _weight_elements(plan.llm, positions)
    built = 2 * weights if onnx else weights
    hq, hkv = heads, kv_heads
    if plan.strategy == "tp":
        built = max(built, weights + weights // n)
        hq, hkv = heads // n, kv_heads // n
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
    if plan.model is not None:
        if model_path is None:
            raise InputError("the plan names an ONNX model; give its path", source=plan_path)
        model_path = str(Path(model_path).resolve())
        weights = onnx_decoder_weights(model_path, plan.llm)  # refuse an unmappable model before starting
        vocab, max_positions, source = weights.vocab, weights.max_positions, weights.source
        del weights  # the workers build their own: do not hold a copy while they run
    else:
        model_path = None
        vocab, max_positions = int(plan.llm["vocab"]), None
        source = f"seeded random (seed {options.seed}; --llm config {plan.llm.get('name', '?')})"
    longest = max(prompt_lens) + options.new_tokens - 1
    if max_positions is not None and longest > max_positions:
        raise InputError(
            f"the longest request needs {longest} positions (prompt {max(prompt_lens)} + "
            f"{options.new_tokens - 1} decode steps) but the model's position table has {max_positions}",
            source=plan_path,
        )
    backend = choose_backend(plan.cluster, _devices(plan))
    devices = _devices(plan)
    block = int((plan.predicted.get("cost_model") or {}).get("kv_block", DEFAULT_KV_BLOCK))
    shards = [(s.start, s.stop) for s in plan.kv_shards]
    layout = None
    if plan.strategy == "cp":
        try:
            layout = KvLayout(shards, block)  # validates
        except InputError as exc:
            raise InputError(exc.message, source=plan_path) from None
    need = host_memory_need(
        plan,
        prompt_lens,
        options.new_tokens,
        local_ranks(launch, plan.degree),
        layout=layout,
        positions=max_positions,
        onnx=plan.model is not None,
        on_gpu=backend == "nccl",
    )
    check_host_memory(need, plan_path)
    spec = CpWorkerSpec(
        strategy=plan.strategy,
        world_size=plan.degree,
        devices=devices,
        llm=dict(plan.llm),
        model_path=model_path,
        prompts=make_prompts(vocab, prompt_lens, options.seed),
        options=options,
        kv_shards=shards,
        kv_block=block,
        timeout_s=launch.timeout_s,
        backend=backend,
    )

    def describe(rank: int) -> str:
        return f"rank {rank} ({plan.strategy} {rank}/{plan.degree}, device {devices[rank]})"

    results = launch_workers(cp_worker, (spec,), plan.degree, launch, describe_rank=describe)
    mine = results.get(0) or next(iter(results.values()))
    per_rank = mine.get("all") or list(results.values())
    return _report(plan, plan_path, backend, options, prompt_lens, source, per_rank)


def _report(
    plan: CpPlan,
    plan_path: str,
    backend: str,
    options: DecodeOptions,
    prompt_lens: list[int],
    source: str,
    per_rank: list[dict[str, Any]],
) -> CpRun:
    n_steps = options.new_tokens - 1
    batch = len(prompt_lens)
    tokens_by_request: dict[int, list[int]] = {}
    for r in per_rank:
        tokens_by_request.update({int(b): t for b, t in r["tokens"].items()})
    tokens = [tokens_by_request.get(b, []) for b in range(batch)]
    steps = [
        {
            "step": k,
            "step_s": max(r["steps"][k]["step_s"] for r in per_rank),
            "comm_s": max(r["steps"][k]["comm_s"] for r in per_rank),
        }
        for k in range(n_steps)
    ]
    # Step 0 pays for warm-up (first-touch pages, lazy gloo buffers): skip it when there are more.
    counted = steps[1:] if n_steps > 1 else steps
    latency = float(np.mean([s["step_s"] for s in counted]))
    comm = float(np.mean([s["comm_s"] for s in counted]))
    measured = {
        "tokens_per_s": batch / latency if latency > 0 else 0.0,
        "per_token_latency_s": latency,
        "communication_s": comm,
        "communication_fraction": comm / latency if latency > 0 else 0.0,
        "prefill_s": max(r["prefill_s"] for r in per_rank),
    }
    predicted = {
        k: float(plan.predicted[k])
        for k in ("tokens_per_s", "per_token_latency_s", "step_time_s")
        if plan.predicted.get(k) is not None
    }
    breakdown = plan.predicted.get("breakdown") or {}
    if breakdown.get("communication_s") is not None:
        predicted["communication_s"] = float(breakdown["communication_s"])
    ratio = {}
    if predicted.get("tokens_per_s"):
        ratio["tokens_per_s"] = measured["tokens_per_s"] / predicted["tokens_per_s"]
    if predicted.get("per_token_latency_s"):
        ratio["per_token_latency"] = latency / predicted["per_token_latency_s"]
    ranks = [
        {
            "rank": r["rank"],
            "device": r["device"],
            "requests": r["requests"],
            "kv_positions": r["kv_positions"],
            "kv_positions_by_request": r["kv_positions_by_request"],
            "kv_cache_bytes": r["kv_cache_bytes"],
            "weight_bytes": r["weight_bytes"],
            "peak_rss_bytes": r["peak_rss_bytes"],
            "prefill_s": r["prefill_s"],
            "step_s": float(np.mean([s["step_s"] for s in (r["steps"][1:] or r["steps"])])),
            "comm_s": float(np.mean([s["comm_s"] for s in (r["steps"][1:] or r["steps"])])),
        }
        for r in sorted(per_rank, key=lambda r: r["rank"])
    ]
    extra = {"layers_evaluated": plan.predicted.get("layers_evaluated")}
    if plan.predicted.get("per_layer"):
        extra["note"] = "the plan predicts only some layers (--layers); the run decodes all of them"
    return CpRun(
        plan_path=plan_path,
        strategy=plan.strategy,
        degree=plan.degree,
        backend=backend,
        options=options,
        weights=source,
        prompt_lens=prompt_lens,
        tokens=tokens,
        steps=steps,
        ranks=ranks,
        measured=measured,
        predicted=predicted,
        ratio=ratio,
        extra=extra,
    )
