"""MMT: the multi-modal (multi-branch) transformer of GraphPipe's evaluation.

GraphPipe (paper-graphpipe.txt) §5 and Appendix A.2; thesis §3.10.3: "four parallel branches
concatenated at the end and each branch consists of eight Transformer layers (32 layers in total).
Here, the input sequence length is 256. Each transformer layer has a hidden size of 1024 [...] and
16 attention heads. [The] feed-forward layer [...] has a hidden size of 4096."

Each branch reads one modality, already embedded: input ``modality{i}`` ``[batch, seq, hidden]``.
Branch ``branch{i}`` is ``layers`` pre-norm transformer layers (``branch{i}/layer{j}``) and a final
LayerNormalization. The branches are concatenated along the hidden axis (``merge/concat``),
mean-pooled over the sequence (``merge/pool``) and classified by a Gemm (``head``) into
``logits`` ``[batch, classes]``. The seeds do not give the head; a linear classifier is the
smallest one that makes the model trainable.
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
