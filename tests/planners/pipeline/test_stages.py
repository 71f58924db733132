"""``plan --stages N``: exactly N stages, wherever the search places them, for chains and DAGs, for
the graph pipeline and its sequential baseline; N a stage count the devices can hold."""

from __future__ import annotations

import pytest
from cli_runner import run_cli
from planners.pipeline.gpp_graphs import chain

from tessera.core.errors import InputError
from tessera.planners.pipeline.plan import pipeline_options, plan_gpp
from tessera.planners.pipeline.search import partition
from tessera.planners.pipeline.spp import plan_sequential
from tessera.planners.pipeline.types import PartitionOptions
from tessera.planners.sim import simulate_pipeline


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_a_dag_plans_in_exactly_the_stages_asked_for(v100, zoo_graph, n: int) -> None:
    g = zoo_graph("candle_uno")
    opts = PartitionOptions(mini_batch=64, num_devices=8, stages=n)
    gpp = partition(g, v100, opts)
    assert len(gpp.stages) == n
    assert sum(len(s.devices) for s in gpp.stages) <= 8
    assert sorted(x for s in gpp.stages for x in s.nodes) == sorted(g.order)  # every operator once
    assert len(plan_sequential(g, v100, opts).stages) == n


def test_asking_for_the_searchs_own_count_changes_nothing(v100) -> None:
    """Constraining the count to the one the free search chose finds a plan as fast: the constraint
    only keeps more candidates apart, it removes none of that count."""
    g = chain(16, width=512)
    free = partition(g, v100, PartitionOptions(mini_batch=64, num_devices=4))
    fixed = partition(g, v100, PartitionOptions(mini_batch=64, num_devices=4, stages=len(free.stages)))
    assert len(fixed.stages) == len(free.stages)
    assert simulate_pipeline(fixed).iteration_time <= simulate_pipeline(free).iteration_time * (1 + 1e-9)
    other = 1 if len(free.stages) > 1 else 2
    forced = partition(g, v100, PartitionOptions(mini_batch=64, num_devices=4, stages=other))
    assert len(forced.stages) == other


def test_the_plan_file_is_the_asked_count(v100, zoo_graph) -> None:
    g = zoo_graph("mmt")
    plan, _, _ = plan_gpp(g, v100, PartitionOptions(mini_batch=64, num_devices=8, stages=4))
    assert len(plan.stages) == 4
    assert plan.baseline is not None and plan.baseline["num_stages"] == 4


def test_a_count_the_devices_cannot_hold_is_refused(v100) -> None:
    with pytest.raises(InputError, match=r"--stages 9: expected 1 to 8 \(--devices 8\)"):
        pipeline_options(v100, mini_batch=64, devices=8, stages=9)
    with pytest.raises(InputError, match=r"expected 1 to 2 \(--devices 8 over --tensor-parallel 4\)"):
        pipeline_options(v100, mini_batch=64, devices=8, tensor_parallel=4, stages=3)


def test_more_stages_than_parts_that_compute_is_refused(v100) -> None:
    g = chain(2, width=64)
    with pytest.raises(InputError, match=r"--stages 5: at most \d stage\(s\) of .* can compute anything"):
        partition(g, v100, PartitionOptions(mini_batch=8, num_devices=8, stages=5))


def test_stages_on_the_command_line(tmp_path, zoo) -> None:
    model = tmp_path / "gpt.onnx"
    model.write_bytes(zoo("gpt").SerializeToString())
    out = tmp_path / "p.json"
    res = run_cli("plan", str(model), "--cluster", "local-cpu-split", "--mini-batch", "8", "--stages", "2",
                  "-o", str(out))  # fmt: skip
    assert res.code == 0, res.err
    assert "GPP plan: 2 stage(s)" in res.out
    res = run_cli("plan", str(model), "--cluster", "local-cpu-split", "--mini-batch", "8", "--stages", "3")
    assert res.code == 2 and "--stages 3: expected 1 to 2" in res.err, res.err
    res = run_cli("plan", str(model), "--cluster", "local-cpu-split", "--mini-batch", "8", "--stages", "0")
    assert res.code == 2 and "0" in res.err, res.err
