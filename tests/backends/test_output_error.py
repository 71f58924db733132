"""The one error measure place, validate and launch report: relative to each output's scale, and
a NaN or infinity the reference does not have is infinitely wrong (never 0)."""

from __future__ import annotations

import math

import numpy as np

from tessera.backends.composite import output_error, relative_error, within_tolerance


def test_relative_to_each_outputs_scale() -> None:
    want = {"a": np.array([10.0, -20.0]), "b": np.array([0.5, 0.25])}
    got = {"a": np.array([10.2, -20.0]), "b": np.array([0.5, 0.26])}
    error = output_error(got, want)
    assert math.isclose(error["max_abs"], 0.2)
    assert math.isclose(error["max_rel"], max(0.2 / 20.0, 0.01 / 0.5))
    assert relative_error(got, want) == error["max_rel"]


def test_a_nan_or_an_infinity_the_reference_lacks_is_infinitely_wrong() -> None:
    want = {"y": np.array([1.0, 2.0, 3.0])}
    for bad in (np.nan, np.inf, -np.inf):
        got = {"y": np.array([1.0, bad, 3.0])}
        assert output_error(got, want) == {"max_abs": math.inf, "max_rel": math.inf}
        assert not within_tolerance(got, want, 1e9)


def test_the_same_non_finite_values_agree() -> None:
    want = {"y": np.array([np.nan, np.inf, 2.0])}
    assert output_error({"y": np.array([np.nan, np.inf, 2.5])}, want) == {"max_abs": 0.5, "max_rel": 0.25}
    assert output_error({"y": np.array([np.nan, -np.inf, 2.0])}, want)["max_rel"] == math.inf


def test_a_shape_mismatch_is_infinitely_wrong() -> None:
    assert output_error({"y": np.zeros(3)}, {"y": np.zeros(4)})["max_rel"] == math.inf
