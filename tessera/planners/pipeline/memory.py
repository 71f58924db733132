"""Per-device memory of a pipeline stage: weights, gradients and optimizer state plus the activations
of its in-flight micro-batches (with recomputation: their inputs).

References: GraphPipe thesis Eq. 3.2; BPipe (Kim's thesis ch. 4) for the activation formulas;
ZeRO (Rajbhandari et al., SC'20) stage 1 for sharded optimizer state; Megatron-LM (Shoeybi et al.,
2019) for tensor-parallel shards.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from tessera.core.cost import per_device_samples
from tessera.core.graph import Graph
from tessera.core.tensor_parallel import TpSplit


@dataclass(frozen=True)
class StageMemoryEstimate:
    weights: int
    optimizer: int
    activations: int

    @property
    def peak(self) -> int:
        return self.weights + self.optimizer + self.activations


ZERO_CHOICES = (0, 1, "auto")  # plan --zero: no stage, every replicated stage, where memory needs it


def sharded_optimizer(optimizer: float, state: float, devices: int, zero: int) -> float:
    """The gradient and optimizer-state bytes one replica of a stage keeps: ``optimizer`` (all of
    them), less with ZeRO-1 (``zero`` 1, ``devices`` > 1 replicas) the share of ``state`` (the
    optimizer state of its sharded weights) the other ``devices − 1`` replicas keep instead."""
    if zero and devices > 1:
        return optimizer - state * (devices - 1) / devices
    return optimizer


def activation_bytes(
    *,
    activation_per_sample: float,
    input_per_sample: float,
    micro_batch: int,
    devices: int,
    in_flight: int,
    recompute: bool = False,
) -> int:
    """Activation bytes one replica of a stage holds with ``in_flight`` micro-batches in flight."""
    s = per_device_samples(micro_batch, devices)
    if recompute:
        return int(in_flight * s * input_per_sample + s * activation_per_sample)
    return int(in_flight * s * activation_per_sample)


def stage_memory(
    *,
    weights: float,
    optimizer: float,
    activation_per_sample: float,
    input_per_sample: float,
    micro_batch: int,
    devices: int,
    in_flight: int,
    recompute: bool = False,
) -> StageMemoryEstimate:
    """Eq. 3.2 for one device of a stage (see the module docstring)."""
    return StageMemoryEstimate(
        weights=int(weights),
        optimizer=int(optimizer),
        activations=activation_bytes(
            activation_per_sample=activation_per_sample,
            input_per_sample=input_per_sample,
            micro_batch=micro_batch,
            devices=devices,
            in_flight=in_flight,
            recompute=recompute,
        ),
    )


def max_in_flight(
    *,
    limit: float,
    weights: float,
    optimizer: float,
    activation_per_sample: float,
    input_per_sample: float,
    micro_batch: int,
    devices: int,
    recompute: bool = False,
) -> int:
    """The most in-flight micro-batches that fit ``limit`` bytes (−1 when not even the weights fit)."""
    if math.isinf(limit):
        return 1 << 30
    s = per_device_samples(micro_batch, devices)
    free = limit - weights - optimizer
    if recompute:
        free -= s * activation_per_sample
        per = s * input_per_sample
    else:
        per = s * activation_per_sample
    if free < 0:
        return -1
    if per <= 0:
        return 1 << 30
    return int(free // per)


def split_memory(graph: Graph, split: TpSplit) -> tuple[dict[str, int], dict[str, float]]:
    """Per operator, what the tensor-parallel ``split`` divides among its ranks (each keeps 1/t):
    the split parameter elements it is charged for (``Graph.param_owner``) and the split activation
    bytes per sample it makes."""
    params: dict[str, int] = {}
    acts: dict[str, float] = {}
    for w in split.weights:
        owner = graph.param_owner.get(w)
        if owner is not None:
            params[owner] = params.get(owner, 0) + graph.initializers[w].numel
    for region in split.regions:
        for tensor in region.split:
            producer = graph.producer.get(tensor)
            if producer is not None:
                acts[producer] = acts.get(producer, 0.0) + graph.tensors[tensor].nbytes
    return params, acts


def tensor_parallel_share(graph: Graph, nodes: Iterable[str], split: TpSplit) -> tuple[int, float]:
    """:func:`split_memory` summed over a stage's operators ``nodes``: the regions of ``split`` (the
    whole graph's) lying wholly inside them."""
    params, acts = split_memory(graph, split.restrict(nodes))
    return sum(params.values()), sum(acts.values())
