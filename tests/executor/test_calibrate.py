"""``tessera calibrate`` end to end: one real run on this machine (2 ranks, a short budget) writes
a spec that loads, holds sane numbers and plans; the fit and the launch overhead on their own."""

from __future__ import annotations

import json
import math
import os

import pytest
from cli_runner import run_cli

from tessera.cli.calibrate_cmd import summary
from tessera.core.cost import CostModel, allreduce_time, sharded_sync_time
from tessera.core.errors import LaunchError
from tessera.core.graph import load_graph
from tessera.core.specs import DeviceType, Link, load_cluster
from tessera.executor.calibrate import (
    Calibration,
    fit_link,
    fit_ring,
    launch_overhead,
    machine_cores,
    non_decreasing,
)
from tessera.executor.calibrate_worker import CHAIN_NODES, chain_model


# The tests on this run are marked ``alone``: its numbers are this machine's speed, measured while no
# other test process shares the cores (make test runs them after the parallel pass).
@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """One real run over an existing file: (its --json report, the spec path, the old file's inode)."""
    folder = tmp_path_factory.mktemp("calibrate")
    path = folder / "spec.yaml"
    path.write_text("old: file\n")
    old_inode = path.stat().st_ino
    # 6 s of measuring: three rounds of pipeline launches (one per 2 s), a median of three
    result = run_cli("calibrate", "--seconds", "6", "--out", str(path), "--json")
    assert result.code == 0, result.err
    return json.loads(result.out), path, old_inode


@pytest.mark.alone
def test_the_spec_loads_with_sane_numbers(calibrated):
    report, path, _ = calibrated
    spec = load_cluster(path)
    assert spec.name.startswith("calibrated-") and spec.num_devices == 2
    (device,) = spec.device_types.values()
    assert device.kind == "cpu" and device.cores == max(1, machine_cores() // 2)
    for value in (
        device.flops["fp32"],
        device.memory,
        device.memory_bandwidth,
        device.kernel_launch_overhead,
        device.decode_op_overhead,
        device.decode_compiled_op_overhead,
    ):
        assert math.isfinite(value) and value > 0
    # the decode step's cost per operation, traced and compiled by inductor (launch --compile)
    decode = report["measured"]["decode_op"]
    assert device.decode_op_overhead == pytest.approx(decode["step_s"] / decode["operations"], rel=1e-3)
    assert device.decode_compiled_op_overhead == pytest.approx(
        decode["compiled_step_s"] / decode["operations"], rel=1e-3
    )
    # a decode launch's exchange between the two ranks of this host, through shared memory
    assert device.decode_exchange_overhead == pytest.approx(report["measured"]["decode_exchange"], rel=1e-3)
    assert 1e-7 < device.decode_exchange_overhead < 1e-2
    # and how much longer a step's own work takes in step with the later rank
    assert device.decode_rank_skew == pytest.approx(
        report["measured"]["decode_rank_skew"], rel=1e-3, abs=1e-9
    )
    assert 0.0 <= device.decode_rank_skew < 3.0
    link = spec.links.intra_node
    assert 1e-6 <= link.latency <= 1e-2
    assert 1e7 <= link.bandwidth <= 1e11
    # The latency written is what a message keeps a pipeline waiting (fitted to the two-stage run),
    # at least the idle links' fit.
    p2p, reduce = report["measured"]["p2p"], report["measured"]["allreduce"]
    assert link.latency == pytest.approx(report["measured"]["pipeline"]["latency_s"], rel=1e-3)
    assert (
        link.latency
        >= report["measured"]["pipeline"]["latency_floor_s"]
        == pytest.approx(p2p["latency_s"], rel=1e-3)
    )
    # The overhead is a sender's: the stage workers' own per message sent, measured by a
    # 2-stage pipeline launch, at least gloo's part of it; the receiver's is gloo's receiving time.
    pipeline = report["measured"]["pipeline"]
    assert link.overhead == pytest.approx(pipeline["overhead_s"], rel=1e-3)
    assert 1e-6 <= link.overhead <= 1e-2 and p2p["send_s"] > 0 and p2p["receive_s"] > 0
    assert pipeline["messages_per_step"] == [8, 8]  # 4 micro-batches: 4 sent, 4 received a rank
    assert pipeline["sent_per_step"] == [4, 4]
    assert link.overhead >= 0.5 * p2p["send_s"]
    assert link.receive_overhead == pytest.approx(p2p["receive_s"], rel=1e-3)
    assert device.action_overhead == pytest.approx(pipeline["action_overhead_s"], rel=1e-3)
    assert 1e-7 <= device.action_overhead <= 1e-2 and pipeline["actions_per_step"] == 8
    # Two ranks computing the MLP's layers at once: their busy time beyond the one rank's, per action.
    piped, alone = pipeline["busy_per_rank_s"], pipeline["busy_alone_s"]
    assert device.contention_overhead == pytest.approx(pipeline["contention_overhead_s"], rel=1e-3, abs=1e-9)
    assert pipeline["contention_overhead_s"] == pytest.approx(max(sum(piped) - alone, 0.0) / 16, rel=1e-3)
    assert 0 < alone < 2 * sum(piped)
    # ... in the round of the median contention, over 3 rounds of one rank then two.
    rounds = pipeline["contention_per_round_s"]
    assert len(rounds) == pipeline["rounds"] == 3 and pipeline["contention_overhead_s"] == sorted(rounds)[1]
    # Two ranks as one data-parallel stage, each replica the one rank's work: the slower replica's
    # compute beyond it, a fraction, the median over the rounds.
    fractions = pipeline["replica_contention_per_round"]
    assert len(fractions) == 3 and pipeline["replica_contention"] == pytest.approx(sorted(fractions)[1])
    assert device.replica_contention == pytest.approx(pipeline["replica_contention"], abs=1e-4)
    assert 0 <= device.replica_contention < 1
    assert 1e-6 <= link.allreduce_latency <= 1e-2 and 1e7 <= link.allreduce_bandwidth <= 1e11
    # The measured curve is in the spec: the planners' all-reduce time is the measured one.
    assert link.allreduce_ranks == 2 and len(link.allreduce_curve) == len(reduce["bytes"]) == 7
    # ZeRO-1's reduce-scatter and all-gather, measured on the same buffers, are what its stages pay
    # (the curve made non-decreasing: a dip is noise).
    assert reduce["zero_seconds"] == non_decreasing(reduce["zero_measured_s"])
    for n, seconds in zip(reduce["bytes"], reduce["zero_seconds"], strict=True):
        assert sharded_sync_time(n, 2, link) == pytest.approx(seconds + link.allreduce_overhead, rel=1e-3)
    # ... plus what a training step's all-reduce costs beyond it (a data-parallel launch).
    assert link.allreduce_overhead == pytest.approx(pipeline["allreduce_overhead_s"], rel=1e-3, abs=1e-8)
    for n, seconds in zip(reduce["bytes"], reduce["seconds"], strict=True):
        assert allreduce_time(n, 2, link) == pytest.approx(seconds + link.allreduce_overhead, rel=1e-3)
    in_step = pipeline["allreduce_in_step_s"]
    assert allreduce_time(pipeline["allreduce_bytes"], 2, link) == pytest.approx(
        max(in_step, pipeline["allreduce_predicted_s"]), rel=1e-2
    )
    assert report["spec"] == spec.to_json_dict() and report["output"] == str(path)


@pytest.mark.alone
def test_the_report_holds_every_measurement(calibrated):
    report, _, _ = calibrated
    m = report["measured"]
    numbers = [
        m["matmul"]["flops_per_s"],
        m["bandwidth"]["copy_bytes_per_s"],
        m["bandwidth"]["sum_bytes_per_s"],
        m["per_op"]["forward_s"],
        m["per_op"]["forward_backward_s"],
        *m["p2p"]["one_way_s"],
        m["p2p"]["send_s"],
        m["p2p"]["receive_s"],
        *m["allreduce"]["seconds"],
        *m["allreduce"]["ring_model_s"],
        *m["allreduce"]["zero_seconds"],
    ]
    assert all(math.isfinite(x) and x > 0 for x in numbers)
    assert len(report["per_rank"]) == 2 and m["p2p"]["pairs"] == [[0, 1]]
    text = summary(report)
    assert "flops.fp32" in text and "links.intra_node" in text and "all-reduce (2 ranks)" in text


@pytest.mark.alone
def test_the_file_is_the_measurements_spec_and_nothing_else(calibrated):
    """The same measurements give the same file (no date, no run-dependent text): rebuilt from the
    report, the YAML is the file's, byte for byte."""
    report, path, _ = calibrated
    machine = report["machine"]
    cal = Calibration(
        host=machine["host"],
        cpu=machine["cpu"],
        cores=machine["cores"],
        ranks=report["ranks"],
        threads=report["threads_per_rank"],
        seconds=report["seconds"],
        torch_version=machine["torch"],
        memory_total=machine["memory_total_bytes"],
        wall_s=0.0,
        measured=report["measured"],
        ranks_raw=report["per_rank"],
    )
    assert cal.spec_yaml() == path.read_text()
    assert "eval" not in path.read_text()


@pytest.mark.alone
def test_an_existing_file_is_replaced_atomically(calibrated):
    _, path, old_inode = calibrated
    assert path.stat().st_ino != old_inode  # a new file renamed over the old one, not rewritten in place
    assert "old: file" not in path.read_text()
    assert os.listdir(path.parent) == [path.name]  # no temporary file left


@pytest.mark.alone
def test_plan_accepts_the_spec(calibrated, tmp_path):
    _, path, _ = calibrated
    model = tmp_path / "candle.onnx"
    assert run_cli("zoo", "build", "candle_uno", "--size", "tiny", "-o", str(model)).code == 0
    result = run_cli("plan", str(model), "--cluster", str(path), "--mini-batch", "8", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["cluster"]["name"] == load_cluster(path).name


def test_fit_link_recovers_latency_and_bandwidth():
    sizes = [4, 2**10, 2**16, 2**20, 2**22, 2**24]
    noise = [1.03, 0.98, 1.01, 0.99, 1.02, 0.97]
    times = [(50e-6 + n / 2e9) * e for n, e in zip(sizes, noise, strict=True)]
    latency, bandwidth = fit_link(sizes, times)
    assert latency == pytest.approx(50e-6, rel=0.05)
    assert bandwidth == pytest.approx(2e9, rel=0.05)


@pytest.mark.parametrize("ranks", [2, 4])
def test_fit_ring_recovers_the_ring_steps_latency_and_bandwidth(ranks: int):
    link = Link(bandwidth=5e9, latency=1e-5, allreduce_bandwidth=1.5e9, allreduce_latency=8e-5)
    sizes = [4, 2**16, 2**20, 2**24]
    latency, bandwidth = fit_ring(sizes, [allreduce_time(n, ranks, link) for n in sizes], ranks)
    assert latency == pytest.approx(8e-5, rel=1e-6) and bandwidth == pytest.approx(1.5e9, rel=1e-6)


def test_a_zero_sync_curve_never_falls_with_size():
    """A calibrated collective curve that dips (a larger exchange measured faster: noise) is stored
    as the nearest non-decreasing one: each falling run pooled to its mean, the rest kept."""
    measured = [408.6e-6, 1.861e-3, 401.7e-6, 4.005e-3, 4.032e-3, 7.707e-3, 33.74e-3]  # gloo, 2 ranks
    curve = non_decreasing(measured)
    assert curve == sorted(curve) and len(curve) == len(measured)
    assert curve[1] == curve[2] == pytest.approx((1.861e-3 + 401.7e-6) / 2)
    assert [curve[0], *curve[3:]] == [measured[0], *measured[3:]]
    assert non_decreasing([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0] and non_decreasing([]) == []


def test_fit_link_refuses_times_that_do_not_grow():
    with pytest.raises(LaunchError, match="do not grow"):
        fit_link([4, 2**20, 2**24], [3e-3, 2e-3, 1e-3])


def test_the_launch_overhead_makes_the_cost_model_match_the_measured_time_per_node():
    per_op, flops, bandwidth = 4e-6, 1.5e11, 1.2e10
    overhead = launch_overhead(per_op, flops, bandwidth)
    spec_device = {
        "kind": "cpu",
        "memory": 2**30,
        "flops": {"fp32": flops},
        "memory_bandwidth": bandwidth,
        "kernel_launch_overhead": overhead,
    }
    cost = CostModel.for_device(DeviceType(**spec_device))
    ops = load_graph(chain_model(CHAIN_NODES[0])).ops()
    mean = sum(cost.forward_time(op, 1) + cost.backward_time(op, 1) for op in ops) / len(ops)
    assert mean == pytest.approx(per_op, rel=1e-9)
    assert 0 < overhead < per_op / 2  # the roofline of a tiny node is small but not nothing


def test_a_time_per_node_below_the_roofline_is_refused():
    with pytest.raises(LaunchError, match="did not come out positive"):
        launch_overhead(1e-12, 1e9, 1e6)


def _mlp_pipeline(tmp_path):
    """The calibration MLP planned as two stages on a preset's two CPU ranks."""
    import dataclasses

    from tessera.executor import calibrate_pipeline as cp
    from tessera.planners.pipeline.plan import plan_gpp
    from tessera.planners.pipeline.types import PartitionOptions

    path = tmp_path / "mlp.onnx"
    path.write_bytes(cp.mlp().SerializeToString())
    graph, cluster = load_graph(str(path)), load_cluster("local-cpu-split")
    options = PartitionOptions(mini_batch=32, num_devices=1, micro_batch_sizes=(8,), precision="fp32")
    whole, _, _ = plan_gpp(graph, cluster, options, kind="spp", baseline=False)
    options = dataclasses.replace(options, num_devices=2, memory_limit=0.6 * whole.stages[0].memory.peak)
    _, pipe, _ = plan_gpp(graph, cluster, options, kind="spp", baseline=False)
    assert len(pipe.stages) == 2 and pipe.edges
    return pipe


def test_the_pipeline_latency_is_what_makes_the_simulator_give_the_measured_step(tmp_path):
    from tessera.executor.calibrate_pipeline import pipeline_latency, pipeline_model

    pipe = _mlp_pipeline(tmp_path)
    # Two ranks' medians: 4 micro-batches, forwards a third of the compute, 1 ms a step waiting.
    rows = [
        {"stage": s, "actions": 8, "messages": 8, "sent": 4, "iteration_s": 6e-3, "busy_s": 3e-3,
         "forward_busy_s": 1e-3, "wait_s": 1.5e-3, "overhead_s": 1e-3, "allreduce_s": 0.0}
        for s in (0, 1)
    ]  # fmt: skip
    model = pipeline_model(pipe, rows, action_overhead=2e-5, overhead=8e-5)
    floor = 4e-5
    assert model(floor) < 6e-3 < model(1e-2) and model(2e-4) > model(1e-4)
    latency = pipeline_latency(model, 6e-3, floor)
    assert latency > floor and model(latency) == pytest.approx(6e-3, rel=1e-4)
    # A step the idle links already explain keeps their latency.
    assert pipeline_latency(model, 0.9 * model(floor), floor) == floor
    # More compute measured (and less waiting: the step's own time unchanged) leaves less of the
    # step to the messages.
    heavier = [{**r, "busy_s": 3.5e-3, "wait_s": 1e-3} for r in rows]
    assert pipeline_latency(pipeline_model(pipe, heavier, 2e-5, 8e-5), 6e-3, floor) < latency


def test_a_rounds_overheads_split_the_workers_time_into_actions_messages_and_contention():
    from tessera.executor.calibrate_pipeline import round_overheads

    # One rank alone: 16 actions, 0.32 ms waiting on its own inputs and 0.48 ms of overhead a step.
    alone = {"actions": 16, "messages": 0, "busy_s": 6e-3, "wait_s": 0.32e-3, "overhead_s": 0.48e-3,
             "iteration_s": 7e-3}  # fmt: skip
    # Two stages of 8 actions each: 4 messages sent and 4 received a rank, overheads beyond the 8
    # actions' 0.24 ms (a rank's time on messages is its sends': receiving is in its wait).
    piped = [
        {"actions": 8, "messages": 8, "sent": 4, "busy_s": 3.4e-3, "overhead_s": 0.24e-3 + 4 * 180e-6,
         "iteration_s": 6e-3},
        {"actions": 8, "messages": 8, "sent": 4, "busy_s": 3.4e-3, "overhead_s": 0.24e-3 + 4 * 140e-6,
         "iteration_s": 6.2e-3},
    ]  # fmt: skip
    found = round_overheads(alone, piped)
    assert found["action_overhead_s"] == pytest.approx(50e-6)  # (0.32 + 0.48) ms / 16
    assert found["overhead_per_rank_s"] == pytest.approx([180e-6, 140e-6])
    assert found["overhead_s"] == pytest.approx(160e-6)
    assert found["contention_overhead_s"] == pytest.approx(0.8e-3 / 16)  # 6.8 ms against 6 ms
    assert found["iteration_s"] == pytest.approx(6.1e-3)
    # Two ranks that computed faster than the one alone (a round the host slowed): no contention.
    assert round_overheads({**alone, "busy_s": 8e-3}, piped)["contention_overhead_s"] == 0.0


def test_a_rounds_replica_contention_is_the_slower_replicas_compute_beyond_the_one_ranks():
    from tessera.executor.calibrate_pipeline import replica_overhead

    alone = {"busy_s": 6e-3}
    found = replica_overhead(alone, [{"busy_s": 6.6e-3}, {"busy_s": 6.9e-3}])
    assert found["replica_contention"] == pytest.approx(0.15)  # the slower replica: 6.9 ms against 6
    assert found["busy_replicas_s"] == [6.6e-3, 6.9e-3]
    # Replicas faster than the one rank (a round the host slowed): none.
    assert replica_overhead(alone, [{"busy_s": 5e-3}, {"busy_s": 5.5e-3}])["replica_contention"] == 0.0


def test_the_measuring_budget_buys_the_pipeline_rounds() -> None:
    """Five rounds with the default 10 s, one per 2 s of a shorter budget, never none."""
    from tessera.executor.calibrate_pipeline import pipeline_rounds

    assert [pipeline_rounds(s) for s in (0.1, 1, 2, 5, 6, 10, 60)] == [1, 1, 1, 2, 3, 5, 5]
