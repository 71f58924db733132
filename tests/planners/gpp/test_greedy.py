from __future__ import annotations

import pytest

from tessera.core.graph import load_graph
from tessera.core.plans import check_plan_against_model
from tessera.core.specs import load_cluster
from tessera.models import build
from tessera.planners.gpp.cli import build_gpp_plan
from tessera.planners.gpp.greedy import greedy_schedules
from tessera.planners.gpp.partition import PartitionOptions
from tessera.planners.gpp.schedule import check_schedule, gpipe, in_flight_of, one_f_one_b
from tessera.planners.sim import SimEdge, SimStage, simulate


def _stages(times, actions):
    return [SimStage(i, 1, f, b, tuple(a)) for i, ((f, b), a) in enumerate(zip(times, actions, strict=True))]


@pytest.mark.parametrize("latency", [0.0, 0.5, 2.0])
def test_greedy_is_time_optimal_with_fewest_in_flight(latency: float) -> None:
    m = 8
    times = [(1.0, 2.0), (1.0, 2.0), (0.5, 1.0)]
    edges = [SimEdge(0, 1, 1.0, 1.0, latency), SimEdge(1, 2, 1.0, 1.0, latency)]
    sched = greedy_schedules(_stages(times, [()] * 3), edges, m)
    for actions in sched.values():
        assert check_schedule(actions, m) == []  # C4
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


def test_greedy_plan_passes_checks_and_is_not_slower() -> None:
    g = load_graph(build("mmt", "paper"))
    cluster = load_cluster("graphpipe-v100")
    times = {}
    for schedule in ("1f1b", "greedy"):
        opts = PartitionOptions(mini_batch=64, num_devices=8, schedule=schedule, micro_batch_sizes=(8,))
        plan, _, sim = build_gpp_plan(g, cluster, opts, baseline=False)
        assert check_plan_against_model(plan, g) == []
        assert plan.stages[0].schedule.kind == schedule
        times[schedule] = sim.iteration_time
    assert times["greedy"] <= times["1f1b"] * (1 + 1e-9)
