"""The op-level DP (Collage Algorithm 1) alone, with injected costs: choices, ε, coverage, convexity."""

from __future__ import annotations

import logging
import random

import networkx as nx
import pytest
from backends.conftest import hand_graph
from onnx_builders import ONNX_LIGHT_MODELS

from tessera.backends.composite import group_order
from tessera.backends.patterns import is_convex
from tessera.backends.registry import default_registry
from tessera.core.graph import load_graph
from tessera.models import build
from tessera.planners.placement.candidates import (
    PlacementCandidate,
    enumerate_candidates,
    owned_constants,
)
from tessera.planners.placement.dp import frontier_order, op_level_placement

C = PlacementCandidate


@pytest.fixture(scope="module")
def chain():
    """x → a (Relu) → b (Sigmoid) → c (Tanh) → y."""
    return hand_graph(
        [("a", "Relu", ["x"], ["t1"]), ("b", "Sigmoid", ["t1"], ["t2"]), ("c", "Tanh", ["t2"], ["y"])],
        {"x": [1, 256]},
        ["y"],
    )


@pytest.fixture(scope="module")
def diamond():
    """x → a → (b, c) → d (Add) → y: a region {a, b, c, d} has two inner branches."""
    return hand_graph(
        [
            ("a", "Relu", ["x"], ["t"]),
            ("b", "Sigmoid", ["t"], ["u"]),
            ("c", "Tanh", ["t"], ["v"]),
            ("d", "Add", ["u", "v"], ["y"]),
        ],
        {"x": [1, 64]},
        ["y"],
    )


def no_switch(src: str, dst: str, nbytes: int) -> float:
    return 0.0


def singles(graph, backend: str) -> list[PlacementCandidate]:
    return [C(backend, frozenset([n]), "single-op") for n in graph.order]


def placed(result) -> list[tuple[str, frozenset[str]]]:
    return [(g.candidate.backend, g.candidate.nodes) for g in result.groups]


def test_picks_the_cheaper_backend_per_operator(chain) -> None:
    cost = {
        C("A", frozenset("a"), "s"): 1.0,
        C("A", frozenset("b"), "s"): 5.0,
        C("A", frozenset("c"), "s"): 1.0,
    }
    cost |= {
        C("B", frozenset("a"), "s"): 2.0,
        C("B", frozenset("b"), "s"): 1.0,
        C("B", frozenset("c"), "s"): 2.0,
    }
    result = op_level_placement(chain, list(cost), cost.__getitem__, no_switch)
    assert placed(result) == [("A", frozenset("a")), ("B", frozenset("b")), ("A", frozenset("c"))]
    assert result.predicted_s == pytest.approx(3.0)


def test_a_fused_group_wins_when_cheaper_than_its_parts(chain) -> None:
    cost = {c: 1.0 for c in singles(chain, "A")}
    cost[C("B", frozenset("abc"), "rule:fuse")] = 2.5
    result = op_level_placement(chain, list(cost), cost.__getitem__, no_switch)
    assert placed(result) == [("B", frozenset("abc"))]
    cost[C("B", frozenset("abc"), "rule:fuse")] = 3.5
    assert len(op_level_placement(chain, list(cost), cost.__getitem__, no_switch).groups) == 3


def test_context_switch_keeps_a_cheap_operator_on_its_neighbours_backend(chain) -> None:
    cost = {c: 1.0 for c in singles(chain, "A")}
    cost[C("B", frozenset("b"), "s")] = 0.5  # 0.5 s faster on B ...
    switches: list[tuple[str, str, int]] = []

    def epsilon(src: str, dst: str, nbytes: int) -> float:
        switches.append((src, dst, nbytes))
        return 0.4  # ... but two switches cost 0.8 s

    result = op_level_placement(chain, list(cost), cost.__getitem__, epsilon)
    assert {b for b, _ in placed(result)} == {"A"}
    assert ("A", "B", 1024) in switches  # ε is asked with the tensor's size (1 x 256 fp32)
    cheap = op_level_placement(chain, list(cost), cost.__getitem__, lambda s, d, n: 0.1)
    assert placed(cheap)[1] == ("B", frozenset("b"))
    assert cheap.predicted_s == pytest.approx(1 + 0.5 + 1 + 0.2) and cheap.epsilon_s == pytest.approx(0.2)


def test_multi_output_region_and_its_alternatives(diamond) -> None:
    cost = {c: 1.0 for c in singles(diamond, "A")}
    cost[C("B", frozenset("abcd"), "rule:region")] = 2.4
    cost[C("B", frozenset("bc"), "pattern:two-roots")] = 0.5  # two roots, two outputs, no edge inside
    result = op_level_placement(diamond, list(cost), cost.__getitem__, no_switch)
    assert placed(result) == [("B", frozenset("abcd"))]
    cost[C("B", frozenset("abcd"), "rule:region")] = 2.6  # a + {b, c} + d = 2.5
    result = op_level_placement(diamond, list(cost), cost.__getitem__, no_switch)
    assert sorted(placed(result), key=lambda g: sorted(g[1])) == [
        ("A", frozenset("a")),
        ("B", frozenset("bc")),
        ("A", frozenset("d")),
    ]


def test_unmeasurable_candidates_are_never_placed(chain) -> None:
    cost = {c: 1.0 for c in singles(chain, "A")}
    cost[C("B", frozenset("abc"), "rule:fuse")] = float("inf")  # failed to build
    assert len(op_level_placement(chain, list(cost), cost.__getitem__, no_switch).groups) == 3


def test_a_node_no_backend_runs_falls_back_to_onnxruntime(chain, caplog) -> None:
    registry = default_registry()
    with caplog.at_level(logging.WARNING):
        candidates = enumerate_candidates(chain, registry, [])
    assert {c.via for c in candidates} == {"fallback:onnxruntime"}
    assert "no backend runs node 'a' (Relu)" in caplog.text and "default backend" in caplog.text
    result = op_level_placement(chain, candidates, lambda c: 1.0, no_switch)
    assert [b for b, _ in placed(result)] == ["onnxruntime"] * 3


def check_placement(graph, result) -> None:
    nodes = [n for g in result.groups for n in g.candidate.nodes]
    assert sorted(nodes) == sorted(graph.order), "every node exactly once"
    for g in result.groups:
        assert is_convex(graph, g.candidate.nodes), g.candidate
    groups = [g.candidate.nodes for g in result.groups]
    assert group_order(graph, groups) == sorted(group_order(graph, groups))  # DP order executes
    # owned constants stay with their owner
    where = {n: i for i, nodes in enumerate(groups) for n in nodes}
    for owner, consts in owned_constants(graph).items():
        assert all(where[c] == where[owner] for c in consts)


MODELS = ["mmt", "dlrm", "candle_uno", "resnext", "bert", "gpt"]
LIGHT = [
    p for p in ONNX_LIGHT_MODELS if p.stem in ("light_squeezenet", "light_inception_v1", "light_resnet50")
]


@pytest.mark.parametrize("source", MODELS + LIGHT, ids=lambda s: getattr(s, "stem", s))
def test_placements_cover_every_node_once_and_are_convex(source) -> None:
    """Real candidates (onnxruntime's and TVM's rules: cheap support answers), random costs."""
    graph = load_graph(build(source, "tiny") if isinstance(source, str) else source)
    candidates = enumerate_candidates(graph, default_registry(), ["onnxruntime", "tvm"])
    rng = random.Random(0)
    cost = {c: rng.uniform(0.5, 2.0) * (len(c.nodes) ** 0.8) for c in candidates}
    result = op_level_placement(graph, candidates, cost.__getitem__, lambda s, d, n: 1e-3 + n * 1e-9)
    check_placement(graph, result)
    assert 0 < result.states and result.predicted_s == pytest.approx(
        sum(g.cost_s + g.epsilon_s for g in result.groups)
    )


def test_frontier_order_is_topological_by_depth() -> None:
    graph = load_graph(str(LIGHT[0]))
    order = frontier_order(graph)
    assert sorted(order) == sorted(graph.order)
    rank = {n: i for i, n in enumerate(order)}
    assert all(rank[u] < rank[v] for u, v in graph.dag.edges)
    assert nx.is_directed_acyclic_graph(graph.dag)
