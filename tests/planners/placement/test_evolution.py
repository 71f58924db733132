"""The graph-level evolutionary search (Collage §4.3): determinism, seeding, stopping, placements."""

from __future__ import annotations

import itertools

import pytest
from backends.conftest import hand_graph

from tessera.backends.composite import group_order
from tessera.backends.patterns import is_convex
from tessera.core.graph import load_graph
from tessera.models import build
from tessera.planners.placement.evolution import (
    EvolutionOptions,
    evolve,
    graph_level_backend,
    offload_groups,
)

WEIGHTS = [3, -2, 5, -1, 4, -6, 2, -3, 1, -4, 6, -5]


def fitness(bits: tuple[int, ...]) -> float:
    """Fixed 'measurements': lower is better; the optimum offloads exactly the negative-weight bits."""
    return 100.0 + sum(w for w, b in zip(WEIGHTS, bits, strict=True) if b)


def test_same_seed_same_search() -> None:
    options = EvolutionOptions(seed=7, budget_s=None, generations=20)
    seeds = [(0,) * 12, (1,) * 12]
    a, b = evolve(12, fitness, seeds, options), evolve(12, fitness, seeds, options)
    assert (a.best, a.best_fitness, a.history, a.generations, a.evaluations) == (
        b.best,
        b.best_fitness,
        b.history,
        b.generations,
        b.evaluations,
    )
    assert a.best_fitness <= fitness((0,) * 12) and a.best_fitness <= fitness((1,) * 12)
    assert a.history == sorted(a.history, reverse=True)  # elitism: the best never gets worse


def test_finds_the_optimum_of_a_separable_problem() -> None:
    result = evolve(
        12, fitness, [(0,) * 12], EvolutionOptions(seed=0, budget_s=None, generations=60, patience=15)
    )
    assert result.best == tuple(int(w < 0) for w in WEIGHTS)


def test_seeds_are_evaluated_and_saturation_stops() -> None:
    seen: list[tuple[int, ...]] = []

    def f(bits: tuple[int, ...]) -> float:
        seen.append(bits)
        return 1.0  # flat: nothing ever improves

    result = evolve(6, f, [(0,) * 6, (1,) * 6], EvolutionOptions(seed=1, budget_s=None, patience=3))
    assert seen[:2] == [(0,) * 6, (1,) * 6]
    assert result.stopped == "saturation" and result.generations == 3
    assert len(seen) == len(set(seen)) == result.evaluations  # memoized


def test_time_budget_stops_the_search() -> None:
    ticks = itertools.count()
    result = evolve(
        12,
        fitness,
        [(0,) * 12],
        EvolutionOptions(seed=0, budget_s=20, generations=1000),
        clock=lambda: next(ticks),
    )
    assert result.stopped == "budget" and result.generations < 1000


def test_graph_level_backend_choice() -> None:
    assert graph_level_backend(["onnxruntime", "tvm", "openvino"]) == "openvino"
    assert graph_level_backend(["onnxruntime", "tvm"]) == "tvm"
    assert graph_level_backend(["onnxruntime"]) is None


@pytest.mark.parametrize("name", ["resnext", "gpt", "mmt"])
def test_offloaded_placements_cover_once_are_convex_and_acyclic(name) -> None:
    graph = load_graph(build(name, "tiny"))
    order = list(graph.order)
    op_groups = [("onnxruntime", frozenset(order[i : i + 3]), "x") for i in range(0, len(order), 3)]
    op_groups = [g for g in op_groups if is_convex(graph, g[1])] + [
        ("onnxruntime", frozenset([n]), "x") for g in op_groups if not is_convex(graph, g[1]) for n in g[1]
    ]
    for offload in (order[::2], order[1::3], order, []):
        groups = offload_groups(graph, op_groups, "openvino", offload)
        nodes = [n for _, ns, _ in groups for n in ns]
        assert sorted(nodes) == sorted(order)
        assert all(is_convex(graph, ns) for _, ns, _ in groups)
        group_order(graph, [ns for _, ns, _ in groups])  # raises on a cycle
        on_ov = {n for b, ns, _ in groups if b == "openvino" for n in ns}
        assert set(offload) <= on_ov
    everything = offload_groups(graph, op_groups, "openvino", order)
    assert len(everything) == 1  # all offloaded: one region


def test_a_merge_that_would_close_a_cycle_is_refused() -> None:
    """a → b → c and a → c: offloading a and c but not b cannot make {a, c} one group."""
    graph = hand_graph(
        [("a", "Relu", ["x"], ["t"]), ("b", "Sigmoid", ["t"], ["u"]), ("c", "Add", ["t", "u"], ["y"])],
        {"x": [1, 8]},
        ["y"],
    )
    op_groups = [("onnxruntime", frozenset([n]), "x") for n in "abc"]
    groups = offload_groups(graph, op_groups, "openvino", ["a", "c"])
    assert sorted(sorted(ns) for _, ns, _ in groups) == [["a"], ["b"], ["c"]]
