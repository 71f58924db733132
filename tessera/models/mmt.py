"""MMT: the multi-modal (multi-branch) transformer of GraphPipe's evaluation.

Four branches of eight pre-norm transformer layers (seq 256, hidden 1024, 16 heads, FFN 4096), one per
modality (input ``modality{i}`` ``[batch, seq, hidden]``, already embedded), concatenated along the hidden
axis, mean-pooled over the sequence and classified by a Gemm ``head``. The sources give no head; a linear
classifier is the smallest that makes the model trainable.

References: GraphPipe paper §5, App. A.2; thesis §3.10.3. Structure: docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto

from tessera.models.layers import BATCH, GraphBuilder, gemm, layer_norm, transformer_layer


@dataclass(frozen=True)
class MMTConfig:
    branches: int
    layers: int
    seq: int
    hidden: int
    heads: int
    ffn: int
    classes: int


CONFIGS = {
    "tiny": MMTConfig(branches=2, layers=2, seq=16, hidden=32, heads=4, ffn=64, classes=10),
    "paper": MMTConfig(branches=4, layers=8, seq=256, hidden=1024, heads=16, ffn=4096, classes=1000),
}


def build_mmt(config: MMTConfig, *, seed: int = 0, lazy: bool = False) -> onnx.ModelProto:
    """Build the MMT of ``config`` (GraphPipe Appendix A.2)."""
    c = config
    g = GraphBuilder("mmt", seed=seed, lazy=lazy)
    branch_outputs = []
    for b in range(c.branches):
        x = g.input(f"modality{b}", TensorProto.FLOAT, [BATCH, c.seq, c.hidden])
        with g.scope(f"branch{b}"):
            for i in range(c.layers):
                with g.scope(f"layer{i}"):
                    x = transformer_layer(g, x, hidden=c.hidden, heads=c.heads, ffn_dim=c.ffn, seq=c.seq)
            branch_outputs.append(layer_norm(g, x, c.hidden, "final_norm"))
    with g.scope("merge"):
        merged = g.op("Concat", branch_outputs, "concat", axis=-1)
        pooled = g.op("ReduceMean", [merged], "pool", axes=[1], keepdims=0)
    width = c.branches * c.hidden
    logits = gemm(g, pooled, width, c.classes, "head", std=width**-0.5, output="logits")
    g.output(logits, TensorProto.FLOAT, [BATCH, c.classes])
    return g.build(c, "Multi-modal transformer (GraphPipe Appendix A.2).")
