"""Per-stage 1F1B warm-up: Table 3.2 counts plus extra warm-up (``scheduled``), tuned on the
simulator (``tune_warm_up``), and the sequential baseline's two proposers."""

from __future__ import annotations

import dataclasses

import networkx as nx
import pytest

from tessera.core.cost import CostModel
from tessera.core.graph import load_graph
from tessera.core.schedule import in_flight_of, one_f_one_b
from tessera.core.specs import ClusterSpec
from tessera.models import build
from tessera.planners.pipeline.materialize import scheduled
from tessera.planners.pipeline.materialize import uniform_warm_up as _uniform
from tessera.planners.pipeline.search import build_tree, partition
from tessera.planners.pipeline.spp import plan_spp
from tessera.planners.pipeline.tuning import tune_warm_up
from tessera.planners.pipeline.types import PartitionOptions
from tessera.planners.sim import simulate_pipeline


@pytest.fixture(scope="module")
def candle16(v100, zoo_graph):
    g = zoo_graph("candle_uno", "paper")
    return g, partition(g, v100, PartitionOptions(mini_batch=16384, num_devices=16))


def _successors(pipe) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {st.id: [] for st in pipe.stages}
    for e in pipe.edges:
        out[e.src].append(e.dst)
    return out


def test_table_counts_and_uniform_extra(candle16) -> None:
    _, pipe = candle16
    m = pipe.num_micro_batches
    succ = _successors(pipe)
    least = scheduled(pipe, {})
    assert least is not None
    by_id = {st.id: st for st in least.stages}
    for st in least.stages:
        # 1F1B with one micro-batch size: a sink keeps one in flight, every other stage one more
        # than its most-loaded successor (Table 3.2, row max = k_y b_y = k_x b_x).
        want = 1 if not succ[st.id] else min(m, 1 + max(by_id[j].in_flight for j in succ[st.id]))
        assert st.in_flight == want
        assert st.schedule == one_f_one_b(m, want)
    two = scheduled(pipe, {st.id: 2 for st in pipe.stages})
    assert two is not None
    for a, b in zip(least.stages, two.stages, strict=True):
        assert b.in_flight == (a.in_flight if not succ[a.id] else min(m, a.in_flight + 2))
        assert b.memory.peak >= a.memory.peak
    # The input is not modified: scheduled() works on copies.
    assert [st.in_flight for st in pipe.stages] != [] and pipe.stages[0] is not two.stages[0]


def test_extra_warm_up_keeps_c5_and_memory(candle16) -> None:
    _, pipe = candle16
    succ = _successors(pipe)
    # Extra warm-up on a successor raises its predecessors' counts (C5): no deadlock, whatever
    # the per-stage extras.
    sink_feeders = [st.id for st in pipe.stages if succ[st.id]]
    extra = {sink_feeders[-1]: 6}
    cand = scheduled(pipe, extra)
    assert cand is not None
    by_id = {st.id: st for st in cand.stages}
    for st in cand.stages:
        for j in succ[st.id]:
            assert st.in_flight >= min(cand.num_micro_batches, by_id[j].in_flight + 1)
    simulate_pipeline(cand)  # raises on a deadlock


def test_extra_warm_up_within_the_memory_limit(v100, zoo_graph) -> None:
    # MMT's stages hold large activations: a limit that fits Table 3.2's counts but not 16 more
    # warm-up micro-batches gives None, not a plan over the limit.
    g = zoo_graph("mmt", "paper")
    pipe = partition(g, v100, PartitionOptions(mini_batch=128, num_devices=8))
    unlimited = dataclasses.replace(pipe, memory_limit=float("inf"))
    least = scheduled(unlimited, {})
    ahead = scheduled(unlimited, {st.id: 16 for st in pipe.stages})
    assert least is not None and ahead is not None
    fits = max(st.memory.peak for st in least.stages)
    assert max(st.memory.peak for st in ahead.stages) > fits
    assert scheduled(pipe, {st.id: 16 for st in pipe.stages}) is None  # nor on 16 GB V100s
    tight = dataclasses.replace(pipe, memory_limit=fits)
    assert scheduled(tight, {}) is not None
    assert scheduled(tight, {st.id: 16 for st in pipe.stages}) is None
    tuned, _ = tune_warm_up(scheduled(tight, {}))
    assert all(st.memory.peak <= fits for st in tuned.stages)


def test_tuning_is_never_slower_and_respects_memory(candle16) -> None:
    _, pipe = candle16
    # The partitioner starts the tuning from the fastest uniform extra warm-up (0, 1 or 2).
    uniform = [scheduled(pipe, {st.id: x for st in pipe.stages}) for x in (0, 1, 2)]
    start = min((p for p in uniform if p is not None), key=lambda p: simulate_pipeline(p).iteration_time)
    t0 = simulate_pipeline(start).iteration_time
    tuned, t = tune_warm_up(start)
    assert t == simulate_pipeline(tuned).iteration_time
    # Per stage, the branch stages run further ahead than the top MLP's stages need: faster
    # than any one warm-up for all.
    assert t < 0.97 * t0
    for st in tuned.stages:
        assert st.in_flight == in_flight_of(st.schedule)
        assert st.memory.peak <= tuned.memory_limit
    again, t_again = tune_warm_up(start)
    assert t_again == t and [s.in_flight for s in again.stages] == [s.in_flight for s in tuned.stages]


def test_branches_into_one_merge_are_tuned_together(v100) -> None:
    # CANDLE-Uno with its top layer split over the branches (concat-matmul) on 32 V100s: seven
    # branch stages feed the merge stage. One branch running ahead gains nothing while the others
    # hold the merge back, so stage-by-stage tuning from Table 3.2's counts stayed there (0.060 s
    # per iteration); the branches need several more warm-up micro-batches together (0.040 s).
    data = v100.to_json_dict()
    data["nodes"] = [{**data["nodes"][0], "count": 8}]
    g = load_graph(build("candle_uno", "paper"), rewrites=["concat-matmul"])
    cluster = ClusterSpec.from_json_dict(data)
    pipe = partition(g, cluster, PartitionOptions(mini_batch=32768, micro_batch_sizes=(4096,)))
    succ = _successors(pipe)
    merge = [st.id for st in pipe.stages if not succ[st.id]]
    assert len(merge) == 1 and all(succ[st.id] == merge for st in pipe.stages if st.id != merge[0])
    start = scheduled(pipe, {})
    uniform = [scheduled(pipe, _uniform(pipe, x)) for x in range(pipe.num_micro_batches + 1)]
    best_uniform = min(simulate_pipeline(p).iteration_time for p in uniform if p is not None)
    tuned, t = tune_warm_up(start)
    assert t <= best_uniform < 0.7 * simulate_pipeline(start).iteration_time
    assert all(st.memory.peak <= tuned.memory_limit for st in tuned.stages)
    # The whole search: the same stage graph at micro-batch 2048 ranks first before tuning, but
    # each stage graph and micro-batch size gets the joint step, and 4096 wins once tuned.
    best = partition(g, cluster, PartitionOptions(mini_batch=32768))
    assert best.micro_batch_size == 4096 and [st.units for st in best.stages] == [
        st.units for st in pipe.stages
    ]
    assert simulate_pipeline(best).iteration_time == pytest.approx(t, rel=1e-9)


def test_spp_guided_proposals_are_sequential_and_no_slower(v100, zoo_graph) -> None:
    g = zoo_graph("candle_uno", "paper")
    opts = PartitionOptions(mini_batch=16384, num_devices=16)
    tree = build_tree(g, CostModel.for_device(v100.devices()[0].type), opts.max_units)
    chain_only = partition(g, v100, opts, tree=tree.linearized(), kind="spp")
    best = plan_spp(g, v100, opts, tree=tree)
    assert best.pipeline_depth == len(best.stages)  # stage i+1 after stage i
    order = nx.DiGraph([(e.src, e.dst) for e in best.edges])
    assert all(order.has_edge(i, i + 1) for i in range(len(best.stages) - 1))
    for st in best.stages:  # contiguous unit ranges of the one depth-first order
        assert st.units[0] < st.units[1]
    assert [st.units[0] for st in best.stages[1:]] == [st.units[1] for st in best.stages[:-1]]
    assert simulate_pipeline(best).iteration_time <= simulate_pipeline(chain_only).iteration_time
