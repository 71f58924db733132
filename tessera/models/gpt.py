"""GPT: a GPT-2-style decoder-only transformer, the model cache-parallel decode planning targets.

GPT-2 small's sizes at paper size (12 layers, hidden 768, 12 heads, FFN 3072, vocabulary 50257, context
1024). Regular so a recognizer can match it layer by layer: token and position embeddings, ``layer{i}``
(``ln1`` → ``attn`` with a causal ``mask_add`` → residual → ``ln2`` → ``ffn`` → residual), ``final_norm``
and an untied ``lm_head`` to ``logits``. ``kv_heads < heads`` gives grouped-query attention; the config is
recorded in ``metadata_props`` (``tessera.layers``, ``tessera.kv_heads``, …).

References: thesis ch. 4 (cache parallelism). Node names: docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from tessera.core.weights import Init
from tessera.models.layers import BATCH, GraphBuilder, layer_norm, transformer_layer


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


CONFIGS = {
    "tiny": GPTConfig(layers=2, hidden=32, heads=4, kv_heads=4, ffn=128, vocab=128, seq=16),
    "paper": GPTConfig(layers=12, hidden=768, heads=12, kv_heads=12, ffn=3072, vocab=50257, seq=1024),
}


def build_gpt(config: GPTConfig, *, seed: int = 0, lazy: bool = False) -> onnx.ModelProto:
    """Build the GPT of ``config`` (pre-norm, GPT-2 layout; see the module docstring)."""
    c = config
    if c.hidden % c.heads or c.heads % c.kv_heads:
        raise ValueError(
            f"heads ({c.heads}) must divide hidden ({c.hidden}) and kv_heads ({c.kv_heads}) must divide heads"
        )
    g = GraphBuilder("gpt", seed=seed, lazy=lazy)
    ids = g.input("input_ids", TensorProto.INT64, [BATCH, c.seq])
    with g.scope("embed"):
        with g.scope("token"):
            tokens = g.op(
                "Gather", [g.param("weight", (c.vocab, c.hidden), Init.normal(0.02)), ids], "gather"
            )
        with g.scope("position"):
            table = g.param("weight", (c.seq, c.hidden), Init.normal(0.01))
            positions = g.const("positions", np.arange(c.seq, dtype=np.int64))
            positions = g.op("Gather", [table, positions], "gather")
        x = g.op("Add", [tokens, positions], "add")
    for i in range(c.layers):
        with g.scope(f"layer{i}"):
            x = transformer_layer(
                g,
                x,
                hidden=c.hidden,
                heads=c.heads,
                kv_heads=c.kv_heads,
                ffn_dim=c.ffn,
                seq=c.seq,
                causal=True,
            )
    x = layer_norm(g, x, c.hidden, "final_norm")
    with g.scope("lm_head"):
        weight = g.param("weight", (c.hidden, c.vocab), Init.normal(0.02))
        logits = g.op("MatMul", [x, weight], "matmul", output="logits")
    g.output(logits, TensorProto.FLOAT, [BATCH, c.seq, c.vocab])
    return g.build(c, "GPT-2-style decoder-only transformer.", extra={"head_dim": str(c.head_dim)})
