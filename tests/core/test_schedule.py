from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.core.plans import StageSchedule
from tessera.core.schedule import (
    SCHEDULE_CHOICES,
    SCHEDULE_KINDS,
    Action,
    format_grid,
    from_pytorch_csv,
    gpipe,
    in_flight_of,
    k_f_k_b,
    one_f_one_b,
    schedule_problems,
    to_pytorch_csv,
)
from tessera.planners.pipeline.schedule import compute_in_flight


def test_table_3_2_rows() -> None:
    assert compute_in_flight(1, 4, 1, 4, 8) == 12  # equal: i_y + b
    assert compute_in_flight(1, 2, 1, 4, 8) == 12  # b_x < b_y: i_y + b_y
    assert compute_in_flight(1, 4, 1, 2, 8) == 14  # b_y < b_x: i_y + 2 b_x - b_y
    assert compute_in_flight(2, 4, 2, 4, 0) == 8  # max < k_y b_y = k_x b_x: i_y + 2 max
    assert compute_in_flight(1, 4, 2, 4, 0) == 4  # max = k_x b_x < k_y b_y: i_y + max


def test_generators_respect_c4_and_in_flight() -> None:
    for warm in (1, 2, 4, 9):
        acts = one_f_one_b(8, warm)
        assert schedule_problems(acts, 8) == []
        assert in_flight_of(acts) == min(warm, 8)
    acts = k_f_k_b(8, 2, 4)
    assert schedule_problems(acts, 8) == []
    assert in_flight_of(acts) == 4
    assert in_flight_of(gpipe(5)) == 5
    assert schedule_problems(["B0", "F0"], 1)


def test_text_forms_round_trip() -> None:
    assert Action.parse("2F13") == Action(2, "F", 13)
    assert Action.parse("B0") == Action(None, "B", 0)
    assert str(Action(2, "B", 7)) == "2B7" and str(Action.parse(" F3 ")) == "F3"
    sched = {0: one_f_one_b(4, 2), 1: one_f_one_b(4, 1)}
    csv_text = to_pytorch_csv(sched)
    assert csv_text.splitlines()[1].startswith("1F0,1B0")
    assert from_pytorch_csv(csv_text) == sched
    grid = format_grid(sched)
    assert grid.splitlines()[0].startswith("stage")
    assert "B3" in grid


@pytest.mark.parametrize("text", ["", "F", "X3", "F-1", "2F", "F3B", "3"])
def test_what_is_not_an_action_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a pipeline action"):
        Action.parse(text)


@given(st.integers(0, 999), st.sampled_from(["F", "B"]), st.integers(0, 10**6), st.booleans())
def test_actions_print_and_parse_back(stage: int, kind: str, micro_batch: int, staged: bool) -> None:
    action = Action(stage if staged else None, kind, micro_batch)  # type: ignore[arg-type]
    assert Action.parse(str(action)) == action


def test_one_rule_for_the_planner_simulator_and_executor() -> None:
    """Out-of-order forwards, a repeated pass, a backward before its forward, a missing pass and a
    pass past the micro-batches are each refused (the executor used to accept the first)."""
    assert schedule_problems(["F1", "F0", "B0", "B1"], 2) == ["forwards are not F0..F1 in order"]
    assert schedule_problems(["F0", "F0", "B0"], 1) == ["forwards are not F0..F0 in order"]
    assert schedule_problems(["B0", "F0"], 1) == ["B0 before F0"]
    assert schedule_problems(["F0", "B0"], 2) == [
        "forwards are not F0..F1 in order",
        "backwards are not B0..B1 in order",
    ]
    assert schedule_problems(["F0", "F2", "B0", "B2"], 2)[0] == "F2: there are 2 micro-batches (0..1)"


@pytest.mark.parametrize("kind", [k for k, g in SCHEDULE_KINDS.items() if g.generate])
@pytest.mark.parametrize(("m", "warm_up", "k"), [(1, 1, 1), (8, 3, 2), (16, 16, 4), (5, 9, 3)])
def test_every_generated_schedule_is_valid_and_storable(kind: str, m: int, warm_up: int, k: int) -> None:
    generate = SCHEDULE_KINDS[kind].generate
    assert generate is not None
    actions = generate(m, warm_up, k)
    assert schedule_problems(actions, m) == []
    StageSchedule(kind=kind, k=k if kind == "kfkb" else 1, actions=actions)  # the plan schema takes it


def test_the_kinds_are_listed_once() -> None:
    assert SCHEDULE_CHOICES == ("1f1b", "kfkb", "greedy", "gpipe", "auto")
    assert set(StageSchedule.model_fields["kind"].annotation.__args__) == set(SCHEDULE_KINDS)
