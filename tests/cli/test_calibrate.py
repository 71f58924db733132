"""``tessera calibrate``'s bad options: one line and exit 2, before any worker starts."""

from __future__ import annotations

import pytest
from cli_runner import run_cli


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--ranks", "0"], "--ranks 0"),
        (["--ranks", "1"], "--ranks 1"),
        (["--ranks", "100000"], "--ranks 100000"),
        (["--ranks", "two"], "--ranks"),
        (["--threads-per-rank", "0"], "--threads-per-rank 0"),
        (["--threads-per-rank", "100000"], "--threads-per-rank 100000"),
        (["--seconds", "0"], "--seconds"),
        (["--seconds", "nan"], "--seconds"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(args, named):
    result = run_cli("calibrate", *args)
    assert result.code == 2, result.err
    assert result.out == ""
    assert len(result.err.strip().splitlines()) == 1 and named in result.err


def test_out_into_a_missing_folder_is_exit_2_naming_the_path(tmp_path):
    target = tmp_path / "missing" / "spec.yaml"
    result = run_cli("calibrate", "--out", str(target))
    assert result.code == 2
    assert len(result.err.strip().splitlines()) == 1 and str(target) in result.err
    assert not target.parent.exists()


def test_out_naming_a_folder_is_exit_2(tmp_path):
    result = run_cli("calibrate", "--out", str(tmp_path))
    assert result.code == 2 and str(tmp_path) in result.err
