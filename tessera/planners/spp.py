"""Sequential pipeline-parallel (SPP) baselines on GraphPipe's cost model.

- :func:`plan_spp` — PipeDream-style: the operators in one linear (topological) order, cut into
  contiguous sequential stages, each possibly data-parallel, minimizing the bottleneck stage's
  time per sample under the memory limit (PipeDream's objective). It runs the GPP partitioner
  (:mod:`tessera.planners.gpp.partition`) on the *linearized* series-parallel tree — one series of
  the same units — so both planners share units, cost model, micro-batch search and schedules,
  and on a chain GPP and SPP produce the same plan. The stages run in order (stage i+1 after
  stage i, zero-byte ordering edges where no tensor flows), as a sequential pipeline does (thesis
  §3.2); the DP charges each stage the bytes crossing its left cut. For search time on 70–80-unit
  chains it tries the 4 longest feasible first stages per data-parallel degree, not every split.
- :func:`piper_ideals` — the size of Piper's search space: Piper's DP runs over the downsets
  (ideals) of the operator DAG, whose number grows exponentially with the number of parallel
  branches (GraphPipe thesis §3.7.1: Piper finds no strategy for DLRM and CANDLE-Uno). A
  Piper-style partitioner is not implemented; :func:`piper_ideals` reports when it would be
  intractable (more than ``PIPER_LIMIT`` ideals of the coarsened DAG).
"""

from __future__ import annotations

from tessera.core.cost import CostModel
from tessera.core.graph import Graph
from tessera.core.specs import ClusterSpec
from tessera.planners.gpp.partition import PartitionOptions, Pipeline, build_tree, partition
from tessera.planners.gpp.sp import SPNode, SPTree

PIPER_LIMIT = 100_000


def plan_spp(
    graph: Graph, cluster: ClusterSpec, options: PartitionOptions, *, tree: SPTree | None = None
) -> Pipeline:
    """PipeDream-style sequential pipeline (see the module docstring)."""
    if tree is None:
        device = cluster.devices()[0].type
        cost = CostModel.for_device(device, options.precision, options.bytes_per_param)
        tree = build_tree(graph, cost, options.max_units)
    return partition(graph, cluster, options, tree=tree.linearized(), kind="spp")


def piper_ideals(tree: SPTree) -> int:
    """Number of ideals (downward-closed sets) of the coarsened unit DAG, exact for the SP tree:
    a leaf has 2, a series of A then B has I(A) + I(B) − 1, a parallel composition the product."""
    return _ideals(tree.root)


def _ideals(node: SPNode) -> int:
    if node.kind == "leaf":
        return 2
    counts = [_ideals(c) for c in node.children]
    if node.kind == "series":
        return sum(counts) - (len(counts) - 1)
    total = 1
    for c in counts:
        total *= c
    return total
