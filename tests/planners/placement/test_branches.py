"""Parallel branches (issue #30): a multi-branch model cut at its branches, the groups of a level run at
the same time, with the same outputs as one after the other; ``place`` keeps it only when measured
faster, and ``launch`` runs a concurrent plan concurrently."""

from __future__ import annotations

import json
from pathlib import Path

import networkx as nx
from backends.conftest import hand_graph
from cli_runner import run_cli

from tessera.backends.composite import CompositeModel, compare_outputs, random_feeds, reference_outputs
from tessera.core.graph import load_graph
from tessera.core.plans import load_plan, write_plan
from tessera.models import build
from tessera.planners.placement.branches import branch_groups


def test_a_two_tower_model_is_cut_into_its_towers_and_the_merge() -> None:
    graph = load_graph(build("mmt", "tiny"))
    groups = branch_groups(graph)
    assert groups is not None and len(groups) == 3
    assert sorted(n for g in groups for n in g) == sorted(graph.order)  # a partition
    quotient = graph.quotient(groups)
    assert nx.is_directed_acyclic_graph(quotient)
    towers = [i for i in quotient if quotient.out_degree(i) and not quotient.in_degree(i)]
    assert len(towers) == 2  # two independent towers feed the merge
    model = CompositeModel(graph, [("onnxruntime", g) for g in groups], concurrent=True)
    assert model.concurrent and [len(level) for level in model.levels] == [2, 1]
    feeds = random_feeds(graph, 0)
    assert compare_outputs(model.run(feeds), reference_outputs(graph, feeds))["ok"]


def test_a_chain_has_no_branches_worth_cutting() -> None:
    assert branch_groups(load_graph(build("bert", "tiny"))) is None


def test_a_tensor_is_kept_until_the_last_level_that_reads_it() -> None:
    """``x`` is last read, in group order, by ``side`` (level 0), but ``after`` (level 1) reads it too:
    dropping it after ``side`` ran, as the sequential order would, loses it."""
    graph = hand_graph(
        [
            ("first", "Relu", ["x"], ["a"]),
            ("after", "Add", ["a", "x"], ["b"]),
            ("side", "Sigmoid", ["x"], ["c"]),
            ("join", "Mul", ["b", "c"], ["y"]),
        ],
        {"x": [4, 8]},
        ["y"],
    )
    groups = [("onnxruntime", ["first"]), ("onnxruntime", ["after", "join"]), ("onnxruntime", ["side"])]
    with_levels = CompositeModel(graph, groups, concurrent=True)
    assert [len(level) for level in with_levels.levels] == [2, 1]
    feeds = random_feeds(graph, 0)
    assert compare_outputs(with_levels.run(feeds), reference_outputs(graph, feeds))["ok"]


def test_place_compares_the_branches_and_launch_runs_a_concurrent_plan(tmp_path: Path) -> None:
    model = tmp_path / "mmt.onnx"
    model.write_bytes(build("mmt", "tiny").SerializeToString())
    out = tmp_path / "placed.json"
    placed = run_cli("place", str(model), "--backends", "onnxruntime", "--cache", str(tmp_path / "c.sqlite"),
                     "-o", str(out), "--verify")  # fmt: skip
    assert placed.code == 0, placed.err
    plan = load_plan(out)
    assert plan.measured["parallel_branches_latency_s"]["onnxruntime"] > 0  # timed with the others
    assert "parallel branches on onnxruntime" in placed.out
    if plan.concurrent:  # kept: it measured faster beyond the noise margin
        assert plan.search["chosen"] == "parallel branches"
        assert plan.measured["latency_s"] == plan.measured["parallel_branches_latency_s"]["onnxruntime"]
    # Whatever was chosen here, a concurrent plan of the branches runs concurrently and right.
    groups = branch_groups(load_graph(str(model)))
    assert groups is not None
    template = plan.groups[0]
    cut = [
        template.model_copy(update={"id": i, "backend": "onnxruntime", "nodes": sorted(g)})
        for i, g in enumerate(groups)
    ]
    write_plan(plan.model_copy(update={"groups": cut, "concurrent": True}), out)
    assert load_plan(out).concurrent
    launched = run_cli("launch", str(out), "--repeat", "2", "--json")
    assert launched.code == 0, launched.err
    report = json.loads(launched.out)
    assert report["verify"]["ok"] and report["groups"] == 3
