from __future__ import annotations

import dataclasses
import math
import re

import pytest
from planners.pipeline.gpp_graphs import chain, n_shaped

from tessera.core.errors import InfeasibleError, InputError
from tessera.core.graph import load_graph
from tessera.core.plan_checks import check_plan_against_model
from tessera.core.plans import dump_plan
from tessera.core.specs import load_cluster
from tessera.models import build
from tessera.planners.pipeline.plan import plan_gpp
from tessera.planners.pipeline.search import partition
from tessera.planners.pipeline.spp import plan_sequential, plan_spp
from tessera.planners.pipeline.types import PartitionOptions
from tessera.planners.sim import simulate_pipeline


def _spans(pipe):
    return [(s.nodes, len(s.devices), s.micro_batch_size) for s in pipe.stages]


def test_chain_gpp_equals_spp(v100) -> None:
    g = chain(16, width=512)
    opts = PartitionOptions(mini_batch=64, num_devices=4)
    gpp = partition(g, v100, opts)
    spp = plan_spp(g, v100, opts)
    # The same pipeline up to ties: with one micro-batch every 2-stage split of the chain takes
    # the same time (SPP's search tries fewer split points, so it may pick another of them).
    assert gpp.micro_batch_size == spp.micro_batch_size
    assert [len(s.devices) for s in gpp.stages] == [len(s.devices) for s in spp.stages]
    assert simulate_pipeline(gpp).iteration_time == pytest.approx(simulate_pipeline(spp).iteration_time)


@pytest.mark.parametrize("name", ["mmt", "candle_uno", "dlrm"])
def test_plans_pass_c1_c5_and_memory(v100, zoo_graph, name: str) -> None:
    g = zoo_graph(name)
    plan, pipe, sim = plan_gpp(g, v100, PartitionOptions(mini_batch=32, num_devices=4))
    assert check_plan_against_model(plan, g) == []
    assert 1 <= sum(len(s.devices) for s in plan.stages) <= 4  # idle devices allowed (none helps)
    assert plan.predicted["iteration_time_s"] > 0
    assert plan.baseline is not None and plan.baseline["kind"] == "spp"
    # GPP is never worse than the sequential baseline (a chain is a graph pipeline too).
    assert plan.predicted["throughput_samples_per_s"] >= plan.baseline["throughput_samples_per_s"] * (
        1 - 1e-9
    )
    for st in plan.stages:
        assert st.memory.peak <= v100.devices()[0].type.memory


def test_multi_branch_plan_runs_branches_in_parallel(v100, zoo_graph) -> None:
    g = zoo_graph("candle_uno", "paper")
    opts = PartitionOptions(mini_batch=16384, num_devices=16)
    pipe = partition(g, v100, opts)
    spp = plan_spp(g, v100, opts)
    assert pipe.pipeline_depth < len(pipe.stages)  # a graph, not a chain
    assert spp.pipeline_depth == len(spp.stages)
    # The SPP baseline is a real DP now (it was 1.2x slower with a 7-device merge stage); here
    # the series-parallel DP comes within 10 % of it, and `plan --kind gpp` takes the faster one.
    assert simulate_pipeline(pipe).throughput > 0.9 * simulate_pipeline(spp).throughput
    plan, _, _ = plan_gpp(g, v100, opts)
    assert plan.predicted["throughput_samples_per_s"] >= plan.baseline["throughput_samples_per_s"]


@pytest.mark.parametrize(
    ("name", "mini_batch", "devices", "gain"), [("mmt", 128, 8, 1.1), ("dlrm", 1024, 16, 1.2)]
)
def test_graph_plan_beats_sequential(
    v100, zoo_graph, name: str, mini_batch: int, devices: int, gain: float
) -> None:
    g = zoo_graph(name, "paper")
    opts = PartitionOptions(mini_batch=mini_batch, num_devices=devices)
    pipe = partition(g, v100, opts)
    spp = plan_spp(g, v100, opts)
    assert pipe.pipeline_depth <= spp.pipeline_depth
    assert simulate_pipeline(pipe).throughput > gain * simulate_pipeline(spp).throughput


def test_dlrm_gains_from_more_devices(v100, zoo_graph) -> None:
    g = zoo_graph("dlrm", "paper")
    eight = partition(g, v100, PartitionOptions(mini_batch=512, num_devices=8))
    sixteen = partition(g, v100, PartitionOptions(mini_batch=1024, num_devices=16))
    assert simulate_pipeline(sixteen).throughput > simulate_pipeline(eight).throughput


def test_no_stage_gets_devices_it_cannot_use(v100, zoo_graph) -> None:
    g = zoo_graph("candle_uno", "paper")
    pipe = partition(g, v100, PartitionOptions(mini_batch=16384, num_devices=16))
    for st in pipe.stages:
        d = len(st.devices)
        assert d <= st.micro_batch_size  # at least one sample per replica
        assert d & (d - 1) == 0  # data-parallel degrees are powers of two (thesis §3.5)
    # The merge and the top MLP are not a many-device stage of their own (an old plan gave them 7 of 16).
    last = pipe.stages[-1]
    assert len(last.devices) <= 4


def test_non_series_parallel_graph_plans(v100) -> None:
    g = n_shaped()
    plan, _, _ = plan_gpp(g, v100, PartitionOptions(mini_batch=16, num_devices=2), baseline=False)
    assert check_plan_against_model(plan, g) == []


def test_infeasible_memory_limit(v100, zoo_graph) -> None:
    g = zoo_graph("mmt", "paper")
    with pytest.raises(InfeasibleError, match="GiB per device"):
        partition(g, v100, PartitionOptions(mini_batch=64, num_devices=2, memory_limit=2**30))


def test_infeasible_message_names_the_smallest_memory_a_plan_needs(v100, zoo_graph) -> None:
    # Tiny MMT needs KiB, not "0.00 GiB". The fastest plan without a limit needs about 1.6 MiB,
    # but that is not what the limit must be: the message names the least memory of the plans
    # the partitioner finds (a bisection on the limit), and at that limit it plans.
    g = zoo_graph("mmt")
    opts = PartitionOptions(mini_batch=16, num_devices=4, memory_limit=200 * 1024)
    with pytest.raises(
        InfeasibleError, match=r"fits 200\.0 KiB per device .* needs (\d+\.\d) KiB per device"
    ) as err:
        partition(g, v100, opts)
    need = float(re.search(r"needs (\d+\.\d) KiB", str(err.value)).group(1)) * 1024
    fastest = max(
        s.memory.peak for s in partition(g, v100, dataclasses.replace(opts, memory_limit=None)).stages
    )
    assert 200 * 1024 < need < fastest / 2
    fits = partition(g, v100, dataclasses.replace(opts, memory_limit=math.ceil(need * 1.001)))
    assert max(s.memory.peak for s in fits.stages) <= need * 1.001


def test_a_mini_batch_without_micro_batch_sizes_gets_a_suggestion(v100, zoo_graph) -> None:
    # 100000 = 32 · 3125: its power-of-two divisors leave more than 256 micro-batches. A multiple of
    # 512 (100000 / 256 rounded up to a power of two) has one; 100352 is the nearest.
    g = zoo_graph("mmt")
    with pytest.raises(InputError, match="a multiple of 512 has one, e.g. 100352"):
        partition(g, v100, PartitionOptions(mini_batch=100000, num_devices=4))
    partition(g, v100, PartitionOptions(mini_batch=100352, num_devices=4))  # and it plans


def test_deterministic_plan_json(v100) -> None:
    g = load_graph(build("mmt", "tiny"))
    opts = PartitionOptions(mini_batch=16, num_devices=4)
    a = dump_plan(plan_gpp(g, v100, opts)[0])
    b = dump_plan(plan_gpp(load_graph(build("mmt", "tiny")), v100, opts)[0])
    assert a == b


def test_kfkb_and_gpipe_schedules(v100, zoo_graph) -> None:
    g = zoo_graph("candle_uno")
    for schedule, k in (("kfkb", 2), ("gpipe", 1), ("greedy", 1)):
        opts = PartitionOptions(mini_batch=32, num_devices=4, schedule=schedule, k=k)
        plan, _, _ = plan_gpp(g, v100, opts, baseline=False)
        assert check_plan_against_model(plan, g) == []
        assert plan.stages[0].schedule.kind == schedule


def test_recomputation_fits_a_limit_that_stored_activations_do_not(v100, zoo_graph) -> None:
    # Tiny GPT on 4 devices needs about 232 KiB per device storing activations; recomputing them
    # (a stage keeps its inputs per micro-batch in flight, plus one micro-batch's activations)
    # fits 200 KiB. The plan records it per stage, validate counts its memory so, and the
    # simulator agrees.
    g = zoo_graph("gpt")
    opts = PartitionOptions(mini_batch=8, num_devices=4, memory_limit=200 * 1024)
    with pytest.raises(InfeasibleError, match="--recompute auto"):
        plan_gpp(g, v100, opts, baseline=False)
    plans = {}
    for recompute in ("all", "auto"):
        plan, pipe, sim = plan_gpp(g, v100, dataclasses.replace(opts, recompute=recompute), baseline=False)
        assert plan.training.recompute == recompute
        assert [st.recompute for st in plan.stages] == [st.recompute for st in pipe.stages]
        assert check_plan_against_model(plan, g) == []
        for st in plan.stages:
            assert st.memory.peak <= 200 * 1024
            assert sim.peak_memory[st.id] == pytest.approx(st.memory.peak, abs=16)
        plans[recompute] = plan, sim
    every, every_sim = plans["all"]
    assert all(st.recompute for st in every.stages)
    # auto recomputes where it must: not on the last stage (one micro-batch in flight), and the
    # forward it saves there makes the plan faster than recomputing everywhere.
    chosen, chosen_sim = plans["auto"]
    assert any(st.recompute for st in chosen.stages) and not chosen.stages[-1].recompute
    assert chosen_sim.throughput > 1.1 * every_sim.throughput
    stored = every.model_copy(
        update={
            "stages": [st.model_copy(update={"recompute": False}) for st in every.stages],
            "training": every.training.model_copy(update={"recompute": "never"}),
        }
    )
    assert any("memory: stage" in p for p in check_plan_against_model(stored, g))  # counted storing: too big
    # In the auto plan, a stage that keeps its activations edited to recompute them: it would fit,
    # but the plan's record (and its predicted times) are of the stage keeping them.
    last = chosen.stages[-1]
    flipped = chosen.model_copy(
        update={"stages": [*chosen.stages[:-1], last.model_copy(update={"recompute": True})]}
    )
    problems = check_plan_against_model(flipped, g)
    assert len(problems) == 1 and problems[0].startswith(
        f"memory: stage {last.id} records {last.memory.peak} bytes"
    )


def test_without_memory_pressure_auto_recomputation_changes_nothing(v100, zoo_graph) -> None:
    g = zoo_graph("gpt")
    opts = PartitionOptions(mini_batch=8, num_devices=4)
    never, _, _ = plan_gpp(g, v100, opts, baseline=False)
    auto, _, _ = plan_gpp(g, v100, dataclasses.replace(opts, recompute="auto"), baseline=False)
    assert not any(st.recompute for st in auto.stages)
    assert dump_plan(auto) == dump_plan(never).replace('"recompute": "never"', '"recompute": "auto"')


@pytest.mark.parametrize(
    ("name", "cluster", "devices", "mini_batch", "kind", "extra", "limit"),
    [
        # The per-stage DPs alone were slower or found nothing here (a tester's sweep): Piper's
        # bisection settled on a plan that recomputes where keeping activations simulates faster;
        # the chain DP's few split points per stage missed the faster micro-batch; greedy
        # schedules hold more micro-batches than the DP's 1F1B counts, so only plans that
        # recompute everywhere fit.
        ("gpt", "graphpipe-v100", 4, 8, "spp", {}, 378049),
        ("candle_uno", "graphpipe-v100", 4, 8, "spp", {"schedule": "kfkb", "k": 2}, 47124),
        ("gpt", "dgx-a100", 8, 16, "gpp", {"schedule": "greedy"}, 107723),
    ],
)
def test_auto_recomputation_is_never_slower_than_never_or_all(
    zoo_graph, name, cluster, devices, mini_batch, kind, extra, limit
) -> None:
    g = zoo_graph(name)
    spec = load_cluster(cluster)
    got = {}
    for mode in ("never", "all", "auto"):
        opts = PartitionOptions(
            mini_batch=mini_batch, num_devices=devices, memory_limit=limit, recompute=mode, **extra
        )
        try:
            if kind == "spp":
                pipe = plan_sequential(g, spec, opts, explain=False)
            else:
                pipe = partition(g, spec, opts, explain=False)
        except InfeasibleError:
            continue
        got[mode] = simulate_pipeline(pipe, trace=False).throughput
    assert "auto" in got and got["auto"] >= max(got.values())


def test_a_plan_found_only_under_a_looser_limit_is_named_with_that_limit(cluster, zoo_graph) -> None:
    # Greedy schedules under 178,000 bytes: no plan, but the bisection for the message finds one
    # of 165.5 KiB under a looser limit (the search is not monotone in the limit). The message
    # says so rather than that 165.5 KiB is needed, and that limit does plan.
    g = zoo_graph("gpt")
    spec = cluster("dgx-a100")
    opts = PartitionOptions(mini_batch=16, num_devices=8, schedule="greedy", memory_limit=178000)
    with pytest.raises(InfeasibleError) as info:
        partition(g, spec, opts)
    found = re.search(
        r"a plan needing ([\d.]+) KiB per device is found only under --memory-limit ([\d.]+) KiB",
        info.value.message,
    )
    assert found, info.value.message
    need, looser = float(found[1]), float(found[2])
    assert need * 1024 <= 178000 < looser * 1024
    pipe = partition(g, spec, dataclasses.replace(opts, memory_limit=looser * 1024 + 512))
    assert max(st.memory.peak for st in pipe.stages) <= looser * 1024 + 512
