from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx import helper
from planners.pipeline.gpp_graphs import _model, chain

from tessera.core.cost import CostModel
from tessera.core.graph import Graph, load_graph
from tessera.core.plan_checks import check_plan_against_model
from tessera.core.plans import dump_plan
from tessera.core.specs import ClusterSpec
from tessera.models import build
from tessera.planners.pipeline.links import StageLinks
from tessera.planners.pipeline.piper import MIN_UNIT_SHARE, PIPER_LIMIT, piper_ideals, plan_piper
from tessera.planners.pipeline.piper_dp import IdealDP, Lattice
from tessera.planners.pipeline.plan import plan_gpp
from tessera.planners.pipeline.search import build_tree
from tessera.planners.pipeline.spp import plan_sequential, plan_spp, sequential_record
from tessera.planners.pipeline.types import PartitionOptions
from tessera.planners.sim import simulate_pipeline


def diamond(width: int = 256, narrow: int = 64) -> Graph:
    """Two branches from x to an Add: a heavy one (two width×width MatMuls) and a light one (two
    MatMuls through ``narrow``). Sequential stages {a1, b1} | {a2, b2, merge} balance the work;
    no cut of a topological order that lists a branch before the other does."""
    inits = {
        "wa1": np.ones((width, width), np.float32),
        "wa2": np.ones((width, width), np.float32),
        "wb1": np.ones((width, narrow), np.float32),
        "wb2": np.ones((narrow, width), np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "wa1"], ["a1"], name="a1"),
        helper.make_node("MatMul", ["a1", "wa2"], ["a2"], name="a2"),
        helper.make_node("MatMul", ["x", "wb1"], ["b1"], name="b1"),
        helper.make_node("MatMul", ["b1", "wb2"], ["b2"], name="b2"),
        helper.make_node("Add", ["a2", "b2"], ["y"], name="merge"),
    ]
    return load_graph(_model(nodes, ["x"], ["y"], inits, width))


def compute_bound(devices: int = 2) -> ClusterSpec:
    """Slow devices with no launch overhead on a fast link: stage times follow the FLOPs."""
    return ClusterSpec.from_json_dict(
        {
            "name": "compute-bound",
            "device_types": {
                "slow": {
                    "kind": "gpu",
                    "name": "slow",
                    "memory": 2**34,
                    "flops": {"fp32": 1e12, "fp16": 1e12},
                    "memory_bandwidth": 1e13,
                    "kernel_launch_overhead": 0.0,
                }
            },
            "nodes": [{"name": "n", "count": 1, "devices": [{"type": "slow", "count": devices}]}],
            "links": {"intra_node": {"bandwidth": 1e12, "latency": 0.0}},
        }
    )


def _stages(pipe) -> list[tuple[list[str], int, int]]:
    return [(s.nodes, len(s.devices), s.micro_batch_size) for s in pipe.stages]


def test_chain_piper_equals_pipedream(v100) -> None:
    g = chain(16, width=512)
    # Same search space on a chain (its ideals are its prefixes): the same plan.
    opts = PartitionOptions(mini_batch=64, num_devices=4, micro_batch_sizes=(8,))
    pipedream = plan_spp(g, v100, opts)
    piper = plan_piper(g, v100, opts)
    assert piper.pipeline is not None and not piper.coarsened
    assert piper.ideals == piper.units + 1
    assert _stages(piper.pipeline) == _stages(pipedream)
    assert simulate_pipeline(piper.pipeline).throughput == pytest.approx(
        simulate_pipeline(pipedream).throughput
    )
    # Over every micro-batch size Piper-style is never worse (the ladder of looser bounds finds
    # the two-stage plan that beats four stages at one micro-batch).
    opts = PartitionOptions(mini_batch=64, num_devices=4)
    best = plan_piper(g, v100, opts).pipeline
    assert best is not None
    assert simulate_pipeline(best).throughput >= simulate_pipeline(plan_spp(g, v100, opts)).throughput


def test_cross_branch_stage_beats_pipedream() -> None:
    g = diamond()
    cluster = compute_bound(2)
    opts = PartitionOptions(mini_batch=32, micro_batch_sizes=(1,))  # pipelining, no replication
    pipedream = plan_spp(g, cluster, opts)
    piper = plan_piper(g, cluster, opts).pipeline
    assert piper is not None
    assert [s.nodes for s in piper.stages] == [["a1", "b1"], ["a2", "b2", "merge"]]
    assert simulate_pipeline(piper).throughput > 1.1 * simulate_pipeline(pipedream).throughput
    assert piper.bottleneck_tps < pipedream.bottleneck_tps
    best = plan_sequential(g, cluster, opts)
    assert best.method == "piper"
    assert _stages(best) == _stages(piper)
    record = sequential_record(best)
    assert record["sequential_method"] == "piper"
    assert record["piper"]["throughput_samples_per_s"] > record["pipedream_throughput_samples_per_s"]


# (diamond's width and narrow, mini-batch, micro-batch, memory limit)
_LOOSE = ((256, 64), 64, 4, 2**22)
_WEIGHTS_BIND = ((256, 64), 64, 4, 1_054_576)  # weights + a few micro-batches
# Activations bind: on 4 devices no plan keeps every stage's activations (see below).
_ACTIVATIONS_BIND = [((64, 16), 256, 64, 80_000), ((64, 16), 256, 32, 72_000)]


def _ideal_dp(case: tuple, devices: int, recompute: str) -> tuple[Lattice, IdealDP]:
    (width, narrow), mini_batch, b, limit = case
    g = diamond(width, narrow)
    cluster = compute_bound(4)
    opts = PartitionOptions(
        mini_batch=mini_batch, num_devices=devices, memory_limit=limit, recompute=recompute
    )
    cost = CostModel.for_device(cluster.devices()[0].type)
    lattice = Lattice(g, build_tree(g, cost, 128), cost)
    return lattice, IdealDP(lattice, StageLinks(cluster, devices), opts, b, limit, devices)


@pytest.mark.parametrize("recompute", ["never", "auto"])
@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("case", [_LOOSE, _WEIGHTS_BIND, *_ACTIVATIONS_BIND])
def test_dp_finds_the_smallest_bottleneck(devices: int, case: tuple, recompute: str) -> None:
    """Against brute force over every chain of ideals, every data-parallel degree and (``auto``)
    whether each stage recomputes, memory (in-flight micro-batches: one per stage from this one
    on) included."""
    lattice, dp = _ideal_dp(case, devices, recompute)
    pair = {(int(lo), int(hi)): p for p, (lo, hi) in enumerate(zip(lattice.lo, lattice.hi, strict=True))}

    def chains(ideal: int):
        if ideal == 0:
            yield []
            return
        for (lower, upper), p in pair.items():
            if upper == ideal:
                for rest in chains(lower):
                    yield [*rest, p]

    best = np.inf
    for stages in chains(lattice.n - 1):
        n = len(stages)
        for ks in itertools.product(range(len(dp.rows)), repeat=n):
            plan = list(zip(stages, ks, strict=True))
            if sum(dp.rows[k][0] for k in ks) > devices:
                continue
            if any(dp.smax[k, p] < n - 1 - i for i, (p, k) in enumerate(plan)):  # Eq. 3.2
                continue
            best = min(best, max(dp.tps[k, p] for p, k in plan))
    plans = dp.search(0.0, 1e-6)
    if best == np.inf:
        assert plans == []
        return
    assert min(max(dp.tps[k, p] for p, k in plan) for plan in plans) == pytest.approx(best, rel=1e-5)
    for plan in plans:
        assert sum(dp.rows[k][0] for _, k in plan) <= devices
        assert all(dp.smax[k, p] >= len(plan) - 1 - i for i, (p, k) in enumerate(plan))


@pytest.mark.parametrize("case", _ACTIVATIONS_BIND)
def test_auto_recomputes_where_keeping_activations_has_no_plan(case: tuple) -> None:
    """The cases above where recomputation matters: keeping activations, no plan fits; with
    ``auto`` one does, and only some of its stages recompute (the last keeps one micro-batch in
    flight: recomputing there would only cost)."""
    assert _ideal_dp(case, 4, "never")[1].search(0.0, 1e-6) == []
    _, dp = _ideal_dp(case, 4, "auto")
    plans = dp.search(0.0, 1e-6)
    assert plans
    for plan in plans:
        flags = [dp.rows[k][1] for _, k in plan]
        assert any(flags) and not all(flags) and not flags[-1]


@pytest.mark.parametrize("name", ["gpt", "mmt"])
def test_piper_plans_pass_the_plan_checks(v100, zoo_graph, name: str) -> None:
    g = zoo_graph(name)
    for opts in (
        PartitionOptions(mini_batch=32, num_devices=4),
        PartitionOptions(mini_batch=32, num_devices=4, memory_limit=2**30, schedule="kfkb", k=2),
        PartitionOptions(mini_batch=32, num_devices=3, schedule="gpipe"),
    ):
        piper = plan_piper(g, v100, opts)
        assert piper.pipeline is not None and piper.ideals <= PIPER_LIMIT
        plan, pipe, _ = plan_gpp(g, v100, opts, kind="spp")
        assert check_plan_against_model(plan, g) == []
        assert plan.predicted["sequential_method"] in ("piper", "pipedream")
        assert plan.predicted["piper"]["units"] == piper.units
        # The plan is the faster of the two sequential planners.
        pipedream = plan.predicted["pipedream_throughput_samples_per_s"]
        piper_throughput = plan.predicted["piper"]["throughput_samples_per_s"]
        faster = "piper" if piper_throughput > pipedream else "pipedream"
        assert plan.predicted["sequential_method"] == faster
        for st in plan.stages:
            assert st.memory.peak <= (opts.memory_limit or v100.devices()[0].type.memory)
        assert pipe.pipeline_depth == len(pipe.stages)  # sequential: stages run in order


def test_piper_plan_of_the_diamond_passes_the_checks() -> None:
    g = diamond()
    cluster = compute_bound(2)
    plan, pipe, _ = plan_gpp(g, cluster, PartitionOptions(mini_batch=32, micro_batch_sizes=(1,)), kind="spp")
    assert plan.predicted["sequential_method"] == "piper"
    assert [s.nodes for s in plan.stages] == [["a1", "b1"], ["a2", "b2", "merge"]]
    assert check_plan_against_model(plan, g) == []


def test_coarsened_to_become_tractable(v100, zoo_graph) -> None:
    g = zoo_graph("mmt")
    tree = build_tree(g, CostModel.for_device(v100.devices()[0].type), 128)
    assert piper_ideals(tree) > PIPER_LIMIT
    result = plan_piper(g, v100, PartitionOptions(mini_batch=32, num_devices=4), tree=tree)
    assert result.pipeline is not None and result.coarsened
    assert result.requested_units == tree.num_units
    assert MIN_UNIT_SHARE * tree.num_units <= result.units < tree.num_units
    assert result.ideals <= PIPER_LIMIT
    assert "coarsened from" in result.describe()
    assert sorted(op for st in result.pipeline.stages for op in st.nodes) == sorted(g.order)


@pytest.mark.parametrize("name", ["dlrm", "candle_uno"])
def test_intractable_graphs_are_reported_not_attempted(v100, zoo_graph, name: str) -> None:
    g = zoo_graph(name)
    result = plan_piper(g, v100, PartitionOptions(mini_batch=32, num_devices=4))
    assert result.pipeline is None and not result.tractable
    assert result.reason is not None and result.reason.startswith(f"intractable: {result.ideals} ideals")
    assert result.ideals > 10**6 and result.pairs == 0  # counted, no DP
    plan, _, _ = plan_gpp(g, v100, PartitionOptions(mini_batch=32, num_devices=4), kind="spp")
    assert plan.predicted["sequential_method"] == "pipedream"
    assert plan.predicted["piper"]["no_plan"] == result.reason
    # Without coarsening even the MMT is over the limit.
    mmt = plan_piper(zoo_graph("mmt"), v100, PartitionOptions(mini_batch=32), coarsen=False)
    assert mmt.pipeline is None and mmt.reason == f"intractable: {mmt.ideals} ideals (limit {PIPER_LIMIT})"


def test_deterministic(v100) -> None:
    opts = PartitionOptions(mini_batch=16, num_devices=4)
    a = plan_piper(load_graph(build("gpt", "tiny")), v100, opts).pipeline
    b = plan_piper(load_graph(build("gpt", "tiny")), v100, opts).pipeline
    assert a is not None and b is not None
    assert _stages(a) == _stages(b)
    assert [s.schedule for s in a.stages] == [s.schedule for s in b.stages]
    one = dump_plan(plan_gpp(load_graph(build("gpt", "tiny")), v100, opts, kind="spp")[0])
    two = dump_plan(plan_gpp(load_graph(build("gpt", "tiny")), v100, opts, kind="spp")[0])
    assert one == two


def test_reordered_unit_costs_equal_costs_computed_afresh(v100, zoo_graph) -> None:
    # The Piper planner materializes every chain with its units' costs permuted, not recomputed:
    # they must equal the costs computed on the reordered tree, to the last bit.
    import random

    from tessera.planners.pipeline.unit_costs import UnitCosts

    g = zoo_graph("mmt")
    cost = CostModel.for_device(v100.devices()[0].type)
    tree = build_tree(g, cost, 128)
    costs = UnitCosts(g, tree, cost)
    costs.times(4)  # computed before the permutation: carried along
    order = list(range(tree.num_units))
    random.Random(0).shuffle(order)
    reordered = tree.chained(order)
    fresh, permuted = UnitCosts(g, reordered, cost), costs.reordered(reordered, order)
    for name in ("weights", "optimizer", "grads", "act"):
        assert getattr(permuted, name) == getattr(fresh, name)
    for samples in (4, 7):
        assert permuted.times(samples) == fresh.times(samples)
    n = tree.num_units
    for lo, hi in [(0, n), (3, n - 2), (n // 2, n // 2 + 5)]:
        assert permuted.enter(lo, hi) == fresh.enter(lo, hi)
        assert permuted.block_key(lo, hi)[1:] == fresh.block_key(lo, hi)[1:]


def _tensors_read(graph: Graph, tree, cost: CostModel) -> dict[tuple[str, int], tuple[float, set[int]]]:
    """Brute force: every activation crossing units, by (name, making unit): bytes, reading units."""
    out: dict[tuple[str, int], tuple[float, set[int]]] = {}
    for u, v, data in graph.dag.edges(data=True):
        a, b = tree.unit_of[u], tree.unit_of[v]
        if a != b and u not in graph.constant_nodes:
            for t in data["tensors"]:
                out.setdefault((t.name, a), (cost.wire_bytes(t.nbytes), set()))[1].add(b)
    return out


@pytest.mark.parametrize("name", ["mmt", "bert", "gpt"])
def test_bytes_entering_a_stage_count_each_tensor_once(v100, zoo_graph, name: str) -> None:
    """A stage receives a tensor once however many of its units read it (a transformer's residual
    stream feeds the layer's norm and its residual add): the DP's bytes entering a unit range, and
    Piper's bytes crossing an ideal's cut, entering a stage I \\ I' and flowing between two
    stages, all equal a count over the model's tensors; counting per reading unit counts more."""
    g = zoo_graph(name)
    cost = CostModel.for_device(v100.devices()[0].type)
    lattice = Lattice(g, build_tree(g, cost, 16), cost)
    tree, costs = lattice.tree, lattice.costs
    made = [(p, w, readers) for (_, p), (w, readers) in _tensors_read(g, tree, cost).items()]
    n = costs.n
    overcounted = 0
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            want = sum(w for p, w, readers in made if p < lo and any(lo <= r < hi for r in readers))
            assert costs.enter(lo, hi) == want
            overcounted += costs._pair[:lo, lo:hi].sum() > want  # per reading unit
    assert overcounted  # the model has ranges where counting per reading unit double counts
    members = [set(np.flatnonzero(row)) for row in lattice.member]
    for i, ideal in enumerate(members):
        assert lattice.cut[i] == sum(w for p, w, readers in made if p in ideal and not readers <= ideal)
    inputs = lattice.stage_input()
    for k in range(0, lattice.pairs, max(1, lattice.pairs // 200)):
        before, stage = members[lattice.lo[k]], members[lattice.hi[k]] - members[lattice.lo[k]]
        assert inputs[k] == sum(w for p, w, readers in made if p in before and readers & stage)
    # Three stages: the first, middle and last thirds of the units.
    thirds = [set(range(a, b)) for a, b in ((0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n))]
    assign = np.array([[1.0 if u in st else 0.0 for u in range(n)] for st in thirds])
    flows = lattice.flows(assign)
    for i, a in enumerate(thirds):
        for j, b in enumerate(thirds):
            if i != j:
                assert flows[i, j] == sum(w for p, w, readers in made if p in a and readers & b)
