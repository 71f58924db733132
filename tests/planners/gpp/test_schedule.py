from __future__ import annotations

from tessera.planners.gpp.schedule import (
    check_schedule,
    compute_in_flight,
    format_grid,
    from_pytorch_csv,
    gpipe,
    in_flight_of,
    k_f_k_b,
    one_f_one_b,
    parse_action,
    to_pytorch_csv,
)


def test_table_3_2_rows() -> None:
    assert compute_in_flight(1, 4, 1, 4, 8) == 12  # equal: i_y + b
    assert compute_in_flight(1, 2, 1, 4, 8) == 12  # b_x < b_y: i_y + b_y
    assert compute_in_flight(1, 4, 1, 2, 8) == 14  # b_y < b_x: i_y + 2 b_x - b_y
    assert compute_in_flight(2, 4, 2, 4, 0) == 8  # max < k_y b_y = k_x b_x: i_y + 2 max
    assert compute_in_flight(1, 4, 2, 4, 0) == 4  # max = k_x b_x < k_y b_y: i_y + max


def test_generators_respect_c4_and_in_flight() -> None:
    for warm in (1, 2, 4, 9):
        acts = one_f_one_b(8, warm)
        assert check_schedule(acts, 8) == []
        assert in_flight_of(acts) == min(warm, 8)
    acts = k_f_k_b(8, 2, 4)
    assert check_schedule(acts, 8) == []
    assert in_flight_of(acts) == 4
    assert in_flight_of(gpipe(5)) == 5
    assert check_schedule(["B0", "F0"], 1)


def test_text_forms_round_trip() -> None:
    assert parse_action("2F13") == (2, "F", 13)
    assert parse_action("B0") == (None, "B", 0)
    sched = {0: one_f_one_b(4, 2), 1: one_f_one_b(4, 1)}
    csv_text = to_pytorch_csv(sched)
    assert csv_text.splitlines()[1].startswith("1F0,1B0")
    assert from_pytorch_csv(csv_text) == sched
    grid = format_grid(sched)
    assert grid.splitlines()[0].startswith("stage")
    assert "B3" in grid
