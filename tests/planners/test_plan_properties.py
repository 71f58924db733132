"""Property tests of the pipeline planners: random DAGs (series-parallel and not) on random cluster
specs always give plans that validate (C1–C5, memory, coverage), and the simulator's invariants hold."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from tessera.core.errors import InfeasibleError
from tessera.core.graph import load_graph
from tessera.core.plan_checks import check_plan_against_model
from tessera.core.plans import parse_plan
from tessera.core.specs import load_cluster, parse_cluster
from tessera.models import build
from tessera.planners.pipeline import checks as _checks  # noqa: F401 - registers C1–C5 + memory
from tessera.planners.pipeline.plan import plan_gpp
from tessera.planners.pipeline.types import PartitionOptions

WIDTH = 32


@st.composite
def random_mlp_dags(draw):
    """A random DAG of Gemm+Relu blocks over [batch, 32]: each block reads one or two earlier ones
    (two are added first), so the graph may or may not be series-parallel."""
    n = draw(st.integers(2, 10))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    nodes, inits, tensors = [], [], ["x"]
    for i in range(n):
        srcs = draw(st.lists(st.sampled_from(tensors), min_size=1, max_size=2, unique=True))
        inp = srcs[0]
        if len(srcs) == 2:
            nodes.append(helper.make_node("Add", srcs, [f"sum{i}"], name=f"b{i}/add"))
            inp = f"sum{i}"
        inits.append(numpy_helper.from_array(rng.normal(size=(WIDTH, WIDTH)).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("Gemm", [inp, f"w{i}"], [f"g{i}"], name=f"b{i}/gemm"))
        nodes.append(helper.make_node("Relu", [f"g{i}"], [f"h{i}"], name=f"b{i}/relu"))
        tensors.append(f"h{i}")
    consumed = {t for node in nodes for t in node.input}
    outs = [t for t in tensors[1:] if t not in consumed]
    graph = helper.make_graph(
        nodes,
        "random",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info(t, TensorProto.FLOAT, ["batch", WIDTH]) for t in outs],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@st.composite
def random_clusters(draw):
    nodes = draw(st.integers(1, 2))
    per_node = draw(st.sampled_from([1, 2, 4]))
    return parse_cluster(
        {
            "name": "random",
            "device_types": {
                "gpu": {
                    "kind": "gpu",
                    "memory": draw(st.sampled_from(["64MiB", "1GiB", "16GiB"])),
                    "flops": {"fp32": draw(st.sampled_from(["1TFLOPS", "20TFLOPS"])), "fp16": "100TFLOPS"},
                    "memory_bandwidth": draw(st.sampled_from(["100GB/s", "2TB/s"])),
                }
            },
            "nodes": [{"name": "n", "count": nodes, "devices": [{"type": "gpu", "count": per_node}]}],
            "links": {
                "intra_node": {"bandwidth": draw(st.sampled_from(["10GB/s", "300GB/s"])), "latency": "2us"},
                "inter_node": {"bandwidth": "12.5GB/s", "latency": "5us"},
            },
        },
        source="random",
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=random_mlp_dags(),
    cluster=random_clusters(),
    mini_batch=st.sampled_from([8, 32, 64]),
    # Limits at which a block's weights (16 KiB with Adam) and its activations both count.
    memory_limit=st.sampled_from([None, 48 * 1024, 96 * 1024, 192 * 1024]),
    recompute=st.sampled_from(["never", "auto", "all"]),
    zero=st.sampled_from([0, 1, "auto"]),
)
def test_plans_always_validate_and_simulations_are_consistent(
    model, cluster, mini_batch, memory_limit, recompute, zero
):
    graph = load_graph(model)
    opts = PartitionOptions(mini_batch=mini_batch, memory_limit=memory_limit, recompute=recompute, zero=zero)
    try:
        plan, _pipe, sim = plan_gpp(graph, cluster, opts)
    except InfeasibleError as exc:
        assert "\n" not in exc.message
        return
    assert check_plan_against_model(plan, graph) == []
    assert all(st.memory.peak <= (memory_limit or math.inf) for st in plan.stages)
    if recompute != "auto":
        assert {st.recompute for st in plan.stages} == {recompute == "all"}
    if zero != "auto":  # ZeRO-1 shards over replicas: on every replicated stage, or on none
        assert all(st.zero == (zero == 1 and len(st.devices) > 1) for st in plan.stages)
    assert not any(st.zero and len(st.devices) == 1 for st in plan.stages)
    # The sequential plan too (its stages in order, residuals as forward skip edges).
    try:
        sequential, _, _ = plan_gpp(graph, cluster, opts, kind="spp")
    except InfeasibleError:  # a graph of stages may fit where a chain does not
        pass
    else:
        assert check_plan_against_model(sequential, graph) == []
    # The plan survives a JSON round trip through its schema.
    assert parse_plan(plan.model_dump(mode="json"), label="plan") == plan
    # Simulator invariants: an iteration is no shorter than the busiest stage's work, the bubble is
    # a fraction, and throughput is samples per iteration time.
    assert sim.iteration_time >= max(sim.busy.values()) * (1 - 1e-9)
    assert 0.0 <= sim.bubble_fraction < 1.0
    assert abs(sim.throughput * sim.iteration_time - mini_batch) < 1e-6 * mini_batch
    # Every stage runs every micro-batch's forward and backward exactly once.
    for stage in plan.stages:
        m = mini_batch // stage.micro_batch_size
        assert sorted(stage.schedule.actions) == sorted(
            [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
        )


@pytest.mark.parametrize("name", ["mmt", "dlrm", "candle_uno", "gpt", "bert", "resnext"])
def test_every_zoo_plan_of_either_kind_validates(name):
    """What plan writes, validate passes: both kinds, every schedule, on 8 GPUs of two nodes."""
    graph = load_graph(build(name, "tiny"))
    cluster = load_cluster("dgx-a100")
    for kind in ("gpp", "spp"):
        for schedule in ("1f1b", "kfkb", "greedy", "gpipe"):
            opts = PartitionOptions(mini_batch=32, num_devices=8, schedule=schedule)
            plan, _, _ = plan_gpp(graph, cluster, opts, kind=kind, baseline=False)
            assert check_plan_against_model(plan, graph) == [], (kind, schedule)
