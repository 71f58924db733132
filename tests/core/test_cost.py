from __future__ import annotations

import pytest

from tessera.core.cost import (
    CostModel,
    TrainingMemory,
    allreduce_time,
    backward_ratio,
    per_device_samples,
    sharded_sync_time,
)
from tessera.core.graph import OpNode
from tessera.core.specs import ClusterSpec, DeviceType, Link


def _op(flops: int, bytes_moved: int, params: int) -> OpNode:
    return OpNode("n", "MatMul", "", {}, (), (), flops, bytes_moved, params, params * 4)


@pytest.fixture(scope="module")
def v100(v100: ClusterSpec) -> DeviceType:
    """Here the V100 itself: the device type of the shared graphpipe-v100 cluster."""
    return v100.devices()[0].type


def test_roofline_forward_and_backward(v100) -> None:
    cost = CostModel.for_device(v100, "fp32")
    op = _op(flops=10**9, bytes_moved=4 * 10**6 + 4000, params=1000)
    fw = cost.forward_time(op, 8)
    compute = 8 * 10**9 / v100.peak_flops("fp32")
    memory = (4000 + 4 * 10**6 * 8) / v100.memory_bandwidth
    assert fw == pytest.approx(max(compute, memory) + v100.kernel_launch_overhead)
    assert backward_ratio(op) == 2.0
    assert cost.backward_time(op, 8) == pytest.approx(2 * max(compute, memory) + v100.kernel_launch_overhead)
    no_weights = _op(flops=10**9, bytes_moved=10**6, params=0)
    assert backward_ratio(no_weights) == 1.0
    assert cost.backward_time(no_weights, 8) == pytest.approx(cost.forward_time(no_weights, 8))


def test_mixed_precision_uses_fp16_peak_and_16_bytes_per_param(v100) -> None:
    cost = CostModel.for_device(v100)
    assert cost.peak_flops == v100.peak_flops("fp16")
    assert TrainingMemory.adam("mixed").bytes_per_param == 16
    assert TrainingMemory.adam("fp32").bytes_per_param == 16
    op = _op(0, 0, 10)
    assert cost.weight_bytes(op) + cost.optimizer_bytes(op) == 160
    custom = CostModel.for_device(v100, bytes_per_param=20)
    assert custom.weight_bytes(op) + custom.optimizer_bytes(op) == 200
    with pytest.raises(ValueError):
        CostModel.for_device(v100, bytes_per_param=1)


def test_communication() -> None:
    link = Link(bandwidth=1e9, latency=1e-6)
    assert allreduce_time(1e9, 1, link) == 0.0
    assert allreduce_time(1e9, 4, link) == pytest.approx(2 * 3 / 4 * 1.0 + 6e-6)
    assert link.transfer_time(1e6) == pytest.approx(1e-6 + 1e-3)
    assert per_device_samples(8, 3) == 3
    assert per_device_samples(2, 4) == 1


def test_a_measured_allreduce_curve_is_interpolated_for_its_rank_count() -> None:
    """gloo's all-reduce is no alpha-beta line: measured points are met exactly, sizes between
    them lie between their times (log-log), and other sizes and rank counts use the fit."""
    curve = [(4, 2.7e-4), (65536, 4.0e-4), (1048576, 1.2e-3), (16777216, 2.0e-2)]
    link = Link(
        bandwidth=3e9, latency=7e-5, allreduce_bandwidth=9e8, allreduce_latency=1.5e-4,
        allreduce_ranks=2, allreduce_curve=curve,
    )  # fmt: skip
    fit = Link(bandwidth=3e9, latency=7e-5, allreduce_bandwidth=9e8, allreduce_latency=1.5e-4)
    for n, seconds in curve:
        assert allreduce_time(n, 2, link) == pytest.approx(seconds)
    between = allreduce_time(262144, 2, link)
    assert 4.0e-4 < between < 1.2e-3
    assert between == pytest.approx((4.0e-4 * 1.2e-3) ** 0.5)  # the log-log midpoint
    assert allreduce_time(2**26, 2, link) == allreduce_time(2**26, 2, fit)  # beyond the curve
    assert allreduce_time(65536, 4, link) == allreduce_time(65536, 4, fit)  # another rank count
    with pytest.raises(ValueError, match="sizes must increase"):
        Link(bandwidth=3e9, allreduce_ranks=2, allreduce_curve=[(65536, 1e-3), (4, 2e-3)])
    with pytest.raises(ValueError, match="needs allreduce_ranks"):
        Link(bandwidth=3e9, allreduce_curve=[(4, 1e-3), (65536, 2e-3)])


def test_a_zero_stage_pays_the_measured_reduce_scatter_and_all_gather() -> None:
    """ZeRO-1's pair: the link's measured curve for its rank count (log-log between points),
    beyond it the curve's end ratio to the all-reduce; without a curve, the all-reduce's time."""
    reduce = [(4, 2.7e-4), (65536, 4.0e-4), (1048576, 1.2e-3)]
    pair = [(4, 3.0e-4), (65536, 9.0e-4), (1048576, 3.6e-3)]
    link = Link(bandwidth=3e9, latency=7e-5, allreduce_ranks=2, allreduce_curve=reduce, zero_sync_curve=pair)
    for n, seconds in pair:
        assert sharded_sync_time(n, 2, link) == pytest.approx(seconds)
    assert sharded_sync_time(2**22, 2, link) == pytest.approx(allreduce_time(2**22, 2, link) * 3.0)
    assert sharded_sync_time(65536, 4, link) == allreduce_time(65536, 4, link)  # another rank count
    plain = Link(bandwidth=3e9, latency=7e-5, allreduce_ranks=2, allreduce_curve=reduce)
    assert sharded_sync_time(65536, 2, plain) == allreduce_time(65536, 2, plain)
    assert sharded_sync_time(65536, 1, link) == 0.0
    with pytest.raises(ValueError, match="zero_sync_curve: sizes must increase"):
        Link(bandwidth=3e9, allreduce_ranks=2, zero_sync_curve=[(65536, 1e-3), (4, 2e-3)])
