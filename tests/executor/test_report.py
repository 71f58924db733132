"""The one report of every plan kind: the warm-up rule, ratios, the JSON shape, the runner table."""

from __future__ import annotations

import pytest

from tessera.executor import RUNNERS, LaunchRequest, RunReport
from tessera.executor.report import counted_steps, gathered, over, ratios, slowest, steady_mean


def test_the_first_step_is_left_out_of_means_unless_it_is_the_only_one() -> None:
    assert list(counted_steps([5.0, 1.0, 2.0])) == [1.0, 2.0]
    assert list(counted_steps([5.0])) == [5.0]
    assert steady_mean([9.0, 1.0, 3.0]) == pytest.approx(2.0)
    assert steady_mean([4.0]) == 4.0


def test_ratios_are_measured_over_predicted_and_none_without_a_prediction() -> None:
    assert over(2.0, 4.0) == 0.5
    assert over(2.0, None) is None and over(2.0, 0.0) is None and over(None, 1.0) is None
    got = ratios({"a_s": 3.0, "b": 1.0}, {"a_s": 1.5}, {"a": "a_s", "b": "b"})
    assert got == {"a": 2.0, "b": None}


def test_per_rank_results_and_the_slowest_rank() -> None:
    ranks = [{"rank": 0, "steps": [{"t": 1.0}]}, {"rank": 1, "steps": [{"t": 3.0}]}]
    assert gathered({0: {**ranks[0], "all": ranks}, 1: ranks[1]}) == ranks
    assert gathered({1: ranks[1]}) == [ranks[1]]  # another node: only its own ranks
    assert slowest(ranks, 0, "t") == 3.0


def test_every_report_has_the_shared_keys() -> None:
    report = RunReport(plan_path="p.json", kind="gpp", measured={"x": 1.0}, predicted={}, ratio={"x": None})
    assert report.failure is None
    assert report.to_json() == {
        "plan": "p.json",
        "kind": "gpp",
        "steps": [],
        "ranks": [],
        "measured": {"x": 1.0},
        "predicted": {},
        "ratio": {"x": None},
    }


def test_launch_dispatches_every_plan_kind_through_one_table() -> None:
    assert set(RUNNERS) == {"gpp", "spp", "cp", "placement"}
    assert LaunchRequest().launch.timeout_s > 0


def test_an_all_reduce_over_tied_weights_is_the_last_arrivals_and_the_wait_is_idle() -> None:
    # Stage 1 reaches the all-reduce of the weight it shares with stage 0 first and waits there
    # for stage 0's last backward (1.8 ms); the plan counts that wait as idle, so does fidelity.
    from tessera.executor.gpp_run import fidelity

    stages = [
        {"id": i, "busy_s": busy, "predicted_busy_s": busy, "predicted_allreduce_s": 3e-4}
        for i, busy in ((0, 8e-3), (1, 6e-3))
    ]
    ranks = [{"rank": 0, "stage": 0, "allreduce_s": 3e-4}, {"rank": 1, "stage": 1, "allreduce_s": 1.8e-3}]
    measured = {"iteration_time_s": 1e-2, "iteration_median_s": 9e-3}
    predicted = {"iteration_time_s": 1e-2}
    report = fidelity(measured, predicted, stages, ranks, {0: [1], 1: [0]})
    # The mean step against the prediction, and the typical (median) one.
    assert report["iteration"]["error"] == pytest.approx(0.0)
    assert report["iteration"]["median_s"] == 9e-3
    assert report["iteration"]["median_error"] == pytest.approx(-0.1)
    got = report["stages"]
    assert [row["allreduce"]["measured_s"] for row in got] == [3e-4, 3e-4]
    assert got[1]["idle"]["measured_s"] == pytest.approx(1e-2 - 6e-3 - 3e-4)
    alone = fidelity(measured, predicted, stages, ranks)["stages"]  # no tied weights: its own wait
    assert alone[1]["allreduce"]["measured_s"] == 1.8e-3
