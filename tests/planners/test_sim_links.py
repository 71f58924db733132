"""Shared network interfaces in the simulator, and which interfaces a stage edge crosses."""

from __future__ import annotations

import pytest

from tessera.core.specs import ClusterSpec, load_cluster
from tessera.planners.gpp.partition import nic_route
from tessera.planners.gpp.schedule import one_f_one_b
from tessera.planners.sim import SimEdge, SimStage, simulate


def _fan_in(shared: bool, f0: float = 1.0, f1: float = 1.0):
    """Stages 0 and 1 (node a, b) each send one unit-time transfer to stage 2 (node c)."""
    stages = [
        SimStage(0, 1, f0, 1.0, tuple(one_f_one_b(1, 2))),
        SimStage(1, 1, f1, 1.0, tuple(one_f_one_b(1, 2))),
        SimStage(2, 1, 1.0, 1.0, tuple(one_f_one_b(1, 1))),
    ]
    nics = {0: ("a",), 1: ("b",)} if shared else {0: (), 1: ()}
    edges = [SimEdge(i, 2, 1.0, 1.0, 0.0, nics[i], ("c",) if shared else ()) for i in (0, 1)]
    return simulate(stages, edges, 1)


def test_transfers_through_one_interface_take_turns() -> None:
    # Own links: both activations arrive at 2, stage 2 runs 2-4, both gradients arrive at 5, the
    # sources' backwards end at 6. One interface into (and out of) node c: the second activation
    # arrives at 3 and the second gradient at 7, so the iteration ends at 8.
    assert _fan_in(shared=False).iteration_time == pytest.approx(6.0)
    assert _fan_in(shared=True).iteration_time == pytest.approx(8.0)


def test_the_interface_serves_first_come_first_served() -> None:
    # Stage 1 finishes its forward first (0.5 < 2.0): its activation takes the interface first,
    # although stage 0 comes first in the stage list.
    res = _fan_in(shared=True, f0=2.0, f1=0.5)
    sends = sorted((e.start, e.stage) for e in res.events if e.kind == "send_F")
    assert sends == [(0.5, 1), (2.0, 0)]


def _cluster(nics: str) -> ClusterSpec:
    data = load_cluster("graphpipe-v100").to_json_dict()
    data["links"]["nics"] = nics
    return ClusterSpec.from_json_dict(data)


def test_nic_route_per_node_and_per_device() -> None:
    node = _cluster("per-node")
    ids = [d.id for d in node.devices()]  # summit0: ids[0:4], summit1: ids[4:8], summit2: ids[8:12]
    # One device to a 4-way stage on another node: every byte leaves summit0 and enters summit1.
    assert nic_route(node, ids[:1], ids[4:8]) == (("summit0",), ("summit1",), 1.0)
    # To an 8-way stage over two nodes: half enters each, all of it leaves summit0.
    assert nic_route(node, ids[:1], ids[4:12]) == (("summit0",), ("summit1", "summit2"), 1.0)
    # 4-way to 4-way on another node: the node's one interface carries it all ...
    assert nic_route(node, ids[:4], ids[4:8])[2] == 1.0
    # ... while with an interface per device each carries a quarter.
    device = _cluster("per-device")
    src, dst, share = nic_route(device, ids[:4], ids[4:8])
    assert (src, dst, share) == (tuple(ids[:4]), tuple(ids[4:8]), 0.25)
    # Inside a node nothing crosses an interface; unset, every stage pair has its own link.
    assert nic_route(node, ids[:2], ids[2:4]) == ((), (), 1.0)
    assert nic_route(load_cluster("graphpipe-v100"), ids[:1], ids[4:8]) == ((), (), 1.0)
