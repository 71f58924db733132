"""The cost model: time and memory of every operator, and of communication.

Operator times default to a roofline of the device spec (forward ``max(flops/peak, bytes/bandwidth)`` plus
a launch; backward 2× for operators with weights, 1× otherwise); a transfer is ``latency + n/bandwidth``,
a ring all-reduce ``2(p−1)/p · n/bandwidth + 2(p−1) · latency``; training memory is Adam in mixed
precision, 16 bytes per parameter (thesis Eq. 3.2). A :class:`CostModel` with ``measured`` set takes
measured operator times first and falls back to the roofline; memory stays analytical.

References: GraphPipe thesis §3.5; FlexFlow's simulator, thesis-jia §3.4. Formulas: docs/core.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

from tessera.core.graph import Graph, OpNode
from tessera.core.specs import DeviceType, Link

Precision = Literal["mixed", "fp32"]


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes kept per parameter during training, and the scale of stored activations.

    ``weights`` is the copy the forward pass reads; ``optimizer`` is everything else a parameter
    costs (its gradient and the optimizer state: fp32 master copy, Adam m and v).
    """

    weight_bytes_per_param: float = 2.0
    gradient_bytes_per_param: float = 2.0
    optimizer_state_bytes_per_param: float = 12.0
    activation_scale: float = 0.5  # stored activation bytes / the IR's (fp32) bytes

    @classmethod
    def adam(cls, precision: Precision = "mixed") -> TrainingMemory:
        """Adam: mixed precision 2 + 2 + 12 = 16 B/param; fp32 4 + 4 + 8 (m, v) = 16 B/param."""
        if precision == "mixed":
            return cls(2.0, 2.0, 12.0, 0.5)
        return cls(4.0, 4.0, 8.0, 1.0)

    @property
    def bytes_per_param(self) -> float:
        return (
            self.weight_bytes_per_param + self.gradient_bytes_per_param + self.optimizer_state_bytes_per_param
        )


class OpTimes(Protocol):
    """Measured operator times: ``(forward_s, backward_s)`` of ``op`` on ``samples`` samples, or
    None where there is no measurement (the cost model then uses the roofline)."""

    def times(self, op: OpNode, samples: float) -> tuple[float, float] | None: ...


@dataclass(frozen=True)
class CostModel:
    """Operator costs on one device type at one precision: the roofline, or measured operator times
    where ``measured`` has them (see the module docstring)."""

    device: DeviceType
    precision: Precision = "mixed"
    memory: TrainingMemory = TrainingMemory()
    measured: OpTimes | None = None

    @classmethod
    def for_device(
        cls,
        device: DeviceType,
        precision: Precision = "mixed",
        bytes_per_param: float | None = None,
        measured: OpTimes | None = None,
    ) -> CostModel:
        """The model for ``device``; ``bytes_per_param`` overrides the optimizer-state total (16);
        ``measured``: operator times to take instead of the roofline's where it has them."""
        memory = TrainingMemory.adam(precision)
        if bytes_per_param is not None:
            extra = bytes_per_param - memory.weight_bytes_per_param - memory.gradient_bytes_per_param
            if extra < 0:
                raise ValueError(
                    f"{bytes_per_param:g} bytes per parameter is below what its weight and gradient take "
                    f"({memory.weight_bytes_per_param + memory.gradient_bytes_per_param:g} at {precision} precision)"
                )
            memory = TrainingMemory(
                memory.weight_bytes_per_param, memory.gradient_bytes_per_param, extra, memory.activation_scale
            )
        return cls(device=device, precision=precision, memory=memory, measured=measured)

    @property
    def peak_flops(self) -> float:
        return self.device.peak_flops("fp16" if self.precision == "mixed" else "fp32")

    def _scaled_bytes(self, op: OpNode, samples: float) -> float:
        activation = max(op.bytes_moved - op.param_bytes, 0)
        weight_scale = self.memory.weight_bytes_per_param / 4.0
        return op.param_bytes * weight_scale + activation * self.memory.activation_scale * samples

    def forward_time(self, op: OpNode, samples: float) -> float:
        """Seconds for the forward pass of ``op`` on ``samples`` samples (measured, else roofline)."""
        if samples <= 0:
            return 0.0
        if self.measured is not None:
            got = self.measured.times(op, samples)
            if got is not None:
                return got[0]
        compute = op.flops * samples / self.peak_flops
        memory = self._scaled_bytes(op, samples) / self.device.memory_bandwidth
        return max(compute, memory) + self.device.kernel_launch_overhead

    def backward_time(self, op: OpNode, samples: float) -> float:
        """Seconds for the backward pass: measured, else 2× the forward work with weights, 1× without."""
        if samples <= 0:
            return 0.0
        if self.measured is not None:
            got = self.measured.times(op, samples)
            if got is not None:
                return got[1]
        r = backward_ratio(op)
        compute = r * op.flops * samples / self.peak_flops
        memory = r * self._scaled_bytes(op, samples) / self.device.memory_bandwidth
        return max(compute, memory) + self.device.kernel_launch_overhead

    def activation_bytes(self, graph: Graph, node: str) -> float:
        """Bytes per sample that ``node`` saves for its backward pass: its activation outputs."""
        total = 0
        for t in graph.op(node).outputs:
            info = graph.tensors.get(t)
            if t and info is not None and t not in graph.initializers:
                total += info.nbytes
        return total * self.memory.activation_scale

    def memory_of(self, graph: Graph, nodes: Iterable[str]) -> tuple[float, float, float]:
        """Eq. 3.2's parts for operators ``nodes`` on one replica: weight bytes, gradient +
        optimizer-state bytes, and the activation bytes per sample they save (operators that
        compute constants save none)."""
        ops = [graph.op(n) for n in nodes]
        return (
            sum(self.weight_bytes(op) for op in ops),
            sum(self.optimizer_bytes(op) for op in ops),
            sum(self.activation_bytes(graph, op.name) for op in ops if op.name not in graph.constant_nodes),
        )

    def weight_bytes(self, op: OpNode) -> float:
        return op.params * self.memory.weight_bytes_per_param

    def optimizer_bytes(self, op: OpNode) -> float:
        """Gradient + optimizer state of ``op``'s parameters."""
        return op.params * (
            self.memory.gradient_bytes_per_param + self.memory.optimizer_state_bytes_per_param
        )

    def gradient_bytes(self, op: OpNode) -> float:
        return op.params * self.memory.gradient_bytes_per_param

    def wire_bytes(self, ir_bytes: float) -> float:
        """Bytes an activation of ``ir_bytes`` (fp32 in the IR) takes on the wire at this precision."""
        return ir_bytes * self.memory.activation_scale


def backward_ratio(op: OpNode) -> float:
    """Backward/forward work ratio: 2 for operators with weights, 1 otherwise (module docstring)."""
    return 2.0 if op.params > 0 else 1.0


def transfer_time(link: Link, nbytes: float) -> float:
    """Seconds to move ``nbytes`` over ``link`` (latency + bytes / bandwidth); 0 for nothing."""
    return link.transfer_time(nbytes) if nbytes > 0 else 0.0


def allreduce_time(nbytes: float, devices: int, link: Link | None) -> float:
    """Ring all-reduce: 2(p−1)/p · n / bandwidth + 2(p−1) · latency, at the link's all-reduce
    bandwidth and latency where it has them (else its point-to-point ones), or the link's measured
    curve for its rank count; plus the link's ``allreduce_overhead``. 0 for one device."""
    if devices <= 1 or nbytes <= 0 or link is None:
        return 0.0
    curve = link.allreduce_curve
    if curve and devices == link.allreduce_ranks and curve[0][0] <= nbytes <= curve[-1][0]:
        return _log_log(curve, nbytes) + link.allreduce_overhead
    p = devices
    bandwidth = link.allreduce_bandwidth or link.bandwidth
    latency = link.latency if link.allreduce_latency is None else link.allreduce_latency
    return 2 * (p - 1) / p * nbytes / bandwidth + 2 * (p - 1) * latency + link.allreduce_overhead


def sharded_sync_time(nbytes: float, devices: int, link: Link | None) -> float:
    """A ZeRO-1 step's collectives (reduce-scatter of ``nbytes`` of gradients, all-gather of the
    updated shards): the link's measured ``zero_sync_curve`` for its rank count, beyond the curve
    its end's ratio to the all-reduce; without one, an all-reduce's time (a ring's pair moves the
    same bytes). 0 for one device."""
    ring = allreduce_time(nbytes, devices, link)
    curve = link.zero_sync_curve if link is not None else None
    if not ring or not curve or devices != link.allreduce_ranks:  # type: ignore[union-attr]
        return ring
    if curve[0][0] <= nbytes <= curve[-1][0]:
        return _log_log(curve, nbytes) + link.allreduce_overhead  # type: ignore[union-attr]
    size, seconds = curve[0] if nbytes < curve[0][0] else curve[-1]
    return ring * (seconds + link.allreduce_overhead) / allreduce_time(size, devices, link)  # type: ignore[union-attr]


def _log_log(points: list[tuple[int, float]], x: float) -> float:
    """``points`` (increasing x) joined by straight lines on log-log axes, at ``x`` within them."""
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    return points[-1][1]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def per_device_samples(micro_batch: int, devices: int) -> int:
    """Samples each data-parallel replica of a stage processes for one micro-batch (ceil split)."""
    return max(1, math.ceil(micro_batch / devices))
