"""Shared network interfaces in the simulator, and which interfaces a stage edge crosses."""

from __future__ import annotations

import pytest

from tessera.core.cost import allreduce_time
from tessera.core.schedule import one_f_one_b
from tessera.core.specs import ClusterSpec
from tessera.planners.pipeline.links import StageLinks, nic_route, ring_link, ring_nics
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


def _with_nics(cluster: ClusterSpec, nics: str) -> ClusterSpec:
    data = cluster.to_json_dict()
    data["links"]["nics"] = nics
    return ClusterSpec.from_json_dict(data)


def test_nic_route_per_node_and_per_device(v100) -> None:
    node = _with_nics(v100, "per-node")
    ids = [d.id for d in node.devices()]  # summit0: ids[0:4], summit1: ids[4:8], summit2: ids[8:12]
    # One device to a 4-way stage on another node: every byte leaves summit0 and enters summit1.
    assert nic_route(node, ids[:1], ids[4:8]) == (("summit0",), ("summit1",), 1.0)
    # To an 8-way stage over two nodes: half enters each, all of it leaves summit0.
    assert nic_route(node, ids[:1], ids[4:12]) == (("summit0",), ("summit1", "summit2"), 1.0)
    # 4-way to 4-way on another node: the node's one interface carries it all ...
    assert nic_route(node, ids[:4], ids[4:8])[2] == 1.0
    # ... while with an interface per device each carries a quarter.
    device = _with_nics(v100, "per-device")
    src, dst, share = nic_route(device, ids[:4], ids[4:8])
    assert (src, dst, share) == (tuple(ids[:4]), tuple(ids[4:8]), 0.25)
    # Inside a node nothing crosses an interface; unset, every stage pair has its own link.
    assert nic_route(node, ids[:2], ids[2:4]) == ((), (), 1.0)
    assert nic_route(v100, ids[:1], ids[4:8]) == ((), (), 1.0)


def _two_rings(shared: bool, relay: bool = False):
    """Stages 0 and 1, two data-parallel stages over the same two nodes a and b, finish their one
    micro-batch at 1 and 2 and all-reduce for 3 each. With ``relay``, stage 1's forward takes 1.5
    and then sends stage 2 (node c) a unit-time activation out through interface a."""
    rings = ("a", "b") if shared else ()
    stages = [
        SimStage(0, 1, 0.5, 0.5, ("F0", "B0"), 2, 3.0, allreduce_nics=rings),
        SimStage(1, 1, 1.5 if relay else 1.0, 1.0, ("F0", "B0"), 2, 3.0, allreduce_nics=rings),
    ]
    edges = []
    if relay:
        stages.append(SimStage(2, 1, 10.0, 1.0, ("F0", "B0")))
        edges = [SimEdge(1, 2, 1.0, 1.0, 0.0, ("a",) if shared else (), ("c",) if shared else ())]
    return simulate(stages, edges, 1)


def test_all_reduces_through_one_interface_take_turns() -> None:
    # Own links: the rings end at 1 + 3 and 2 + 3. Sharing the nodes' interfaces, the second
    # ring starts when the first ends (4) and ends at 7.
    assert _two_rings(shared=False).iteration_time == pytest.approx(5.0)
    res = _two_rings(shared=True)
    assert res.iteration_time == pytest.approx(7.0)
    rings = sorted((e.start, e.end, e.stage) for e in res.events if e.kind == "allreduce")
    assert rings == [(1.0, 4.0, 0), (4.0, 7.0, 1)]


def test_a_transfer_waits_for_the_all_reduce_holding_its_interface() -> None:
    # Stage 0's ring holds interface a from 1 to 4; stage 1's activation for stage 2, ready at
    # 1.5, leaves when the ring is done (4) and arrives at 5. Own links: it would arrive at 2.5.
    res = _two_rings(shared=True, relay=True)
    send = next(e for e in res.events if e.kind == "send_F")
    assert (send.start, send.end) == (pytest.approx(4.0), pytest.approx(5.0))
    assert next(e for e in res.events if e.kind == "F" and e.stage == 2).start == pytest.approx(5.0)
    own = next(e for e in _two_rings(shared=False, relay=True).events if e.kind == "send_F")
    assert (own.start, own.end) == (pytest.approx(1.5), pytest.approx(2.5))


def test_ring_nics(v100) -> None:
    node, device = _with_nics(v100, "per-node"), _with_nics(v100, "per-device")
    devs = node.devices()
    assert ring_nics(node, devs[2:6]) == ("summit0", "summit1")
    assert ring_nics(device, device.devices()[2:6]) == tuple(d.id for d in devs[2:6])
    assert ring_nics(node, devs[:4]) == ()  # one node: NVLink
    assert ring_nics(v100, devs[2:6]) == ()  # no interfaces named


def test_ring_link_bandwidth_per_interface_layout(v100) -> None:
    # graphpipe-v100: NVLink 50 GB/s inside a node, one 12.5 GB/s interface per node (or device).
    node, device, own = _with_nics(v100, "per-node"), _with_nics(v100, "per-device"), v100
    devs = node.devices()
    assert ring_link(node, devs[:1]) is None
    assert ring_link(node, devs[:4]).bandwidth == pytest.approx(50e9)
    # Over two nodes the ring leaves each node through its interface: 12.5 GB/s ...
    assert ring_link(node, devs[:8]).bandwidth == pytest.approx(12.5e9)
    assert ring_link(own, devs[:8]).bandwidth == pytest.approx(12.5e9)
    # ... unless every replica has its own: four channels, capped by NVLink (4 x 12.5 = 50) ...
    assert ring_link(device, devs[:8]).bandwidth == pytest.approx(50e9)
    # ... and a node holding only two of the replicas gives two lanes (25 GB/s).
    assert ring_link(device, devs[2:8]).bandwidth == pytest.approx(25e9)
    assert ring_link(device, devs[:8]).latency == own.links.inter_node.latency
    # 235 MB of fp16 gradients (CANDLE-Uno's first top layer) over 8 devices on 2 nodes:
    # 2 * 7/8 * 235e6 / 12.5e9 = 32.9 ms through one interface per node, 8.2 ms through four,
    # plus 14 hops of 5 us.
    nbytes = 235e6
    assert allreduce_time(nbytes, 8, ring_link(node, devs[:8])) == pytest.approx(32.97e-3, rel=1e-3)
    assert allreduce_time(nbytes, 8, ring_link(device, devs[:8])) == pytest.approx(8.295e-3, rel=1e-3)


def test_stage_links_match_the_ring_of_the_placed_group(v100) -> None:
    # The DP's estimate (StageLinks.within) and the materialized stage (ring_link over the ranks
    # _assign_ranks gives a power-of-two group: whole nodes) agree.
    for nics in ("per-node", "per-device"):
        cluster = _with_nics(v100, nics)
        links = StageLinks(cluster, 16)
        for d in (2, 4, 8, 16):
            assert links.within(d) == ring_link(cluster, cluster.devices()[:d]), (nics, d)
