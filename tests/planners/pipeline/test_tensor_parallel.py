"""Tensor-parallel stages in the pipeline planner (plan --tensor-parallel): the search plans on
groups of a node's devices with a group device's costs (1/t of the split operators, memory and
activations, plus the split's all-reduces on the node's link), the plan names every device, and
validate counts its memory again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from onnx_builders import mlp_pair

from tessera.core.cost import CostModel, allreduce_time
from tessera.core.errors import InputError
from tessera.core.graph import load_graph
from tessera.planners.pipeline.checks import check_gpp_plan
from tessera.planners.pipeline.plan import pipeline_options, plan_gpp
from tessera.planners.pipeline.tensor_parallel import group_cluster, group_devices, tensor_parallel_cost


def test_a_group_device_costs_its_share_and_the_all_reduces(v100) -> None:
    graph = load_graph(mlp_pair("relu"))
    base = CostModel.for_device(v100.devices()[0].type)
    link = v100.links.intra_node
    cost = tensor_parallel_cost(base, graph, 2, link)
    up, down = graph.op("up"), graph.op("down")
    launch = base.device.kernel_launch_overhead
    assert cost.forward_time(up, 8) == pytest.approx((base.forward_time(up, 8) - launch) / 2 + launch)
    reduce = allreduce_time(base.wire_bytes(graph.tensors["y"].nbytes * 8), 2, link)
    assert cost.forward_time(down, 8) == pytest.approx(
        (base.forward_time(down, 8) - launch) / 2 + launch + reduce
    )
    copy = allreduce_time(base.wire_bytes(graph.tensors["x"].nbytes * 8), 2, link)  # x's gradient
    assert cost.backward_time(up, 8) == pytest.approx(
        (base.backward_time(up, 8) - launch) / 2 + launch + copy
    )
    assert cost.weight_bytes(up) == pytest.approx(base.weight_bytes(up) / 2)  # W1 and its bias, halved
    assert cost.activation_bytes(graph, "up") == pytest.approx(base.activation_bytes(graph, "up") / 2)
    # A graph nothing of which splits costs what the base model says.
    whole = load_graph(mlp_pair("norm"))
    assert tensor_parallel_cost(base, whole, 2, link).forward_time(whole.op("up"), 8) == base.forward_time(
        whole.op("up"), 8
    )


def test_groups_are_a_nodes_devices_t_at_a_time(v100) -> None:
    grouped = group_cluster(v100, 2)
    assert grouped.num_devices == v100.num_devices // 2
    assert group_devices([d.id for d in grouped.devices()[:2]], 2) == [d.id for d in v100.devices()[:4]]
    with pytest.raises(InputError, match="not groups of 3"):
        group_cluster(v100, 3)


def test_a_tensor_parallel_plan_names_every_device_and_validates(zoo_graph, v100) -> None:
    graph = zoo_graph("gpt")
    options = pipeline_options(v100, mini_batch=16, devices=8, tensor_parallel=2)
    plan, _, _ = plan_gpp(graph, v100, options, baseline=False)
    node = {d.id: d.node for d in v100.devices()}
    assert all(st.tensor_parallel == 2 for st in plan.stages)
    assert sum(len(st.devices) for st in plan.stages) == 8
    for st in plan.stages:
        for q in range(st.replicas):
            assert len({node[d] for d in st.devices[2 * q : 2 * q + 2]}) == 1
    assert check_gpp_plan(plan, graph) == []


def test_auto_keeps_the_fastest_degree(zoo_graph, v100) -> None:
    graph = zoo_graph("gpt")
    throughput = {}
    for t in (1, 2, 4):
        options = pipeline_options(v100, mini_batch=16, devices=8, tensor_parallel=t)
        throughput[t] = plan_gpp(graph, v100, options, baseline=False)[2].throughput
    options = pipeline_options(v100, mini_batch=16, devices=8, tensor_parallel="auto")
    plan, _, sim = plan_gpp(graph, v100, options, baseline=False)
    best = max(throughput, key=lambda t: (throughput[t], -t))
    assert sim.throughput == pytest.approx(throughput[best])
    assert plan.stages[0].tensor_parallel == best


def test_plan_tensor_parallel_on_the_command_line(zoo, tmp_path: Path) -> None:
    path = tmp_path / "gpt.onnx"
    path.write_bytes(zoo("gpt").SerializeToString())
    out = tmp_path / "plan.json"
    made = run_cli("plan", str(path), "--cluster", "graphpipe-v100", "--mini-batch", "16", "--devices", "8",
                   "--tensor-parallel", "2", "--no-baseline", "-o", str(out))  # fmt: skip
    assert made.code == 0, made.err
    assert " tp " in made.out.splitlines()[1]  # the column
    assert {st["tensor_parallel"] for st in json.loads(out.read_text())["stages"]} == {2}
    assert run_cli("validate", str(out), "--model", str(path)).code == 0
    for bad in ("3", "0", "x"):
        refused = run_cli("plan", str(path), "--cluster", "graphpipe-v100", "--mini-batch", "16",
                          "--devices", "8", "--tensor-parallel", bad)  # fmt: skip
        assert refused.code == 2 and "--tensor-parallel" in refused.err, refused.err


@pytest.mark.slow
def test_a_70b_decoder_on_64_a100s_plans_faster_with_tensor_parallel_stages(cluster) -> None:
    """Llama-70B-shaped (built lazily) on 8 DGX A100 nodes, ZeRO-1 and full recomputation, one
    sequence per device: 4-way tensor-parallel stages beat pipeline × data parallelism alone."""
    import yaml

    from tessera.core.specs import parse_cluster
    from tessera.models.gpt import GPTConfig, build_gpt

    spec = yaml.safe_load((Path(__file__).parents[3] / "tessera/configs/clusters/dgx-a100.yaml").read_text())
    spec["nodes"][0]["count"] = 64 // spec["nodes"][0]["devices"][0]["count"]
    a100s = parse_cluster(spec, source="dgx-a100-64")
    config = GPTConfig(
        layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, seq=2048, gated=True
    )
    graph = load_graph(build_gpt(config, lazy=True))
    result = {}
    for t in (1, 4):
        options = pipeline_options(
            a100s, mini_batch=64, devices=64, zero=1, recompute="all", tensor_parallel=t
        )
        result[t] = plan_gpp(graph, a100s, options, baseline=False)
    assert result[4][2].throughput > 1.2 * result[1][2].throughput
    assert check_gpp_plan(result[4][0], graph) == []
