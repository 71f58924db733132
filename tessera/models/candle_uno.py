"""CANDLE-Uno: the drug-response model of GraphPipe's evaluation.

Seven branches (``feature{i}`` → ``layers`` × (Gemm + Relu)), ``merge/concat``, a top MLP and a Gemm
``head`` regressing ``growth`` ``[batch, 1]``; hidden size 4096. The sources give neither the input width
nor the top MLP: both take the hidden size, with four top layers like the branches.

References: GraphPipe paper App. A.2; thesis §3.10.3. Structure: docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto

from tessera.models.layers import BATCH, GraphBuilder, gemm, mlp


@dataclass(frozen=True)
class CandleUnoConfig:
    branches: int
    feature_dim: int
    layers: int
    hidden: int
    top_layers: int


CONFIGS = {
    "tiny": CandleUnoConfig(branches=7, feature_dim=16, layers=4, hidden=16, top_layers=4),
    "paper": CandleUnoConfig(branches=7, feature_dim=4096, layers=4, hidden=4096, top_layers=4),
}


def build_candle_uno(config: CandleUnoConfig, *, seed: int = 0, lazy: bool = False) -> onnx.ModelProto:
    """Build the CANDLE-Uno of ``config`` (GraphPipe Appendix A.2)."""
    c = config
    g = GraphBuilder("candle_uno", seed=seed, lazy=lazy)
    branch_outputs = []
    for b in range(c.branches):
        x = g.input(f"feature{b}", TensorProto.FLOAT, [BATCH, c.feature_dim])
        branch_outputs.append(mlp(g, x, c.feature_dim, [c.hidden] * c.layers, f"branch{b}"))
    with g.scope("merge"):
        x = g.op("Concat", branch_outputs, "concat", axis=1)
    x = mlp(g, x, c.branches * c.hidden, [c.hidden] * c.top_layers, "top")
    growth = gemm(g, x, c.hidden, 1, "head", std=c.hidden**-0.5, output="growth")
    g.output(growth, TensorProto.FLOAT, [BATCH, 1])
    return g.build(c, "CANDLE-Uno (GraphPipe Appendix A.2).")
