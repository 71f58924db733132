"""BERT: a BERT-style encoder (BERT-base at paper size: 12 layers, 768, 12 heads, FFN 3072).

A sequential transformer baseline for placement and pipeline planning: ``input_ids``/``token_type_ids``
→ embeddings and LayerNormalization → post-norm layers ``layer{i}`` (GELU via Erf) →
``last_hidden_state`` and ``pooler_output``. References: Collage paper evaluation; GraphPipe paper
App. A.3. Structure: docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from tessera.core.weights import Init
from tessera.models.layers import BATCH, GraphBuilder, gemm, layer_norm, transformer_layer


@dataclass(frozen=True)
class BERTConfig:
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    type_vocab: int = 2


CONFIGS = {
    "tiny": BERTConfig(layers=2, hidden=32, heads=4, ffn=64, vocab=128, seq=16),
    "paper": BERTConfig(layers=12, hidden=768, heads=12, ffn=3072, vocab=30522, seq=128),
}

_EPSILON = 1e-12  # BERT's LayerNorm epsilon


def build_bert(config: BERTConfig, *, seed: int = 0, lazy: bool = False) -> onnx.ModelProto:
    """Build the BERT encoder of ``config`` (post-norm, BERT-base layout)."""
    c = config
    g = GraphBuilder("bert", seed=seed, lazy=lazy)
    ids = g.input("input_ids", TensorProto.INT64, [BATCH, c.seq])
    types = g.input("token_type_ids", TensorProto.INT64, [BATCH, c.seq])
    with g.scope("embed"):

        def embedding(name: str, rows: int, indices: str) -> str:
            with g.scope(name):
                table = g.param("weight", (rows, c.hidden), Init.normal(0.02))
                return g.op("Gather", [table, indices], "gather")

        x = embedding("token", c.vocab, ids)
        positions = embedding("position", c.seq, g.const("positions", np.arange(c.seq, dtype=np.int64)))
        x = g.op("Add", [x, positions], "add")
        x = g.op("Add", [x, embedding("token_type", c.type_vocab, types)], "add_type")
        x = layer_norm(g, x, c.hidden, "norm", epsilon=_EPSILON)
    for i in range(c.layers):
        with g.scope(f"layer{i}"):
            x = transformer_layer(
                g,
                x,
                hidden=c.hidden,
                heads=c.heads,
                ffn_dim=c.ffn,
                seq=c.seq,
                pre_norm=False,
                epsilon=_EPSILON,
            )
    hidden_state = g.op("Identity", [x], "encoder_output", output="last_hidden_state")
    with g.scope("pooler"):
        first = g.op(
            "Gather",
            [hidden_state, g.const("first_token/index", np.array(0, dtype=np.int64))],
            "first_token",
            axis=1,
        )
        pooled = gemm(g, first, c.hidden, c.hidden, "dense", std=0.02)
        pooled = g.op("Tanh", [pooled], "tanh", output="pooler_output")
    g.output(hidden_state, TensorProto.FLOAT, [BATCH, c.seq, c.hidden])
    g.output(pooled, TensorProto.FLOAT, [BATCH, c.hidden])
    return g.build(c, "BERT-style encoder.")
