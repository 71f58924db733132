"""Pipeline plans whose stages are tensor-parallel (``plan --tensor-parallel t``): every replica is
``t`` devices of one node running the split of :mod:`tessera.core.tensor_parallel`.

The search plans on a cluster of tensor-parallel groups (each node's devices of a type, ``t`` at a
time) with a cost model that charges a group's device: 1/t of the split operators' time, memory
and stored activations, plus the all-reduces the split adds on the node's link (a row product's
output forward, the gradient of a whole tensor entering a split chain backward). The plan then
names the groups' devices. Narrative: docs/gpp.md ("Tensor-parallel stages").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from tessera.core.cost import CostModel, allreduce_time
from tessera.core.errors import InputError
from tessera.core.graph import Graph, OpNode
from tessera.core.specs import ClusterSpec, Link
from tessera.core.tensor_parallel import TpSplit, tensor_parallel
from tessera.planners.pipeline.memory import split_memory

__all__ = ["TensorParallelCost", "group_cluster", "group_devices", "tensor_parallel_cost"]


@dataclass(frozen=True, eq=False)
class TensorParallelCost(CostModel):
    """A tensor-parallel group's device: the base model's costs with the split operators' share."""

    t: int = 1
    split: TpSplit | None = None  # the whole graph's (validate restricts it to each stage)
    split_nodes: frozenset[str] = frozenset()
    forward_reduce: Mapping[str, float] = field(default_factory=dict)  # node → bytes per sample
    backward_reduce: Mapping[str, float] = field(default_factory=dict)  # node → bytes per sample
    split_params: Mapping[str, int] = field(default_factory=dict)  # node → split elements it owns
    split_acts: Mapping[str, float] = field(default_factory=dict)  # node → split output bytes per sample
    link: Link | None = None

    def _share(self, op: OpNode, base: float) -> float:
        if op.name not in self.split_nodes or base <= 0:
            return base
        launch = self.device.kernel_launch_overhead
        return (base - launch) / self.t + launch

    def forward_time(self, op: OpNode, samples: float) -> float:
        base = self._share(op, super().forward_time(op, samples))
        extra = self.forward_reduce.get(op.name, 0.0) * samples
        return base + (allreduce_time(self.wire_bytes(extra), self.t, self.link) if extra else 0.0)

    def backward_time(self, op: OpNode, samples: float) -> float:
        base = self._share(op, super().backward_time(op, samples))
        extra = self.backward_reduce.get(op.name, 0.0) * samples
        return base + (allreduce_time(self.wire_bytes(extra), self.t, self.link) if extra else 0.0)

    def activation_bytes(self, graph: Graph, node: str) -> float:
        split = self.split_acts.get(node, 0.0) * self.memory.activation_scale
        return super().activation_bytes(graph, node) - split * (1 - 1 / self.t)

    def _params(self, op: OpNode) -> float:
        return op.params - self.split_params.get(op.name, 0) * (1 - 1 / self.t)

    def weight_bytes(self, op: OpNode) -> float:
        return self._params(op) * self.memory.weight_bytes_per_param

    def optimizer_bytes(self, op: OpNode) -> float:
        return self._params(op) * (
            self.memory.gradient_bytes_per_param + self.memory.optimizer_state_bytes_per_param
        )

    def gradient_bytes(self, op: OpNode) -> float:
        return self._params(op) * self.memory.gradient_bytes_per_param


def tensor_parallel_cost(base: CostModel, graph: Graph, t: int, link: Link | None) -> TensorParallelCost:
    """``base`` for a device of a ``t``-way tensor-parallel group whose all-reduces take ``link``."""
    split = tensor_parallel(graph, t)
    forward: dict[str, float] = {}
    backward: dict[str, float] = {}
    for region in split.regions:
        for n in region.rows:
            forward[n] = float(graph.tensors[graph.op(n).outputs[0]].nbytes)
        first: dict[str, str] = {}  # a copied tensor's all-reduce, charged to its first reader
        for n, k in region.operands:
            tensor = graph.op(n).inputs[k]
            if tensor in region.copied and tensor not in first:
                first[tensor] = n
                backward[n] = backward.get(n, 0.0) + graph.tensors[tensor].nbytes
    params, acts = split_memory(graph, split)
    return TensorParallelCost(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(CostModel)},
        t=t,
        split=split,
        split_nodes=split.nodes,
        forward_reduce=forward,
        backward_reduce=backward,
        split_params=params,
        split_acts=acts,
        link=link,
    )


def group_cluster(cluster: ClusterSpec, t: int) -> ClusterSpec:
    """``cluster`` with each node's devices of a type grouped ``t`` at a time: one device per
    tensor-parallel group (its id the group's first device's slot over ``t``, :func:`group_devices`)."""
    data = cluster.model_dump(mode="json")
    for group in data["nodes"]:
        for slot in group["devices"]:
            if slot["count"] % t:
                raise InputError(
                    f"--tensor-parallel {t}: node {group['name']!r} has {slot['count']} {slot['type']} "
                    f"device(s), not groups of {t} (a tensor-parallel group is on one node)"
                )
            slot["count"] //= t
    return ClusterSpec.model_validate(data)


def group_devices(grouped: list[str], t: int) -> list[str]:
    """The devices of the groups ``grouped`` (ids of :func:`group_cluster`'s cluster), group by group."""
    out = []
    for device in grouped:
        prefix, k = device.rsplit(":", 1)
        out.extend(f"{prefix}:{int(k) * t + i}" for i in range(t))
    return out
