"""Weights read by several stages (a tied embedding and LM head): the plan records them, every
stage holding a copy is charged its memory and the gradient all-reduce, and validate checks both."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runner import run_cli
from onnx_builders import tied_chain

from tessera.core.cost import allreduce_time
from tessera.core.graph import load_graph
from tessera.core.plans import dump_plan, parse_plan
from tessera.planners.pipeline.checks import check_gpp_plan
from tessera.planners.pipeline.links import ring_link
from tessera.planners.pipeline.plan import pipeline_options, plan_gpp


def _two_stage_plan(path: Path, cluster, ties: int = 1):
    path.write_bytes(tied_chain(ties=ties).SerializeToString())
    graph = load_graph(str(path), input_shapes={"x": (8, 8)})
    spec = cluster("local-cpu-split")
    options = pipeline_options(spec, mini_batch=8, devices=2, memory_limit="6KiB")
    plan, pipe, _ = plan_gpp(graph, spec, options, baseline=False)
    assert len(plan.stages) == 2  # the memory limit splits the chain
    return graph, plan, pipe


def test_the_plan_records_shared_weights_and_charges_every_copy(tmp_path: Path, cluster) -> None:
    graph, plan, pipe = _two_stage_plan(tmp_path / "tied.onnx", cluster)
    assert [(w.name, w.stages, w.bytes) for w in plan.shared_weights] == [("tied", [0, 1], 256)]
    # Each stage holds its own matrices plus the tied one: 3 x 64 parameters at 4 bytes (CPUs
    # train in fp32) of weights, and the tied copy is all-reduced on both.
    held = [
        {t for n in st.nodes for t in graph.op(n).inputs if t in graph.initializers} for st in plan.stages
    ]
    for st, names in zip(plan.stages, held, strict=True):
        assert "tied" in names
        assert st.memory.weights == 4 * sum(graph.initializers[t].numel for t in names)
    assert all(st.allreduce_time > 0 for st in pipe.stages)  # one device per stage: only the tie's
    assert check_gpp_plan(plan, graph) == []


def test_weights_shared_by_the_same_stages_cost_one_all_reduce(tmp_path: Path, cluster) -> None:
    # Launch sums a group's shared weights in one bucket, one all-reduce a step: the prediction
    # charges that, not one all-reduce per weight (their latencies would add up).
    graph, plan, pipe = _two_stage_plan(tmp_path / "tied2.onnx", cluster, ties=2)
    assert [w.name for w in plan.shared_weights] == ["tied", "tied2"]
    spec = cluster("local-cpu-split")
    devices = [d for d in spec.devices() if d.id in {x for st in plan.stages for x in st.devices}]
    one = allreduce_time(2 * 64 * 4, 2, ring_link(spec, devices))
    assert [st.allreduce_time for st in pipe.stages] == [one, one]
    assert one < 2 * allreduce_time(64 * 4, 2, ring_link(spec, devices))


def test_validate_lists_shared_weights_and_refuses_a_plan_that_hides_them(tmp_path: Path, cluster) -> None:
    graph, plan, _ = _two_stage_plan(tmp_path / "tied.onnx", cluster)
    good = tmp_path / "plan.json"
    good.write_text(dump_plan(plan))
    result = run_cli("validate", str(good))
    assert result.code == 0, result.err
    assert "shared weight tied (256 B) read by stages 0, 1" in result.out
    data = json.loads(good.read_text())
    del data["shared_weights"]
    hidden = parse_plan(data, label="hidden.json")
    assert (
        check_gpp_plan(hidden, graph)[0] == "shared_weights: 'tied' is read by stages [0, 1] but not listed"
    )


def test_plans_without_shared_weights_do_not_mention_them(zoo_graph, cluster) -> None:
    graph = zoo_graph("mmt")
    spec = cluster("local-cpu-split")
    plan, _, _ = plan_gpp(graph, spec, pipeline_options(spec, mini_batch=8), baseline=False)
    assert plan.shared_weights == [] and "shared_weights" not in dump_plan(plan)
