"""GPT: a GPT-2-style decoder-only transformer, the model cache-parallel decode planning targets.

GPT-2 small's sizes at paper size (12 layers, hidden 768, 12 heads, FFN 3072, vocabulary 50257, context
1024). Regular so a recognizer can match it layer by layer: token and position embeddings, ``layer{i}``
(``ln1`` → ``attn`` with a causal ``mask_add`` → residual → ``ln2`` → ``ffn`` → residual), ``final_norm``
and an untied ``lm_head`` to ``logits``. ``kv_heads < heads`` gives grouped-query attention; the config is
recorded in ``metadata_props`` (``tessera.layers``, ``tessera.kv_heads``, …).

References: thesis ch. 4 (cache parallelism). Node names: docs/models.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from tessera.core.weights import Init
from tessera.models.layers import (
    BATCH,
    GraphBuilder,
    layer_norm,
    scalar_const,
    shape_const,
    transformer_layer,
)


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int  # the declared sequence length (and the learned position table's rows)
    positions: str = "learned"  # or "sinusoidal" (Vaswani et al. 2017, no length limit)
    gated: bool = False  # SwiGLU FFN (gate, fc1, fc2) instead of GELU (fc1, fc2)
    tied: bool = False  # LM head = the token embedding transposed (scaled by 1/sqrt(hidden))
    head_size: int = 0  # per head; 0: hidden / heads
    init: str = "gpt2"  # "gpt2": std 0.02; "fan_in": std 1/sqrt(rows), embeddings std 1
    dynamic: bool = False  # declare the sequence axis symbolic ("seq") instead of ``seq``

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


CONFIGS = {
    "tiny": GPTConfig(layers=2, hidden=32, heads=4, kv_heads=4, ffn=128, vocab=128, seq=16),
    "paper": GPTConfig(layers=12, hidden=768, heads=12, kv_heads=12, ffn=3072, vocab=50257, seq=1024),
}


def build_gpt(config: GPTConfig, *, seed: int = 0, lazy: bool = False) -> onnx.ModelProto:
    """Build the GPT of ``config`` (pre-norm, GPT-2 layout; see the module docstring). Its graph
    follows the input's sequence length (positions from a ``Range``, the causal mask from the
    scores' shape), so it decodes token by token whatever length it declares."""
    c = config
    if (c.head_size == 0 and c.hidden % c.heads) or c.heads % c.kv_heads:
        raise ValueError(
            f"heads ({c.heads}) must divide hidden ({c.hidden}) and kv_heads ({c.kv_heads}) must divide heads"
        )
    if c.positions not in ("learned", "sinusoidal") or c.init not in ("gpt2", "fan_in"):
        raise ValueError(
            f"positions must be learned or sinusoidal, init gpt2 or fan_in; got {c.positions}, {c.init}"
        )
    g = GraphBuilder("gpt", seed=seed, lazy=lazy)
    length: int | str = "seq" if c.dynamic else c.seq
    ids = g.input("input_ids", TensorProto.INT64, [BATCH, length])
    embedding_std = 1.0 if c.init == "fan_in" else 0.02
    with g.scope("embed"):
        with g.scope("token"):
            table = g.param("weight", (c.vocab, c.hidden), Init.normal(embedding_std))
            tokens = g.op("Gather", [table, ids], "gather")
        with g.scope("position"):
            x = g.op("Add", [tokens, _positions(g, c, ids)], "add")
    for i in range(c.layers):
        with g.scope(f"layer{i}"):
            x = transformer_layer(
                g, x, hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, ffn_dim=c.ffn, seq=None, causal=True,
                head_dim=c.head_dim, gated=c.gated, fan_in=c.init == "fan_in",
            )  # fmt: skip
    x = layer_norm(g, x, c.hidden, "final_norm")
    with g.scope("lm_head"):
        if c.tied:
            head = g.op("Transpose", [table], "transpose", perm=[1, 0])
            x = g.op("Mul", [x, scalar_const(g, "scale_factor", c.hidden**-0.5)], "scale")
        else:
            std = c.hidden**-0.5 if c.init == "fan_in" else 0.02
            head = g.param("weight", (c.hidden, c.vocab), Init.normal(std))
        logits = g.op("MatMul", [x, head], "matmul", output="logits")
    g.output(logits, TensorProto.FLOAT, [BATCH, length, c.vocab])
    return g.build(c, "GPT-2-style decoder-only transformer.", extra={"head_dim": str(c.head_dim)})


def _positions(g: GraphBuilder, c: GPTConfig, ids: str) -> str:
    """``[S, hidden]`` position embeddings of positions ``Range(0, S)``, S the input's length:
    rows of a learned table, or sinusoidal (sin of the first half of the frequencies, cos of the rest)."""
    length = g.op("Shape", [ids], "length", start=1, end=2)
    count = g.op("Squeeze", [length, shape_const(g, "axis", (0,))], "count")
    zero, one = (g.const(name, np.array(v, dtype=np.int64)) for name, v in (("start", 0), ("delta", 1)))
    positions = g.op("Range", [zero, count, one], "range")
    if c.positions == "learned":
        return g.op("Gather", [g.param("weight", (c.seq, c.hidden), Init.normal(0.01)), positions], "gather")
    half = (c.hidden + 1) // 2
    freq = np.exp(-np.log(10000.0) * np.arange(half, dtype=np.float64) / half).astype(np.float32)
    angles = g.op(
        "Mul",
        [g.op("Unsqueeze", [g.op("Cast", [positions], "cast", to=TensorProto.FLOAT), shape_const(g, "unsqueeze_axis", (1,))], "column"),
         g.const("frequencies", freq[None, :])],
        "angles",
    )  # fmt: skip
    table = g.op("Concat", [g.op("Sin", [angles], "sin"), g.op("Cos", [angles], "cos")], "table", axis=1)
    if 2 * half == c.hidden:
        return table
    return g.op("Slice", [table, shape_const(g, "from", (0,)), shape_const(g, "to", (c.hidden,)), shape_const(g, "on", (1,))], "cut")  # fmt: skip


def llm_gpt(llm: Mapping[str, Any], seed: int = 0) -> onnx.ModelProto:
    """The GPT a cp plan made from an LLM config decodes (``--llm``: a config has no weights): its
    sizes, gated FFN and tied head; sinusoidal positions (no length limit), a symbolic sequence
    axis, lazy weights with std 1/sqrt(fan-in) so greedy tokens are clear. ``materialize`` it."""
    heads = int(llm["heads"])
    config = GPTConfig(
        layers=int(llm["layers"]), hidden=int(llm["hidden"]), heads=heads, kv_heads=int(llm.get("kv_heads") or heads),
        ffn=int(llm["ffn"]), vocab=int(llm["vocab"]), seq=1, positions="sinusoidal",
        gated=bool(llm.get("gated_ffn")), tied=bool(llm.get("tied_embeddings")),
        head_size=int(llm.get("head_dim") or 0), init="fan_in", dynamic=True,
    )  # fmt: skip
    return build_gpt(config, seed=seed, lazy=True)
