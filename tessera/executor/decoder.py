"""The hand-written GPT-2-style decoder the CP executor runs, its weights and their TP shards.

Owns the decoder's math (shared by :func:`reference_decode`, the single-process ground truth, and
the decode workers), its weights — from a zoo GPT ONNX model (:func:`onnx_decoder_weights`) or
seeded random ones for an ``--llm`` plan (:func:`random_decoder_weights`), computed in fp32 — a
tensor-parallel rank's share (:func:`tp_shard`) and the requests' prompts (:func:`make_prompts`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.core.errors import InputError
from tessera.core.plans import CpPlan


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


def llm_ints(llm: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    """A plan's ``llm`` block as (layers, hidden, heads, kv_heads, head_dim, ffn, vocab)."""
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


def onnx_decoder_weights(model_path: str | os.PathLike[str], llm: dict[str, Any]) -> DecoderWeights:  # noqa: C901
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
    layers, hidden, heads, kv_heads, head_dim, ffn, vocab = llm_ints(llm)
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
    layers, hidden, heads, kv_heads, head_dim, ffn, vocab = llm_ints(llm)
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


def to_device(w: DecoderWeights, device: torch.device) -> DecoderWeights:
    """``w`` with every tensor on ``device`` (``w`` itself on the CPU)."""
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
