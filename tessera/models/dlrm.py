"""DLRM: the deep-learning recommendation model of GraphPipe's evaluation.

Seven dense branches (``dense{i}`` → ``dense_layers`` × (Gemm + Relu), width 4096) and seven sparse ones
(``sparse{i}`` row ids → Gather from a ``[rows, embed_dim]`` table, the bag's embeddings concatenated;
1M × 64, bag 100), ``interaction/concat``, a top MLP, ``head`` and ``click_probability`` (Sigmoid). The
sources do not give the number of top layers; four are used, like the dense branches.

References: GraphPipe paper App. A.2; thesis §3.10.3. Structure: docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto

from tessera.core.weights import Init
from tessera.models.layers import BATCH, GraphBuilder, gemm, mlp, shape_const


@dataclass(frozen=True)
class DLRMConfig:
    dense_branches: int
    dense_dim: int
    dense_layers: int
    sparse_branches: int
    rows: int
    embed_dim: int
    bag: int
    top_layers: int
    top_dim: int


CONFIGS = {
    "tiny": DLRMConfig(
        dense_branches=7, dense_dim=16, dense_layers=4, sparse_branches=7, rows=64, embed_dim=4, bag=4,
        top_layers=4, top_dim=16,
    ),
    "paper": DLRMConfig(
        dense_branches=7, dense_dim=4096, dense_layers=4, sparse_branches=7, rows=1_000_000, embed_dim=64,
        bag=100, top_layers=4, top_dim=4096,
    ),
}  # fmt: skip


def build_dlrm(config: DLRMConfig, *, seed: int = 0, lazy: bool = False) -> onnx.ModelProto:
    """Build the DLRM of ``config`` (GraphPipe Appendix A.2)."""
    c = config
    g = GraphBuilder("dlrm", seed=seed, lazy=lazy)
    features = []
    for b in range(c.dense_branches):
        x = g.input(f"dense{b}", TensorProto.FLOAT, [BATCH, c.dense_dim])
        features.append(mlp(g, x, c.dense_dim, [c.dense_dim] * c.dense_layers, f"dense_branch{b}"))
    for b in range(c.sparse_branches):
        ids = g.input(f"sparse{b}", TensorProto.INT64, [BATCH, c.bag])
        with g.scope(f"sparse_branch{b}"):
            with g.scope("table"):
                table = g.param("weight", (c.rows, c.embed_dim), Init.normal(c.embed_dim**-0.5))
                bag = g.op("Gather", [table, ids], "gather")
            shape = shape_const(g, "concat_bag/shape", (0, c.bag * c.embed_dim))
            features.append(g.op("Reshape", [bag, shape], "concat_bag"))
    with g.scope("interaction"):
        x = g.op("Concat", features, "concat", axis=1)
    width = c.dense_branches * c.dense_dim + c.sparse_branches * c.bag * c.embed_dim
    x = mlp(g, x, width, [c.top_dim] * c.top_layers, "top")
    logit = gemm(g, x, c.top_dim, 1, "head", std=c.top_dim**-0.5)
    probability = g.op("Sigmoid", [logit], "head/sigmoid", output="click_probability")
    g.output(probability, TensorProto.FLOAT, [BATCH, 1])
    return g.build(c, "DLRM (GraphPipe Appendix A.2).")
