"""The links a pipeline's transfers and all-reduces run on: the partitioner's assumed links,
ring all-reduce links over nodes, and per-NIC routing of stage-to-stage edges."""

from __future__ import annotations

from collections import Counter

from tessera.core.cost import CostModel, allreduce_time
from tessera.core.graph import Graph
from tessera.core.specs import ClusterSpec, Device, Link
from tessera.planners.pipeline.sp import SPTree
from tessera.planners.pipeline.types import PipelineEdge


class StageLinks:
    """The links the partitioner assumes: inside a node when the devices fit one, else between.

    A data-parallel stage too big for one node is assumed spread evenly over the fewest nodes
    that hold it (``_assign_ranks`` places power-of-two groups so), for its ring's lanes
    (:func:`ring_link`)."""

    def __init__(self, cluster: ClusterSpec, num_devices: int) -> None:
        devices = cluster.devices()[:num_devices]
        per_node = sum(1 for d in cluster.devices() if d.node_index == devices[0].node_index)
        self.per_node = per_node
        intra = cluster.links.intra_node
        inter = cluster.links.inter_node
        self.intra = intra or inter
        self.inter = inter or intra
        self.p2p = self.intra if num_devices <= per_node else self.inter
        self.lanes_per_device = cluster.links.nics == "per-device"

    def within(self, d: int) -> Link | None:
        """The link a ring all-reduce over ``d`` devices runs at."""
        if d <= self.per_node:
            return self.intra
        lanes = d // -(-d // self.per_node) if self.lanes_per_device else 1
        return _ring_between_nodes(self.intra, self.inter, lanes)


def nic_route(
    cluster: ClusterSpec, src: list[str], dst: list[str]
) -> tuple[tuple[str, ...], tuple[str, ...], float]:
    """The network interfaces (``cluster.links.nics``) a micro-batch's activations cross from the
    replicas on devices ``src`` to those on ``dst``, and the largest share of its bytes through one.

    Replica ``i`` of ``p`` holds samples ``[i/p, (i+1)/p)`` of a micro-batch; the samples a replica
    pair has in common cross the network when the two devices are on different nodes (leaving
    through the sender's interface, entering through the receiver's) and NVLink otherwise.
    Returns ``((), (), 1.0)`` when no interface is crossed or the cluster names none.
    """
    if cluster.links.nics is None:
        return (), (), 1.0
    a = [cluster.device(d) for d in src]
    b = [cluster.device(d) for d in dst]
    out: dict[str, int] = {}
    into: dict[str, int] = {}
    for i, x in enumerate(a):  # in units of 1 / (len(a) * len(b)) of a micro-batch
        for j, y in enumerate(b):
            if x.node_index == y.node_index:
                continue
            common = min((i + 1) * len(b), (j + 1) * len(a)) - max(i * len(b), j * len(a))
            if common > 0:
                src_nic, dst_nic = nic_of(cluster, x), nic_of(cluster, y)
                out[src_nic] = out.get(src_nic, 0) + common
                into[dst_nic] = into.get(dst_nic, 0) + common
    if not out:
        return (), (), 1.0
    share = max(*out.values(), *into.values()) / (len(a) * len(b))
    return tuple(sorted(out)), tuple(sorted(into)), share


def ring_nics(cluster: ClusterSpec, devices: list[Device]) -> tuple[str, ...]:
    """The network interfaces (``cluster.links.nics``) a ring all-reduce over ``devices`` occupies.

    A ring over several nodes enters and leaves every node it spans, so it holds each node's
    interface (``per-node``) for its whole duration. With ``per-device`` interfaces the
    collective library spreads the ring's channels over every replica's interface (as NCCL does
    over a node's NICs), so it holds all of them. None inside one node or with ``nics`` unset.
    """
    if cluster.links.nics is None or len({d.node_index for d in devices}) < 2:
        return ()
    return tuple(sorted({nic_of(cluster, d) for d in devices}))


def nic_of(cluster: ClusterSpec, device: Device) -> str:
    """The name of ``device``'s network interface: its node's (``per-node``) or its own."""
    return device.node if cluster.links.nics == "per-node" else device.id


def ring_link(cluster: ClusterSpec, devices: list[Device]) -> Link | None:
    """The link a ring all-reduce over ``devices`` runs at (:func:`tessera.core.cost.allreduce_time`).

    Inside one node the intra-node link; over several nodes the inter-node link, which bounds
    the ring where it leaves a node. With ``per-device`` interfaces the collective library runs
    one ring channel through each replica's interface (NCCL spreads its channels over a node's
    NICs), so the ring crosses between nodes ``lanes`` times as fast — ``lanes`` the fewest
    replicas on any of its nodes — up to the intra-node link that every channel also crosses
    (NCCL's bus bandwidth: the node's NICs together, or NVLink, whichever is slower).
    ``None`` for one device."""
    if len(devices) < 2:
        return None
    per_node = Counter(d.node_index for d in devices)
    intra = cluster.links.intra_node or cluster.links.inter_node
    if len(per_node) == 1:
        return intra
    inter = cluster.links.inter_node or cluster.links.intra_node
    lanes = min(per_node.values()) if cluster.links.nics == "per-device" else 1
    return _ring_between_nodes(intra, inter, lanes)


def _ring_between_nodes(intra: Link | None, inter: Link | None, lanes: int) -> Link | None:
    if lanes <= 1 or inter is None:
        return inter
    bandwidth = lanes * inter.bandwidth
    if intra is not None:
        bandwidth = min(bandwidth, intra.bandwidth)
    return Link(bandwidth=bandwidth, latency=inter.latency)


def stage_edges(
    graph: Graph, tree: SPTree, unit_stage: dict[int, int], cost: CostModel
) -> list[PipelineEdge]:
    """Stage graph edges (C2): every operator edge between two stages, with its tensors."""
    crossing: dict[tuple[int, int], dict[str, float]] = {}
    floating: set[tuple[int, int]] = set()  # stage pairs a gradient comes back between
    for u, v, data in graph.dag.edges(data=True):
        su, sv = unit_stage[tree.unit_of[u]], unit_stage[tree.unit_of[v]]
        if su == sv:
            continue
        tensors = crossing.setdefault((su, sv), {})
        for t in data["tensors"]:
            tensors[t.name] = cost.wire_bytes(t.nbytes)
            if t.floating:
                floating.add((su, sv))
    edges = []
    for (su, sv), tensors in sorted(crossing.items()):
        items = sorted(tensors.items())
        edges.append(PipelineEdge(su, sv, items, sum(v for _, v in items), grads=(su, sv) in floating))
    return edges


def clip_time(cluster: ClusterSpec, ranks: list[str], max_grad_norm: float | None) -> float:
    """The gradient norm's all-reduce (one float64 over every rank of ``ranks``, device ids) when the
    run clips to a global norm; nothing on one rank."""
    if max_grad_norm is None or len(ranks) < 2:
        return 0.0
    return allreduce_time(8, len(ranks), ring_link(cluster, [cluster.device(d) for d in ranks]))
