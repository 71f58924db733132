from __future__ import annotations

import dataclasses

import pytest

from tessera.core.graph import Graph
from tessera.core.plan_checks import check_plan_against_model
from tessera.core.schedule import gpipe, in_flight_of, one_f_one_b, schedule_problems
from tessera.core.specs import ClusterSpec
from tessera.planners.pipeline.greedy import greedy_schedules
from tessera.planners.pipeline.materialize import scheduled
from tessera.planners.pipeline.plan import plan_gpp
from tessera.planners.pipeline.types import PartitionOptions
from tessera.planners.sim import SimEdge, SimStage, simulate, simulate_pipeline


def _stages(times, actions):
    return [SimStage(i, 1, f, b, tuple(a)) for i, ((f, b), a) in enumerate(zip(times, actions, strict=True))]


@pytest.mark.parametrize("latency", [0.0, 0.5, 2.0])
def test_greedy_is_time_optimal_with_fewest_in_flight(latency: float) -> None:
    m = 8
    times = [(1.0, 2.0), (1.0, 2.0), (0.5, 1.0)]
    edges = [SimEdge(0, 1, 1.0, 1.0, latency), SimEdge(1, 2, 1.0, 1.0, latency)]
    sched = greedy_schedules(_stages(times, [()] * 3), edges, m)
    for actions in sched.values():
        assert schedule_problems(actions, m) == []  # C4
    greedy = simulate(_stages(times, [sched[i] for i in range(3)]), edges, m)  # no deadlock: C5
    eager = simulate(_stages(times, [gpipe(m)] * 3), edges, m)
    assert greedy.iteration_time <= eager.iteration_time * (1 + 1e-9)  # time-optimal
    for sid in range(3):
        assert in_flight_of(sched[sid]) <= m
    assert in_flight_of(sched[2]) == 1  # the last stage needs nothing in flight
    # Each stage finishes as early as all-forwards-first would let it, with fewer in flight, and
    # so never later than 1F1B with Table 3.2's minimal warm-up.
    assert in_flight_of(sched[0]) < m
    onefoneb = simulate(_stages(times, [one_f_one_b(m, 3 - i) for i in range(3)]), edges, m)
    assert greedy.iteration_time <= onefoneb.iteration_time * (1 + 1e-9)


def test_greedy_plan_passes_checks_and_is_not_slower(v100, zoo_graph) -> None:
    """Algorithm 4 on a plan's stages is never slower than 1F1B with Table 3.2's warm-up on the
    same stages. It can be slower than the 1F1B search's plan, whose warm-up is tuned on the
    simulator (MMT here: 0.2 %); ``auto`` keeps the faster of the two."""
    g = zoo_graph("mmt", "paper")
    times, pipes = {}, {}
    for schedule in ("1f1b", "greedy", "auto"):
        opts = PartitionOptions(mini_batch=64, num_devices=8, schedule=schedule, micro_batch_sizes=(8,))
        plan, pipes[schedule], sim = plan_gpp(g, v100, opts, baseline=False)
        assert check_plan_against_model(plan, g) == []
        assert plan.stages[0].schedule.kind == ("1f1b" if schedule == "auto" else schedule)
        times[schedule] = sim.iteration_time
    plain = scheduled(dataclasses.replace(pipes["greedy"], schedule_kind="1f1b"), {})
    assert times["greedy"] <= simulate_pipeline(plain).iteration_time * (1 + 1e-9)
    assert times["auto"] <= min(times["1f1b"], times["greedy"]) * (1 + 1e-9)


def _auto_vs_1f1b(g: Graph, cluster: ClusterSpec, devices: int, mini_batch: int):
    out = {}
    for schedule in ("1f1b", "auto"):
        opts = PartitionOptions(mini_batch=mini_batch, num_devices=devices, schedule=schedule)
        out[schedule] = plan_gpp(g, cluster, opts)
    return out


@pytest.mark.slow  # two searches of the paper-size CANDLE-Uno on 16 devices
def test_auto_reschedules_a_graph_pipeline_by_algorithm_4_where_that_is_faster(v100, zoo_graph) -> None:
    # CANDLE-Uno on 16 V100s: a graph pipeline of the 1F1B search, rescheduled greedily (374.6k
    # samples/s), beats the 1F1B plan (373.8k, its warm-up tuned) and the sequential plan (336.8k).
    # 1F1B with a tuned warm-up comes close to Algorithm 4 on most plans; auto keeps whichever
    # simulates faster.
    g = zoo_graph("candle_uno", "paper")
    out = _auto_vs_1f1b(g, v100, 16, 16384)
    (plan, pipe, sim), (plan_1f1b, _, sim_1f1b) = out["auto"], out["1f1b"]
    assert check_plan_against_model(plan, g) == []
    assert plan.predicted["structure"] == "graph" == plan_1f1b.predicted["structure"]
    assert {st.schedule.kind for st in plan.stages} == {"greedy"}
    assert {st.schedule.kind for st in plan_1f1b.stages} == {"1f1b"}
    assert sim.throughput == pytest.approx(374560.7, rel=1e-6)
    assert sim_1f1b.throughput == pytest.approx(373798.6, rel=1e-6)
    assert sim.throughput > sim_1f1b.throughput
    assert plan.baseline["throughput_samples_per_s"] == pytest.approx(336814.5, rel=1e-4)
    for st in plan.stages:
        assert schedule_problems(st.schedule.actions, pipe.num_micro_batches) == []  # C4
        assert st.in_flight == in_flight_of(st.schedule.actions)


def test_auto_reschedules_beyond_the_1f1b_winner(v100, zoo_graph) -> None:
    # CANDLE-Uno on 16 V100s: 1F1B's winning graph pipeline (373.8k samples/s, its warm-up tuned)
    # reaches 361.2k rescheduled by Algorithm 4; another candidate of the same search, with
    # another stage graph, reaches 374.6k rescheduled, as much as searching with Algorithm 4
    # inside (every candidate greedy).
    import dataclasses

    from tessera.planners.pipeline.materialize import scheduled
    from tessera.planners.pipeline.search import partition
    from tessera.planners.sim import simulate_pipeline

    g = zoo_graph("candle_uno", "paper")
    pipes = {
        schedule: partition(g, v100, PartitionOptions(mini_batch=16384, num_devices=16, schedule=schedule))
        for schedule in ("1f1b", "auto", "greedy")
    }
    thr = {k: simulate_pipeline(p, trace=False).throughput for k, p in pipes.items()}
    winner = scheduled(dataclasses.replace(pipes["1f1b"], schedule_kind="greedy"), {})
    assert winner is not None
    winner_thr = simulate_pipeline(winner, trace=False).throughput
    assert winner_thr == pytest.approx(361229.7, rel=1e-6)
    assert thr["1f1b"] == pytest.approx(373798.6, rel=1e-6)
    assert thr["auto"] == pytest.approx(374560.7, rel=1e-6)
    assert thr["auto"] == pytest.approx(thr["greedy"], rel=1e-9)
    assert thr["auto"] > thr["1f1b"] > winner_thr
    auto = pipes["auto"]
    assert auto.schedule_kind == "greedy"
    assert [st.units for st in auto.stages] != [st.units for st in pipes["1f1b"].stages]
    for st in auto.stages:
        assert schedule_problems(st.schedule, auto.num_micro_batches) == []  # C4
        assert st.memory.peak <= auto.memory_limit


@pytest.mark.parametrize(
    ("name", "devices", "mini_batch", "throughput"),
    [
        # DLRM on 8 V100s: single-device stages feeding one; greedy ties with the tuned 1F1B.
        ("dlrm", 8, 512, 49823.0),
        # CANDLE-Uno on 8: with four of its branch stages 4–8 micro-batches further ahead than
        # Table 3.2's counts, 1F1B reaches what Algorithm 4 makes of the same stages (a tie: 1F1B
        # kept).
        ("candle_uno", 8, 8192, 175477.8),
    ],
)
def test_auto_keeps_1f1b_where_algorithm_4_is_no_faster(
    v100, zoo_graph, name, devices, mini_batch, throughput
) -> None:
    out = _auto_vs_1f1b(zoo_graph(name, "paper"), v100, devices, mini_batch)
    assert out["auto"][0].model_dump() == out["1f1b"][0].model_dump()
    assert out["auto"][2].throughput == pytest.approx(throughput, rel=1e-4)
    assert out["auto"][0].predicted["structure"] == "graph"


def test_auto_keeps_1f1b_where_algorithm_4_would_take_too_long(v100, zoo_graph, monkeypatch) -> None:
    from tessera.planners.pipeline import tuning
    from tessera.planners.pipeline.search import partition

    g = zoo_graph("candle_uno", "paper")
    opts = PartitionOptions(mini_batch=8192, num_devices=8, schedule="auto")
    monkeypatch.setattr(tuning, "_GREEDY_TASKS", 0)
    pipe = partition(g, v100, opts)
    assert pipe.schedule_kind == "1f1b"
