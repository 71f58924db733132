from __future__ import annotations

import itertools
import math

import pytest
from planners.gpp.gpp_graphs import chain

from tessera.core.cost import CostModel
from tessera.core.specs import load_cluster
from tessera.planners.gpp.dp import StageDP, par_join, pareto, seq, stages_of
from tessera.planners.gpp.partition import PartitionOptions, StageLinks, UnitCosts, build_tree


def _optimum(dp: StageDP, n: int, num: int) -> float:
    """Brute force: the smallest bottleneck TPS over every split of units [0, n) into contiguous
    stages with power-of-two device counts summing to at most ``num``."""
    best = math.inf
    for k in range(1, min(n, num) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            spans = list(itertools.pairwise(bounds))
            for degrees in itertools.product(dp.degrees, repeat=k):
                if sum(degrees) > num:
                    continue
                tps = max(dp.stage(lo, hi, d)[0] for (lo, hi), d in zip(spans, degrees, strict=True))
                best = min(best, tps)
    return best


@pytest.mark.parametrize("num", [2, 3, 4])
def test_series_dp_finds_the_optimal_split(num: int) -> None:
    g = chain(6, width=384)
    cluster = load_cluster("graphpipe-v100")
    cost = CostModel.for_device(cluster.devices()[0].type)
    tree = build_tree(g, cost, 6)
    costs = UnitCosts(g, tree, cost)
    opts = PartitionOptions(mini_batch=64, num_devices=num, memory_limit=math.inf)
    dp = StageDP(tree, costs, StageLinks(cluster, num), opts, 8, math.inf, num)
    best = _optimum(dp, costs.n, num)
    assert dp.run(best * (1 + 1e-9))  # the optimum is feasible
    assert not dp.run(best * (1 - 1e-6))  # and nothing beats it
    front = dp.run(best * (1 + 1e-9))
    assert max(dp.stage(lo, hi, d)[0] for lo, hi, d in stages_of(front[0][5])) <= best * (1 + 1e-9)
    used = sum(d for _, _, d in stages_of(front[0][5]))
    assert used <= num


def test_entries_compose_as_in_table_3_2() -> None:
    a = (2.0, 1, 5, 0.1, 2.0, ("S", 0, 1, 1))
    b = (3.0, 2, 4, 0.2, 1.0, ("S", 1, 2, 1))
    # In series, the first stage gets the rest's depth in flight: its slack drops by 2.
    assert seq(a, b)[:5] == (5.0, 3, 3, 0.2, 1.0)
    # Branches joining the sink stage of another: one more level behind them.
    assert par_join(a, b)[:5] == (3.0, 2, 4, 0.2, 1.0)
    worse = (4.0, 3, 2, 0.1, 0.0, ("S", 0, 1, 1))
    assert pareto([worse, a]) == [a]
