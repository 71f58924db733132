"""``plan --profile`` measures the chosen plan's stages as the executor runs them (the stage's
program, its replicas' micro-batch, the optimizer step and the data drawn each step), caches them so
a warm run writes the same plan, and predicts with them; CPU plans count fp32 training."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli

from tessera.backends.profile_cache import ProfileCache
from tessera.core.errors import TesseraError
from tessera.core.specs import load_cluster
from tessera.planners.pipeline.plan import pipeline_options, plan_gpp
from tessera.planners.pipeline.stage_profile import StageProfileOptions, StageProfiler
from tessera.planners.sim import simulate_pipeline

QUICK = StageProfileOptions(budget_s=0.02, min_repeats=2, max_repeats=3, warmup=1)


def _pipe(zoo_graph, devices: int = 2, kind: str = "gpp"):
    graph = zoo_graph("mmt")
    cluster = load_cluster("local-cpu-split")
    options = dataclasses.replace(
        pipeline_options(cluster, mini_batch=8, devices=devices), micro_batch_sizes=(4,), memory_limit=3e6
    )
    _, pipe, _ = plan_gpp(graph, cluster, options, kind=kind, baseline=False)
    return graph, cluster, options, pipe


def test_stages_are_measured_then_read_back_from_the_cache(zoo_graph, tmp_path: Path) -> None:
    graph, cluster, _, pipe = _pipe(zoo_graph)
    device = cluster.devices()[0].type
    cache = ProfileCache(tmp_path / "p.sqlite")
    first = StageProfiler(graph, device, cache, QUICK)
    refined = first.refine(pipe)
    assert first.measured == len(pipe.stages) >= 1
    for old, new in zip(pipe.stages, refined.stages, strict=True):
        assert new.nodes == old.nodes and new.micro_batch_size == old.micro_batch_size
        assert new.forward_time > 0 and new.backward_time > 0 and new.step_time > 0
    again = StageProfiler(graph, device, cache, QUICK)
    assert again.refine(pipe) == refined and again.measured == 0
    # The simulator runs the step after the all-reduce: the iteration grows by at least the
    # slowest stage's step.
    bare = simulate_pipeline(dataclasses.replace(refined, stages=[
        dataclasses.replace(st, step_time=0.0) for st in refined.stages
    ]))  # fmt: skip
    assert simulate_pipeline(refined).iteration_time >= bare.iteration_time + min(
        st.step_time for st in refined.stages
    )
    # Clipping to a global norm: every stage's step waits for the last gradient and the norm's
    # all-reduce; traced, each stage shows that wait and its step as one all-reduce event.
    steps = max(st.step_time for st in refined.stages)
    clipped = simulate_pipeline(dataclasses.replace(refined, clip_time=1e-3))
    assert clipped.iteration_time == pytest.approx(bare.iteration_time + 1e-3 + steps)
    ends = sorted(e.end for e in clipped.events if e.kind == "allreduce" and e.micro_batch == -1)
    assert len(ends) >= len(refined.stages) and ends[-1] == pytest.approx(clipped.iteration_time)


def test_pipelines_measured_together_are_each_refined_as_alone(zoo_graph, tmp_path: Path) -> None:
    """refine_all measures the distinct stages of several pipelines in one session (bursts in
    turns) and gives each pipeline what refine gives it from the cache afterwards."""
    graph, cluster, _, pipe = _pipe(zoo_graph)
    _, _, _, alone = _pipe(zoo_graph, devices=1)
    device = cluster.devices()[0].type
    cache = ProfileCache(tmp_path / "p.sqlite")
    together = StageProfiler(graph, device, cache, QUICK, cluster=cluster)
    refined = together.refine_all([pipe, alone, pipe])
    assert together.measured == len(pipe.stages) + len(alone.stages)  # each stage once
    assert refined[0] == refined[2] and [p.stages[0].nodes for p in refined[:2]] == [
        pipe.stages[0].nodes,
        alone.stages[0].nodes,
    ]
    later = StageProfiler(graph, device, cache, QUICK, cluster=cluster)
    assert [later.refine(pipe), later.refine(alone)] == refined[:2] and later.measured == 0


def test_the_planner_measures_a_plan_and_its_sequential_rival_together(zoo_graph) -> None:
    """With the SPP baseline, plan_gpp hands both pipelines to one refine: the comparison that
    picks between them sees one stretch of the host's drift."""
    graph, cluster, options, _ = _pipe(zoo_graph)
    calls: list[list[str]] = []

    def refine(pipes):
        calls.append([p.kind for p in pipes])
        return list(pipes)

    plan_gpp(graph, cluster, options, kind="gpp", baseline=True, refine=refine)
    assert calls == [["spp", "gpp"]]
    calls.clear()
    plan_gpp(graph, cluster, options, kind="spp", baseline=False, refine=refine)
    assert calls == [["spp"]]


def test_a_recomputing_stage_pays_its_forward_again_in_the_backward(zoo_graph, tmp_path: Path) -> None:
    graph, cluster, _, pipe = _pipe(zoo_graph, devices=1)
    profiler = StageProfiler(graph, cluster.devices()[0].type, ProfileCache(tmp_path / "p.sqlite"), QUICK)
    plain = profiler.refine(pipe).stages[0]
    again = profiler.refine(
        dataclasses.replace(pipe, stages=[dataclasses.replace(pipe.stages[0], recompute=True)])
    ).stages[0]
    assert again.backward_time == pytest.approx(plain.backward_time + plain.forward_time)


def test_ranks_sharing_a_node_pay_its_contention_on_every_action(zoo_graph, tmp_path: Path) -> None:
    """Stages are measured one at a time; a plan's ranks on one node compute at once, each action
    slower by the device type's contention_overhead (tessera calibrate measures it)."""
    graph, cluster, _, replicated = _pipe(zoo_graph)
    (st,) = replicated.stages  # its two devices as two stages of one rank each, on one node
    pipe = dataclasses.replace(
        replicated, stages=[dataclasses.replace(st, id=i, devices=[d]) for i, d in enumerate(st.devices)]
    )
    _, _, _, alone = _pipe(zoo_graph, devices=1)
    device = cluster.devices()[0].type
    assert len({cluster.device(d).node for st in pipe.stages for d in st.devices}) == 1
    cache = ProfileCache(tmp_path / "p.sqlite")
    plain = StageProfiler(graph, device, cache, QUICK, cluster=cluster)
    contended = device.model_copy(update={"contention_overhead": 1e-3})
    loaded = StageProfiler(graph, contended, cache, QUICK, cluster=cluster)
    for before, after in zip(plain.refine(pipe).stages, loaded.refine(pipe).stages, strict=True):
        assert after.forward_time == pytest.approx(before.forward_time + 1e-3)
        assert after.backward_time == pytest.approx(before.backward_time + 1e-3)
        assert after.step_time == before.step_time
    # One rank alone on the node: nothing to contend with.
    expected = plain.refine(alone)
    assert loaded.refine(alone) == expected and loaded.measured == 0


def test_replicas_on_one_node_pay_its_replica_contention_as_a_fraction_of_each_action(
    zoo_graph, tmp_path: Path, monkeypatch
) -> None:
    """Where this machine cannot run a node's replicas at once (here: one core), a data-parallel
    stage is measured alone, and its replicas, computing the same operators at the same moment,
    each action slower by the device type's replica_contention, a fraction (instead of
    contention_overhead); a spec without it (calibrated before) charges them contention_overhead,
    and stages of one rank each (here: the same operators twice) keep it."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    graph, cluster, _, replicated = _pipe(zoo_graph)
    (st,) = replicated.stages
    assert len(st.devices) == 2 and len({cluster.device(d).node for d in st.devices}) == 1
    one_each = dataclasses.replace(
        replicated, stages=[dataclasses.replace(st, id=i, devices=[d]) for i, d in enumerate(st.devices)]
    )
    device = cluster.devices()[0].type
    cache = ProfileCache(tmp_path / "p.sqlite")

    def refined(pipe, **update):
        profiler = StageProfiler(graph, device.model_copy(update=update), cache, QUICK, cluster=cluster)
        return profiler.refine(pipe).stages

    (plain,) = refined(replicated)
    (after,) = refined(replicated, contention_overhead=1e-3, replica_contention=0.25)
    assert after.forward_time == pytest.approx(1.25 * plain.forward_time)
    assert after.backward_time == pytest.approx(1.25 * plain.backward_time)
    (older,) = refined(replicated, contention_overhead=1e-3)
    assert older.forward_time == pytest.approx(plain.forward_time + 1e-3)
    for alone, beside in zip(
        refined(one_each), refined(one_each, contention_overhead=1e-3, replica_contention=0.25), strict=True
    ):
        assert beside.forward_time == pytest.approx(alone.forward_time + 1e-3)
        assert beside.backward_time == pytest.approx(alone.backward_time + 1e-3)


def test_cpu_plans_count_fp32_training_and_gpu_plans_mixed_precision() -> None:
    assert pipeline_options(load_cluster("local-cpu-split"), mini_batch=8).precision == "fp32"
    assert pipeline_options(load_cluster("dgx-a100"), mini_batch=8).precision == "mixed"


@pytest.mark.slow
def test_a_profiled_plan_predicts_with_its_stages_and_a_warm_rerun_is_byte_identical(
    zoo, tmp_path: Path
) -> None:
    model = tmp_path / "candle.onnx"
    model.write_bytes(zoo("candle_uno").SerializeToString())
    args = ["plan", str(model), "--cluster", "local-cpu-split", "--mini-batch", "8", "--profile"]
    args += ["--cache", str(tmp_path / "p.sqlite"), "--no-baseline"]
    first = run_cli(*args, "-o", str(tmp_path / "a.json"))
    assert first.code == 0, first.err
    second = run_cli(*args, "-o", str(tmp_path / "b.json"))
    assert second.code == 0, second.err
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    plan = json.loads((tmp_path / "a.json").read_text())
    assert all(st["predicted"]["step_time_s"] > 0 for st in plan["stages"])


def test_a_burst_another_process_slowed_is_outvoted(zoo_graph, tmp_path: Path, monkeypatch) -> None:
    # The machine's noise cannot be summoned on cue: the steps' clock is, and the middle burst's
    # steps read 10x (as when a neighbour takes the core for a second).
    import tessera.planners.pipeline.stage_profile as stage_profile

    graph, cluster, _, pipe = _pipe(zoo_graph, devices=1)
    options = StageProfileOptions(budget_s=1e3, min_repeats=2, max_repeats=3, warmup=1, bursts=3)
    calls = iter(range(100))
    slow = range(options.warmup + options.max_repeats, options.warmup + 2 * options.max_repeats)

    def step(*args) -> tuple[float, float, float]:
        factor = 10.0 if next(calls) in slow else 1.0
        return 1e-3 * factor, 2e-3 * factor, 5e-4 * factor

    monkeypatch.setattr(stage_profile, "one_step", step)
    profiler = StageProfiler(graph, cluster.devices()[0].type, ProfileCache(tmp_path / "p.sqlite"), options)
    st = profiler.refine(pipe).stages[0]
    assert next(calls) == options.warmup + options.bursts * options.max_repeats  # the slow burst ran
    assert (st.forward_time, st.backward_time, st.step_time) == (1e-3, 2e-3, 5e-4)


def test_a_plans_stages_take_their_bursts_in_turns(zoo_graph, tmp_path: Path, monkeypatch) -> None:
    # Drift over seconds would otherwise slow one stage's bursts and not the other's.
    import tessera.planners.pipeline.stage_profile as stage_profile

    graph, cluster, _, pipe = _pipe(zoo_graph, kind="spp")
    assert len(pipe.stages) == 2
    options = StageProfileOptions(budget_s=1e3, min_repeats=2, max_repeats=2, warmup=1, bursts=3)
    order: list[int] = []
    modules: dict[int, int] = {}

    def step(module, *args) -> tuple[float, float, float]:
        order.append(modules.setdefault(id(module), len(modules)))
        return 1e-3, 2e-3, 5e-4

    monkeypatch.setattr(stage_profile, "one_step", step)
    profiler = StageProfiler(graph, cluster.devices()[0].type, ProfileCache(tmp_path / "p.sqlite"), options)
    refined = profiler.refine(pipe)
    assert order == [0] * 3 + [1] * 3 + ([0] * 2 + [1] * 2) * 2
    assert profiler.measured == 2 and all(st.forward_time == 1e-3 for st in refined.stages)


def test_a_gpu_clusters_stages_are_left_to_the_operators_times_where_torch_sees_no_gpu() -> None:
    from tessera.planners.pipeline.search import planned_device_type
    from tessera.planners.pipeline.stage_profile import stages_measurable

    assert stages_measurable(planned_device_type(load_cluster("local-cpu-split"), 1))
    gpu = planned_device_type(load_cluster("h200"), 1)
    assert stages_measurable(gpu) == torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_clusters_stages_are_measured_on_the_gpu(zoo_graph, tmp_path: Path) -> None:
    from tessera.planners.pipeline.search import planned_device_type

    graph = zoo_graph("gpt")
    cluster = load_cluster("h200")
    options = dataclasses.replace(pipeline_options(cluster, mini_batch=8, devices=1), micro_batch_sizes=(4,))
    _, pipe, _ = plan_gpp(graph, cluster, options, baseline=False)
    profiler = StageProfiler(
        graph, planned_device_type(cluster, 1), ProfileCache(tmp_path / "p.sqlite"), QUICK
    )
    assert profiler.device == "cuda" and "torch cuda" in profiler.fingerprint
    torch.cuda.reset_peak_memory_stats()
    refined = profiler.refine(pipe)
    assert torch.cuda.max_memory_allocated() > 0  # the stage ran there
    assert profiler.measured == len(pipe.stages)
    assert all(st.forward_time > 0 and st.backward_time > 0 and st.step_time > 0 for st in refined.stages)


def test_each_optimizer_is_timed_with_its_own_step(zoo_graph, tmp_path: Path, monkeypatch) -> None:
    """A profile is of the optimizer launch will train with: its step is the one timed (the
    profiler builds torch.optim's), and an SGD profile in the cache is not read for AdamW."""
    from tessera.planners.pipeline import stage_profile

    graph, cluster, _, pipe = _pipe(zoo_graph)
    device = cluster.devices()[0].type
    cache = ProfileCache(tmp_path / "p.sqlite")
    built: list[str] = []
    real = stage_profile.StageProfiler._runner
    runs: list = []

    def runner(self, request):
        run = real(self, request)
        built.append(type(run.optimizer).__name__)
        runs.append(run)
        return run

    monkeypatch.setattr(stage_profile.StageProfiler, "_runner", runner)
    StageProfiler(graph, device, cache, QUICK).refine(pipe)
    adamw = StageProfiler(graph, device, cache, QUICK, optimizer="adamw")
    adamw.refine(pipe)
    assert adamw.measured == len(pipe.stages)  # not read from the SGD entries
    assert set(built[: len(pipe.stages)]) == {"SGD"} and set(built[len(pipe.stages) :]) == {"AdamW"}
    ce = StageProfiler(graph, device, cache, QUICK, optimizer="adamw", loss="ce")
    ce.refine(pipe)
    assert ce.measured == len(pipe.stages)  # a cross-entropy profile is one of its own
    assert all(not run.clip for run in runs)


def test_a_clipped_profile_times_the_norm_with_each_step(zoo_graph, tmp_path: Path, monkeypatch) -> None:
    """With the norm launch clips to, each timed step clips its gradients (before the optimizer's
    step, as the workers do) and the profile is one of its own in the cache; the optimizers are
    torch's fused ones, as the workers'."""
    from tessera.planners.pipeline import stage_profile

    graph, cluster, _, pipe = _pipe(zoo_graph)
    device = cluster.devices()[0].type
    cache = ProfileCache(tmp_path / "p.sqlite")
    clipped: list[int] = []
    runs: list[object] = []
    real = stage_profile.StageProfiler._runner

    def runner(self, request):
        run = real(self, request)
        assert run.optimizer.defaults["fused"] is True
        clip = run.clip

        def counted():
            clipped.append(1)
            return clip()

        runs.append(run)
        return dataclasses.replace(run, clip=counted) if clip else run

    monkeypatch.setattr(stage_profile.StageProfiler, "_runner", runner)
    StageProfiler(graph, device, cache, QUICK, optimizer="adamw").refine(pipe)
    assert not clipped and all(r.clip is None for r in runs)
    with_clip = StageProfiler(graph, device, cache, QUICK, optimizer="adamw", max_grad_norm=1.0)
    with_clip.refine(pipe)
    assert with_clip.measured == len(pipe.stages)  # not read from the unclipped entries
    assert len(clipped) >= len(pipe.stages) * (QUICK.warmup + QUICK.min_repeats)


def test_a_cross_entropy_profile_scores_the_models_logits_by_it() -> None:
    from tessera.planners.pipeline.stage_step import scored

    logits = torch.randn(2, 3, 5, requires_grad=True)
    labels = torch.arange(6) % 5
    want = torch.nn.functional.cross_entropy(logits.reshape(6, 5), labels, reduction="sum") / 6
    torch.testing.assert_close(scored(logits, True), want)
    torch.testing.assert_close(scored(logits, False), (logits * logits).mean())
    assert scored(torch.randn(2, 3), True) is None  # an output that takes no gradient scores nothing


def test_plan_records_the_optimizer_and_launch_warns_when_it_trains_with_another(zoo, tmp_path: Path) -> None:
    model = tmp_path / "mmt.onnx"
    model.write_bytes(zoo("mmt").SerializeToString())
    base = ["plan", str(model), "--cluster", "local-cpu-split", "--mini-batch", "8", "--devices", "1"]
    plain = tmp_path / "plain.json"
    assert run_cli(*base, "-o", str(plain)).code == 0
    assert "optimizer" not in json.loads(plain.read_text())["training"]  # plans without it read as before
    profiled = tmp_path / "profiled.json"
    made = run_cli(
        *base, "--profile", "--cache", str(tmp_path / "c.sqlite"), "--optimizer", "adamw", "-o", str(profiled)
    )
    assert made.code == 0, made.err
    assert json.loads(profiled.read_text())["training"]["optimizer"] == "adamw"
    run = run_cli("launch", str(profiled), "--steps", "1")
    assert run.code == 0 and "timed with optimizer adamw, this run trains with sgd" in run.err
    run = run_cli("launch", str(profiled), "--steps", "1", "--optimizer", "adamw")
    assert run.code == 0 and "timed with" not in run.err
    ce = tmp_path / "ce.json"
    made = run_cli(*base, "--profile", "--cache", str(tmp_path / "c.sqlite"), "--loss", "ce", "-o", str(ce))
    assert made.code == 0, made.err
    assert json.loads(ce.read_text())["training"]["loss"] == "ce"
    run = run_cli("launch", str(ce), "--steps", "1")
    assert run.code == 0 and "timed with loss ce, this run trains with mse" in run.err


def test_plan_records_the_clipping_charges_its_all_reduce_and_launch_warns_without_it(
    zoo, tmp_path: Path
) -> None:
    model = tmp_path / "mmt.onnx"
    model.write_bytes(zoo("mmt").SerializeToString())
    base = ["plan", str(model), *"--cluster local-cpu-split --mini-batch 8 --stages 2 --json".split()]
    plain = json.loads(run_cli(*base).out)
    clipped = json.loads(run_cli(*base, "--max-grad-norm", "1.0").out)
    assert "max_grad_norm" not in plain["training"] and clipped["training"]["max_grad_norm"] == 1.0
    # The same stages; the norm's all-reduce over both ranks before the steps: at least its latency.
    link = load_cluster("local-cpu-split").links.intra_node
    assert [s["nodes"] for s in clipped["stages"]] == [s["nodes"] for s in plain["stages"]]
    assert (
        clipped["predicted"]["iteration_time_s"]
        >= plain["predicted"]["iteration_time_s"] + 2 * (link.allreduce_latency or link.latency) * 0.999
    )
    assert run_cli(*base, "--max-grad-norm", "0").code == 2
    profiled = tmp_path / "clipped.json"
    made = run_cli(*base[:-1], "--profile", "--cache", str(tmp_path / "c.sqlite"), "--max-grad-norm", "1",
                   "-o", str(profiled))  # fmt: skip
    assert made.code == 0, made.err
    run = run_cli("launch", str(profiled), "--steps", "1")
    assert run.code == 0 and "timed with gradient clipping, this run trains without it" in run.err
    run = run_cli("launch", str(profiled), "--steps", "1", "--max-grad-norm", "5")
    assert run.code == 0 and "timed with" not in run.err


def test_replicas_on_one_node_are_measured_beside_each_other(zoo_graph, tmp_path: Path) -> None:
    """A data-parallel stage whose node's replicas this machine runs at once (two ranks of one
    thread on two cores) is measured on two ranks computing it together: their contention is in
    its times (no replica_contention added), cached apart from the stage measured alone."""
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two cores needed to run two replicas at once")
    graph, cluster, _, replicated = _pipe(zoo_graph)
    (st,) = replicated.stages
    device = cluster.devices()[0].type
    assert len(st.devices) == 2 and (device.cores or 1) == 1
    cache = ProfileCache(tmp_path / "p.sqlite")
    profiler = StageProfiler(graph, device, cache, QUICK, cluster=cluster)
    (beside,) = profiler.refine(replicated).stages
    assert profiler.measured == 1 and beside.forward_time > 0 and beside.backward_time > 0
    # The spec's fraction is not charged on top of what the replicas measured together.
    loaded = StageProfiler(
        graph, device.model_copy(update={"replica_contention": 0.25}), cache, QUICK, cluster=cluster
    )
    assert loaded.refine(replicated).stages == [beside] and loaded.measured == 0
    # The same nodes and micro-batch as one rank alone: another row, measured.
    alone = dataclasses.replace(replicated, stages=[dataclasses.replace(st, devices=st.devices[:1])])
    single = StageProfiler(graph, device, cache, QUICK, cluster=cluster)
    single.refine(alone)
    assert single.measured == 1


def test_a_tensor_parallel_stage_is_measured_on_its_ranks(zoo_graph, tmp_path: Path) -> None:
    """``plan --tensor-parallel 2 --profile``: the stage is measured as its 2 ranks run it (each
    its block of the split, collectives over gloo), cached apart from the whole stage's times,
    and the plan predicts with it."""
    graph = zoo_graph("gpt")
    cluster = load_cluster("local-cpu-split")
    options = dataclasses.replace(
        pipeline_options(cluster, mini_batch=8, tensor_parallel=2), micro_batch_sizes=(8,)
    )
    device = cluster.devices()[0].type
    cache = ProfileCache(tmp_path / "p.sqlite")
    profiler = StageProfiler(graph, device, cache, QUICK, cluster=cluster)
    plan, pipe, _ = plan_gpp(graph, cluster, options, baseline=False, refine=profiler.refine_all)
    assert profiler.measured == len(pipe.stages) == 1 and plan.stages[0].tensor_parallel == 2
    stage = pipe.stages[0]
    assert stage.forward_time > 0 and stage.backward_time > 0 and stage.step_time > 0
    assert plan.predicted["iteration_time_s"] >= stage.forward_time + stage.backward_time
    again = StageProfiler(graph, device, cache, QUICK, cluster=cluster)
    replanned, _, _ = plan_gpp(graph, cluster, options, baseline=False, refine=again.refine_all)
    assert again.measured == 0 and replanned.predicted == plan.predicted
    whole = StageProfiler(graph, device, cache, QUICK, cluster=cluster)
    whole.refine(pipe)  # the same nodes as one process runs them: measured, not the ranks' row
    assert whole.measured == 1
    # Two plans' split stages: measured by the same ranks, their bursts in turns, each as alone.
    _, quarter, _ = plan_gpp(
        graph, cluster, dataclasses.replace(options, micro_batch_sizes=(2,)), baseline=False
    )
    fresh = ProfileCache(tmp_path / "q.sqlite")
    together = StageProfiler(graph, device, fresh, QUICK, cluster=cluster)
    both = together.refine_all([pipe, quarter], 2)
    assert together.measured == 2 and both[0] != pipe and both[1] != quarter
    assert StageProfiler(graph, device, fresh, QUICK, cluster=cluster).refine(quarter, 2) == both[1]


def test_a_rank_that_fails_its_measurement_is_named(zoo_graph, tmp_path: Path) -> None:
    from tessera.core.data import TrainingData
    from tessera.planners.pipeline import stage_ranks

    stage = stage_ranks.SplitStage(
        models=[b"not a model"] * 2, feeds={}, grads=frozenset(), actions=("F0", "B0"),
        data=TrainingData(zoo_graph("gpt"), 2),
    )  # fmt: skip
    job = stage_ranks.SplitJob(
        stages=[stage], scored=frozenset(), optimizer="sgd", max_grad_norm=None, threads=1, device="cpu",
        options=QUICK,
    )  # fmt: skip
    with pytest.raises(TesseraError, match=r"on 2 ranks: rank \d failed: \w+"):
        stage_ranks.run_ranks(job, 2)
    # Rank 1 runs and blocks in a collective rank 0 never joins: rank 0's failure ends the wait.
    graph = zoo_graph("gpt")
    drawn, _ = TrainingData(graph, 2).batch(0)
    stage = dataclasses.replace(
        stage,
        models=[b"not a model", graph.model.SerializeToString()],
        feeds={name: torch.from_numpy(value) for name, value in drawn.items()},
    )
    started = time.monotonic()
    with pytest.raises(TesseraError, match=r"on 2 ranks: rank 0 failed: \w+"):
        stage_ranks.run_ranks(dataclasses.replace(job, stages=[stage]), 2)
    assert time.monotonic() - started < 120


def test_a_rank_that_dies_without_a_report_is_named_not_waited_for() -> None:
    import multiprocessing as mp
    import os
    import time

    from tessera.planners.pipeline import stage_ranks

    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=time.sleep, args=(60,), daemon=True),
        ctx.Process(target=os._exit, args=(3,)),
    ]
    for p in procs:
        p.start()
    started = time.monotonic()
    try:
        got = stage_ranks._collected(ctx.Queue(), procs)
    finally:
        procs[0].kill()
    assert got == {1: "its process ended with exit code 3"} and time.monotonic() - started < 30
