"""Per-device memory of a pipeline stage: weights, gradients and optimizer state plus the activations
of its in-flight micro-batches (with recomputation: their inputs).

References: GraphPipe thesis Eq. 3.2; BPipe (Kim's thesis ch. 4) for the activation formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.core.cost import per_device_samples


@dataclass(frozen=True)
class StageMemoryEstimate:
    weights: int
    optimizer: int
    activations: int

    @property
    def peak(self) -> int:
        return self.weights + self.optimizer + self.activations


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
