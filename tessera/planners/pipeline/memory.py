"""Per-device memory of a pipeline stage: GraphPipe's memory constraint (thesis Eq. 3.2).

    DeviceMemoryUsage(S_i) = weights + gradients + optimizer state + activations ≤ M

- weights, gradients and optimizer state: every data-parallel replica holds all of the stage's
  parameters (``CostModel.memory``: by default 16 bytes/parameter, Adam with mixed precision);
- activations: the tensors the stage saves for its backward pass (its operators' activation
  outputs from the IR, per sample, at the stored precision) × the samples a replica holds per
  micro-batch (``ceil(b / d)``) × the in-flight micro-batches its schedule implies (Table 3.2);
- with recomputation (activation checkpointing) a stage keeps only its input activations per
  in-flight micro-batch, plus the full activations of the one micro-batch being recomputed.

In the plan, ``memory.weights`` is the weights and ``memory.optimizer`` the gradients plus the
optimizer state.
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
