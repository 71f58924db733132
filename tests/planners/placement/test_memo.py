"""The search memo: a second search of the same model with the same profile cache starts warm."""

from __future__ import annotations

from pathlib import Path

from tessera.backends.measure import Measurer
from tessera.backends.profile_cache import ProfileCache
from tessera.core.graph import load_graph
from tessera.models import build
from tessera.planners.placement import PlacementOptions, plan_placement


def test_a_warm_search_reuses_candidates_and_costs_and_places_the_same(tmp_path: Path) -> None:
    graph = load_graph(build("candle_uno", "tiny"))
    options = PlacementOptions(backends=("onnxruntime",), rounds=1)
    cache = tmp_path / "profiles.sqlite"
    first = plan_placement(graph, options, measurer=Measurer(ProfileCache(cache)))
    memos = list((tmp_path / "profiles.sqlite.placement").glob("*.json"))
    assert len(memos) == 1
    second = plan_placement(graph, options, measurer=Measurer(ProfileCache(cache)))
    assert second.report["op_level_groups"] == first.report["op_level_groups"]
    assert second.plan.search["candidates"] == first.plan.search["candidates"]
    assert second.plan.predicted["op_level_latency_s"] == first.plan.predicted["op_level_latency_s"]
    assert second.report["timings"]["candidates_s"] < first.report["timings"]["candidates_s"]
    # Another setting is another memo.
    plan_placement(
        graph,
        PlacementOptions(backends=("onnxruntime",), rounds=1, region_cuts=2),
        measurer=Measurer(ProfileCache(cache)),
    )
    assert len(list((tmp_path / "profiles.sqlite.placement").glob("*.json"))) == 2
