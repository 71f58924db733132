"""The placement search stays bounded on wide graphs: fused candidates reading many activations
are not measured, at most ``max_fused`` others are (those that can win the most), the DP's state
key does not grow with the open producers, and slow-compiling backends join only when named."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from tessera.backends.measure import Measurer
from tessera.backends.profile_cache import ProfileCache
from tessera.backends.registry import default_registry
from tessera.core.graph import load_graph
from tessera.planners.placement import PlacementOptions, plan_placement
from tessera.planners.placement.plan import resolve_backends


def _fan(path: Path, n: int) -> Path:
    """``x`` read by ``n`` Relus, summed by one ``Sum`` of ``n`` inputs."""
    nodes = [helper.make_node("Relu", ["x"], [f"r{i}"], name=f"relu{i}") for i in range(n)]
    nodes.append(helper.make_node("Sum", [f"r{i}" for i in range(n)], ["y"], name="sum"))
    graph = helper.make_graph(
        nodes,
        "fan",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _place(path: Path, cache: Path, **options):
    graph = load_graph(str(path))
    measurer = Measurer(ProfileCache(cache))
    return graph, plan_placement(
        graph, PlacementOptions(backends=("onnxruntime",), **options), measurer=measurer
    )


def test_a_wide_fan_out_measures_no_fused_candidate_of_its_sum(tmp_path: Path) -> None:
    """200 candidates fuse one Relu into the 200-input Sum: none is measured (each was a session
    over 200 inputs), the 200 identical Relus are measured once, and every operator is placed."""
    graph, result = _place(_fan(tmp_path / "fan.onnx", 200), tmp_path / "c.sqlite")
    search = result.plan.search
    assert search["unmeasured_candidates"] == 200
    assert result.report["measured_candidates"] <= 4
    placed = [n for g in result.plan.groups for n in g.nodes]
    assert sorted(placed) == sorted(graph.order)


def test_at_most_max_fused_fused_candidates_are_measured_and_a_warm_run_agrees(tmp_path: Path) -> None:
    from tessera.models import build

    path = tmp_path / "mmt.onnx"
    onnx.save(build("mmt", "tiny"), path)
    cache = tmp_path / "c.sqlite"
    _, cold = _place(path, cache, max_fused=5)
    fused = cold.plan.search["candidates"] - cold.plan.search["unmeasured_candidates"]
    assert cold.plan.search["unmeasured_candidates"] > 0 and fused > 0
    _, warm = _place(path, cache, max_fused=5)
    assert warm.plan.search["unmeasured_candidates"] == cold.plan.search["unmeasured_candidates"]
    assert [(g.backend, g.nodes) for g in warm.plan.groups] == [
        (g.backend, g.nodes) for g in cold.plan.groups
    ]


def test_tvm_joins_the_search_only_when_named() -> None:
    registry = default_registry()
    ok, _ = registry.entry("tvm").available()
    default = resolve_backends(registry, "cpu", None)
    assert "tvm" not in default and "onnxruntime" in default
    if ok:
        assert "tvm" in resolve_backends(registry, "cpu", ["onnxruntime", "tvm"])
