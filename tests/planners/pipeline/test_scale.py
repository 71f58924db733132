"""Planning at scale: beyond 128 devices the stage DP splits devices in steps of a power-of-two
grain, and a plan for more devices is never slower than the plan for fewer."""

from __future__ import annotations

import pytest

from tessera.core.graph import load_graph
from tessera.core.plan_checks import check_plan_against_model
from tessera.core.specs import parse_cluster
from tessera.models import build
from tessera.planners.pipeline import checks as _checks  # noqa: F401 - registers the plan checks
from tessera.planners.pipeline.dp import GRAIN_STATES, device_grain
from tessera.planners.pipeline.plan import plan_gpp
from tessera.planners.pipeline.types import PartitionOptions


def test_the_grain_keeps_the_states_as_at_128_devices() -> None:
    assert [device_grain(n) for n in (1, 64, 128, 129, 256, 1000, 4096, 16384)] == [1, 1, 1, 2, 2, 8, 32, 128]
    assert all(n / device_grain(n) <= GRAIN_STATES for n in range(1, 5000, 37))


def _v100s(n: int):
    return parse_cluster(
        {
            "name": f"v100-{n}",
            "device_types": {
                "v100": {
                    "kind": "gpu",
                    "memory": "16160MiB",
                    "flops": {"fp32": "15.7TFLOPS", "fp16": "125TFLOPS"},
                    "memory_bandwidth": "900GB/s",
                }
            },
            "nodes": [{"name": "summit", "count": n // 4, "devices": [{"type": "v100", "count": 4}]}],
            "links": {
                "intra_node": {"bandwidth": "50GB/s", "latency": "2us"},
                "inter_node": {"bandwidth": "100Gb/s", "latency": "5us"},
            },
        },
        source=f"v100-{n}",
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "mmt"])
def test_twice_the_devices_plan_at_least_as_fast(name: str) -> None:
    """Weak scaling, 16 samples per device: the plan for 256 V100s (grain 2) validates and
    simulates at least as fast as the plan for 128 (every device searched)."""
    graph = load_graph(build(name, "paper"))
    throughput = {}
    for n in (128, 256):
        plan, _, sim = plan_gpp(graph, _v100s(n), PartitionOptions(mini_batch=16 * n), baseline=False)
        assert check_plan_against_model(plan, graph) == []
        assert sum(len(st.devices) for st in plan.stages) <= n
        throughput[n] = sim.throughput
    assert throughput[256] >= throughput[128]
