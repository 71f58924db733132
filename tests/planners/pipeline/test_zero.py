"""ZeRO-1 in the pipeline planner (plan --zero): a replicated stage may keep 1/d of its optimizer
state, which lets data-parallel plans fit where whole state does not; validate counts it again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from onnx_builders import tied_chain

from tessera.core.graph import load_graph
from tessera.core.plans import dump_plan
from tessera.models import build
from tessera.planners.pipeline.checks import check_gpp_plan, counted_memory
from tessera.planners.pipeline.plan import pipeline_options, plan_gpp
from tessera.planners.pipeline.search import partition
from tessera.planners.pipeline.types import PartitionOptions
from tessera.planners.sim import simulate_pipeline

SHAPES = {"x": (8, 32)}


@pytest.fixture
def wide(tmp_path: Path, cluster):
    """A chain of 32-wide layers whose weights outweigh its activations: 5,120 parameters at 16
    bytes (fp32 weights and gradients, 8 bytes of optimizer state) on 2 CPU cores of 72 KiB each."""
    path = tmp_path / "wide.onnx"
    path.write_bytes(tied_chain(width=32).SerializeToString())
    return path, load_graph(str(path), input_shapes=SHAPES), cluster("local-cpu-split")


def _plan(wide, zero):
    _, graph, spec = wide
    options = pipeline_options(spec, mini_batch=8, devices=2, memory_limit="72KiB", zero=zero)
    return plan_gpp(graph, spec, options, baseline=False)


def test_zero_lets_the_data_parallel_plan_fit_and_wins(wide) -> None:
    whole, _, whole_sim = _plan(wide, 0)
    assert [len(st.devices) for st in whole.stages] == [1, 1]  # replicas do not fit: a pipeline
    for zero in ("auto", 1):
        plan, _, sim = _plan(wide, zero)
        assert [(len(st.devices), st.zero) for st in plan.stages] == [(2, 1)]
        # 5,120 parameters: 4 bytes of weights, 4 of gradients, and half of 8 of state per replica.
        assert plan.stages[0].memory.weights == 4 * 5120
        assert plan.stages[0].memory.optimizer == 4 * 5120 + 4 * 5120
        assert plan.stages[0].memory.peak <= 72 * 1024
        assert sim.iteration_time < 0.75 * whole_sim.iteration_time
        assert check_gpp_plan(plan, wide[1]) == []
        assert plan.training.zero == zero


@pytest.mark.parametrize("limit", ["64KiB", "72KiB", "90KiB", "120KiB", None])
def test_auto_shards_only_where_whole_state_does_not_fit(wide, limit) -> None:
    _, graph, spec = wide
    options = pipeline_options(spec, mini_batch=8, devices=2, memory_limit=limit, zero="auto")
    plan, _, _ = plan_gpp(graph, spec, options, baseline=False)
    capacity = options.memory_limit or spec.devices()[0].type.memory
    for st in plan.stages:
        whole = counted_memory(
            st.model_copy(update={"zero": 0}), graph, spec.devices()[0].type, plan.training
        )
        assert st.zero == (whole.peak > capacity)
    assert check_gpp_plan(plan, graph) == []


def test_validate_refuses_a_zero_flag_the_plan_does_not_hold_to(wide, tmp_path: Path) -> None:
    plan, _, _ = _plan(wide, 1)
    doc = json.loads(dump_plan(plan))
    doc["stages"][0]["zero"] = 0  # whole state on each replica: more memory than recorded
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    out = run_cli("validate", str(bad), "--model", str(wide[0]), "--json")
    assert out.code == 2
    problems = " | ".join(json.loads(out.out)["problems"])
    assert "stage 0: zero 0, but training.zero is 1" in problems
    assert "memory: stage 0 records" in problems


def test_plan_zero_on_the_command_line(wide, tmp_path: Path) -> None:
    path = wide[0]
    out = tmp_path / "plan.json"
    made = run_cli("plan", str(path), "--cluster", "local-cpu-split", "--mini-batch", "8", "--devices", "2",
                   "--memory-limit", "72KiB", "--zero", "auto", "--input-shape", "x=8x32", "-o", str(out))  # fmt: skip
    assert made.code == 0, made.err
    assert "zero" in made.out.splitlines()[1]  # the column where a stage shards
    assert json.loads(out.read_text())["stages"][0]["zero"] == 1
    assert run_cli("validate", str(out), "--model", str(path)).code == 0
    bad = run_cli("plan", str(path), "--cluster", "local-cpu-split", "--mini-batch", "8", "--zero", "2")
    assert bad.code == 2 and "--zero" in bad.err


def test_auto_is_never_slower_than_without_zero(v100) -> None:
    """The sharding search alone found BERT on 4 V100s at 0.92 GiB a 3 % slower plan than the
    search without ZeRO (its looser memory bound changes what the fronts keep): auto keeps the
    faster of the two."""
    graph = load_graph(build("bert", "paper"))
    times = {}
    for zero in (0, "auto"):
        options = PartitionOptions(
            mini_batch=32, num_devices=4, memory_limit=0.92 * 2**30, recompute="auto", zero=zero
        )
        times[zero] = simulate_pipeline(partition(graph, v100, options, explain=False)).iteration_time
    assert times["auto"] <= times[0]


def test_a_zero_stage_pays_the_links_measured_pair_fixed_or_auto(wide) -> None:
    """Where calibrate measured ZeRO-1's reduce-scatter and all-gather (the link's
    zero_sync_curve), a sharded stage's sync is that pair, not the all-reduce; whether
    ``--zero 1`` fixes it or ``auto`` shards it for memory."""
    path, graph, spec = wide
    data = spec.model_dump(mode="json")
    link = data["links"]["intra_node"]
    link |= {"allreduce_ranks": 2, "allreduce_curve": [[4, 1e-5], [2**20, 1e-4]]}
    plain = type(spec).model_validate(data)
    link["zero_sync_curve"] = [[4, 1.2e-5], [2**20, 1.2e-4]]  # the pair: 1.2x the all-reduce
    measured = type(spec).model_validate(data)
    for zero in (1, "auto"):
        times = []
        for cluster in (plain, measured):
            options = pipeline_options(cluster, mini_batch=8, devices=2, memory_limit="72KiB", zero=zero)
            _, pipe, _ = plan_gpp(graph, cluster, options, baseline=False)
            assert [(len(st.devices), st.zero) for st in pipe.stages] == [(2, 1)]
            times.append(pipe.stages[0].allreduce_time)
        # 5,120 parameters of 4-byte gradients: 20 KiB, 1.2x on the log-log line of both curves.
        assert times[1] == pytest.approx(1.2 * times[0], rel=1e-6)
    unsharded = pipeline_options(measured, mini_batch=8, devices=2, zero="auto")  # no limit: no shard
    _, pipe, _ = plan_gpp(graph, measured, unsharded, baseline=False)
    assert all(st.zero == 0 and st.allreduce_time <= times[0] for st in pipe.stages)
    link["zero_sync_curve"] = [[4, 1e-3], [2**20, 1e-2]]  # 100x: the search turns to a pipeline
    costly = type(spec).model_validate(data)
    options = pipeline_options(costly, mini_batch=8, devices=2, memory_limit="72KiB", zero=1)
    _, pipe, _ = plan_gpp(graph, costly, options, baseline=False)
    assert [(len(st.devices), st.zero) for st in pipe.stages] == [(1, 0), (1, 0)]
