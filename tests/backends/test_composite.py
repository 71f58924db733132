"""The composite model: placements over onnxruntime and OpenVINO compute onnxruntime's outputs.

Tolerance: rtol 1e-3, atol 1e-4 (``VERIFY_RTOL``/``VERIFY_ATOL``): fp32, backends reorder reductions
and fuse differently; the differences stay far below it on these models.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from onnx_builders import ONNX_LIGHT_MODELS

from tessera.backends.composite import (
    CompositeModel,
    compare_outputs,
    latencies,
    random_feeds,
    ranking_is_clear,
    reference_outputs,
)
from tessera.core.errors import LaunchError
from tessera.core.graph import load_graph
from tessera.models import build
from tessera.planners.placement.candidates import owned_constants
from tessera.planners.placement.dp import frontier_order


def alternating(graph, size: int) -> list[tuple[str, list[str]]]:
    """Runs of ``size`` operators of the frontier order (with owned constants), ORT and OpenVINO in turn."""
    owner = {c: v for v, cs in owned_constants(graph).items() for c in cs}
    groups: list[tuple[str, list[str]]] = []
    current: list[str] = []
    for n in frontier_order(graph):
        current.append(n)
        if len([m for m in current if m not in owner]) >= size and n not in owner:
            groups.append(("onnxruntime" if len(groups) % 2 == 0 else "openvino", current))
            current = []
    if current:
        groups.append(("onnxruntime" if len(groups) % 2 == 0 else "openvino", current))
    return groups


ZOO = ["mmt", "dlrm", "candle_uno", "resnext", "bert", "gpt"]
LIGHT = [
    p for p in ONNX_LIGHT_MODELS if p.stem in ("light_inception_v1", "light_shufflenet", "light_resnet50")
]


@pytest.mark.parametrize("source", ZOO + LIGHT, ids=lambda s: getattr(s, "stem", s))
def test_mixed_placement_matches_onnxruntime(source) -> None:
    graph = load_graph(build(source, "tiny") if isinstance(source, str) else source)
    feeds = random_feeds(graph, seed=1)
    model = CompositeModel(graph, alternating(graph, 6))
    assert model.backends == ["onnxruntime", "openvino"]
    report = compare_outputs(model.run(feeds), reference_outputs(graph, feeds))
    assert report["ok"], report


def test_tensors_are_released_after_their_last_reader() -> None:
    graph = load_graph(build("resnext", "tiny"))
    model = CompositeModel(graph, alternating(graph, 4))
    released = [t for s in model.steps for t in s.release]
    assert len(released) == len(set(released)) and released
    assert not set(released) & set(graph.outputs)


def test_bad_placements_are_refused() -> None:
    graph = load_graph(build("candle_uno", "tiny"))
    order = list(graph.order)
    with pytest.raises(LaunchError, match="exactly once"):
        CompositeModel(graph, [("onnxruntime", order[1:])])
    # a and c in one group, b (between them) in another: the groups depend on each other.
    cyclic = [("onnxruntime", [order[0], *order[2:]]), ("onnxruntime", [order[1]])]
    with pytest.raises(LaunchError, match="cycle"):
        CompositeModel(graph, cyclic)


def test_latencies_interleaved() -> None:
    out = latencies({"fast": lambda: None, "slow": lambda: sum(range(2000))}, rounds=3, min_round_s=0.005)
    assert list(out) == ["fast", "slow"] and 0 < out["fast"] < out["slow"]

    def broken() -> None:
        raise RuntimeError("no")

    assert latencies({"x": broken}, rounds=1)["x"] == float("inf")


def test_latencies_stop_once_the_ranking_is_clear() -> None:
    calls = {"slow": 0}

    def slow() -> None:
        calls["slow"] += 1
        time.sleep(0.003)

    # One call per round (min_round_s below one call): 3 warm-up + 1 probe, then 2 per round.
    latencies({"fast": lambda: None, "slow": slow}, rounds=20, min_rounds=3, min_round_s=0.001, settle_s=0)
    assert calls["slow"] == 4 + 2 * 3
    assert ranking_is_clear({"a": [1.0, 1.1], "b": [1.2, 1.3]})
    assert not ranking_is_clear({"a": [1.0, 1.25], "b": [1.2, 1.3]})


def test_compare_outputs_reports_differences() -> None:
    a = {"y": np.ones((2, 2), np.float32)}
    assert compare_outputs(a, a)["ok"]
    bad = compare_outputs({"y": a["y"] + 0.1}, a)
    assert not bad["ok"] and bad["outputs"]["y"]["max_abs_diff"] == pytest.approx(0.1)


def test_onnxruntime_groups_next_to_another_backend_do_not_spin_and_small_ones_use_one_thread() -> None:
    from tessera.backends.composite import ONE_THREAD, composite_variant, written_bytes

    graph = load_graph(build("resnext", "tiny"))
    nodes = graph.order[:3]
    small = written_bytes(graph, nodes) <= 256 * 1024
    assert composite_variant(graph, "onnxruntime", nodes, mixed=False) == "onnxruntime"
    assert composite_variant(graph, "openvino", nodes, mixed=True) == "openvino"
    variant = composite_variant(graph, "onnxruntime", nodes, mixed=True)
    assert variant.startswith("onnxruntime/no-spin") and (ONE_THREAD in variant) == small
    # A placement with several backends runs its onnxruntime groups as built here, outputs unchanged.
    model = CompositeModel(graph, alternating(graph, 8))
    feeds = random_feeds(graph, seed=2)
    assert compare_outputs(model.run(feeds), reference_outputs(graph, feeds))["ok"]
