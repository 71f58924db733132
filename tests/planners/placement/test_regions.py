"""Region candidates: spans of the frontier order between narrow cuts, up to the whole model."""

from __future__ import annotations

import pytest
from onnx_builders import ONNX_LIGHT_MODELS

from tessera.backends.patterns import is_convex
from tessera.backends.registry import default_registry
from tessera.core.graph import load_graph
from tessera.models import build
from tessera.planners.placement.candidates import (
    PlacementCandidate,
    SupportTable,
    enumerate_candidates,
    narrow_cuts,
    owned_constants,
    region_candidates,
)
from tessera.planners.placement.dp import frontier_order, op_level_placement

LIGHT = [p for p in ONNX_LIGHT_MODELS if p.stem in ("light_squeezenet", "light_inception_v1")]


@pytest.mark.parametrize("source", ["resnext", "dlrm", "bert", *LIGHT], ids=lambda s: getattr(s, "stem", s))
def test_regions_are_convex_keep_constants_with_owners_and_include_the_whole_model(source) -> None:
    graph = load_graph(build(source, "tiny") if isinstance(source, str) else source)
    order = frontier_order(graph)
    cuts = narrow_cuts(graph, order, 4)
    assert cuts == sorted(set(cuts)) and len(cuts) <= 4 and all(0 < p < len(order) for p in cuts)
    regions = region_candidates(graph, ["onnxruntime"], order, support=SupportTable(default_registry()))
    assert any(r.nodes == frozenset(graph.order) and r.via == "region:whole-model" for r in regions)
    owner = {c: v for v, cs in owned_constants(graph).items() for c in cs}
    for r in regions:
        assert is_convex(graph, r.nodes)
        assert all(owner[c] in r.nodes for c in r.nodes if c in owner)
    # Deterministic.
    assert regions == region_candidates(
        graph, ["onnxruntime"], order, support=SupportTable(default_registry())
    )


def test_the_dp_picks_one_backend_for_everything_when_a_group_boundary_costs_more() -> None:
    """Per-group costs (each operator a separate call) sum above the whole model measured as one group."""
    graph = load_graph(build("resnext", "tiny"))
    registry = default_registry()
    support = SupportTable(registry)
    candidates = enumerate_candidates(graph, registry, ["onnxruntime"], support=support, max_group_ops=16)
    candidates += region_candidates(graph, ["onnxruntime"], frontier_order(graph), support=support)

    def cost(c: PlacementCandidate) -> float:
        return 1e-5 + 1e-6 * len(c.nodes)  # a per-call cost, then work per operator

    result = op_level_placement(graph, candidates, cost, lambda s, d, n: 0.0)
    assert [g.candidate.nodes for g in result.groups] == [frozenset(graph.order)]
