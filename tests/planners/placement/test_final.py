"""The final choice of ``place`` (issue #30): a mixed placement is kept only when it measures faster
than the best single backend beyond the noise margin, and a repeat run reads the medians it stored."""

from __future__ import annotations

import math

from tessera.backends.profile_cache import ProfileCache
from tessera.planners.placement.final import NOISE_MARGIN, final_choice, remembered_latencies, whole_model_key


def test_a_placement_within_the_noise_of_the_best_single_backend_is_not_kept() -> None:
    singles = {"onnxruntime": 1.00e-3, "openvino": 1.10e-3}
    within = final_choice(0.97e-3, singles)  # 3% faster: noise
    assert not within.keep_placement and within.best_single == "onnxruntime"
    assert "not faster than onnxruntime" in within.note and f"{NOISE_MARGIN:.0%}" in within.note
    beyond = final_choice(0.90e-3, singles)  # 10% faster
    assert beyond.keep_placement and "1.11x the speed of onnxruntime" in beyond.note
    assert not final_choice(1.2e-3, singles).keep_placement  # slower: never kept
    assert not final_choice(math.inf, singles).keep_placement  # the placement failed to run


def test_ties_and_missing_singles_are_decided_deterministically() -> None:
    assert final_choice(1.0, {"openvino": 1.0, "onnxruntime": 1.0}).best_single == "onnxruntime"
    assert final_choice(1.0, {"openvino": math.inf}).keep_placement  # nothing else ran the model


def test_repeat_runs_read_the_stored_medians(tmp_path) -> None:
    cache = ProfileCache(tmp_path / "p.sqlite")
    keys = {"placement": whole_model_key("abc", [("openvino", ["n1"]), ("onnxruntime", ["n2"])]),
            "onnxruntime": whole_model_key("abc", [("onnxruntime", ["n1", "n2"])])}  # fmt: skip
    timings = iter(
        [{"placement": 1.0e-3, "onnxruntime": 1.2e-3}, {"placement": 2.0e-3, "onnxruntime": 0.5e-3}]
    )
    first, cached = remembered_latencies(cache, keys, "v1", "cpu", lambda: next(timings))
    assert not cached and first == {"placement": 1.0e-3, "onnxruntime": 1.2e-3}
    again, cached = remembered_latencies(cache, keys, "v1", "cpu", lambda: next(timings))
    assert cached and again == first  # no live timing: the same medians, the same choice
    other, cached = remembered_latencies(cache, keys, "v2", "cpu", lambda: next(timings))
    assert not cached and other["onnxruntime"] == 0.5e-3  # another backend version: timed anew
