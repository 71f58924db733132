"""What a pipeline search produces: its options, stages, edges and the pipeline itself
(GraphPipe thesis §3.3; the plan JSON is made from a :class:`Pipeline`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import networkx as nx

from tessera.core.schedule import ScheduleChoice, ScheduleKind
from tessera.core.specs import Link
from tessera.planners.pipeline.memory import StageMemoryEstimate

# Activation recomputation: on no stage, on every stage, or (``auto``) on the stages the search
# finds it pays on — where keeping the activations does not fit memory (:class:`~.dp.StageDP`).
RecomputeChoice = Literal["never", "auto", "all"]
# ZeRO-1 (optimizer state sharded over a stage's data-parallel replicas): on no stage (0), on every
# replicated stage (1), or (``auto``) on the replicated stages whose memory needs it.
ZeroChoice = Literal[0, 1, "auto"]


@dataclass(frozen=True)
class PartitionOptions:
    mini_batch: int
    num_devices: int | None = None  # default: every device of the cluster
    memory_limit: float | None = None  # bytes per device; default: the device's memory
    schedule: ScheduleChoice = "1f1b"
    k: int = 1  # kFkB's k
    micro_batch_sizes: tuple[int, ...] | None = None  # default: powers of two dividing mini_batch
    max_micro_batches: int = 256
    recompute: RecomputeChoice = "never"
    zero: ZeroChoice = 0
    tensor_parallel: int = 1  # every stage's replicas are groups of this many devices of a node; 0: auto
    stages: int | None = None  # exactly this many stages (plan --stages); None: the search's choice
    max_units: int = 128
    epsilon: float = 0.01
    precision: Literal["mixed", "fp32"] = "mixed"
    bytes_per_param: float | None = None
    optimizer: str = "sgd"  # whose step measured stages are timed with (plan --optimizer)
    loss: str = "mse"  # the loss they are timed with (plan --loss)
    # The global gradient norm they clip to (plan --max-grad-norm): the norm's pass is in measured
    # stages' step, its all-reduce over every rank in the pipeline's ``clip_time``.
    max_grad_norm: float | None = None

    @property
    def searched_schedule(self) -> ScheduleKind:
        """The schedule the search materializes its candidates with (``auto`` searches as 1F1B)."""
        return "1f1b" if self.schedule == "auto" else self.schedule


@dataclass
class PipelineStage:
    id: int
    nodes: list[str]
    devices: list[str]
    micro_batch_size: int
    in_flight: int  # micro-batches
    forward_time: float  # per micro-batch (one replica's share)
    backward_time: float
    allreduce_time: float  # per iteration
    weights: float
    optimizer: float
    activation_per_sample: float
    input_per_sample: float
    schedule: list[str] = field(default_factory=list)
    memory: StageMemoryEstimate | None = None
    units: tuple[int, int] = (0, 0)
    # The network interfaces the stage's gradient all-reduce crosses (:func:`ring_nics`); none
    # inside a node or when the cluster names no shared interfaces.
    allreduce_nics: tuple[str, ...] = ()
    # Activation recomputation: the stage keeps only its inputs per micro-batch in flight and runs
    # its forward again in the backward (counted in ``backward_time``).
    recompute: bool = False
    # ZeRO-1: the optimizer state of ``state`` bytes (that of the stage's own weights, tied copies
    # apart) is sharded over the stage's replicas (tessera.planners.pipeline.memory.sharded_optimizer).
    zero: int = 0
    state: float = 0.0
    # What ZeRO-1's reduce-scatter and all-gather cost beyond the ring all-reduce of the same
    # gradients (core.cost.sharded_sync_time), in ``allreduce_time`` while ``zero`` is 1.
    zero_sync_extra: float = 0.0
    # The optimizer step and drawing the data, per iteration (measured stages only:
    # tessera.planners.pipeline.stage_profile); the simulator runs it after the all-reduce.
    step_time: float = 0.0
    # The executor's own time per F or B beyond compute and messages (measured stages only: the
    # device type's ``action_overhead``); the simulator charges it on the stage's device.
    action_overhead: float = 0.0

    @property
    def time_per_sample(self) -> float:
        return (self.forward_time + self.backward_time) / self.micro_batch_size


@dataclass
class PipelineEdge:
    src: int
    dst: int
    tensors: list[tuple[str, float]]  # (name, wire bytes per sample)
    bytes_per_sample: float
    link: Link | None = None
    # Network interfaces (named by node or by device) the activations leave / enter through (none:
    # inside a node, or no shared interfaces), and the largest share of a micro-batch's bytes
    # through one of them (:func:`nic_route`).
    src_nics: tuple[str, ...] = ()
    dst_nics: tuple[str, ...] = ()
    nic_share: float = 1.0
    # False: no tensor over it is floating (shapes, ids, masks), so no gradient comes back over it
    # (the stage workers send a gradient only for a floating tensor).
    grads: bool = True


@dataclass
class Pipeline:
    """A partitioned, scheduled pipeline: what the plan JSON is written from."""

    kind: Literal["gpp", "spp"]
    mini_batch_size: int
    micro_batch_size: int
    schedule_kind: ScheduleKind
    k: int
    stages: list[PipelineStage]
    edges: list[PipelineEdge]
    bottleneck_tps: float
    estimated_iteration_time: float
    search_time_s: float
    num_units: int
    memory_limit: float
    probes: int = 0
    zero: ZeroChoice = 0  # the search's --zero: "auto" decides each stage's ``zero`` as it schedules
    # The gradient norm's all-reduce over every rank (launch --max-grad-norm): each stage's optimizer
    # step waits for the last stage's backward and this (:func:`tessera.planners.sim.simulate_pipeline`).
    clip_time: float = 0.0

    @property
    def pipeline_depth(self) -> int:
        g = nx.DiGraph()
        g.add_nodes_from(s.id for s in self.stages)
        g.add_edges_from((e.src, e.dst) for e in self.edges)
        return nx.dag_longest_path_length(g) + 1

    @property
    def num_micro_batches(self) -> int:
        return self.mini_batch_size // self.micro_batch_size


def peak_memory(pipe: Pipeline) -> float:
    """The largest per-device memory of ``pipe``'s stages."""
    return float(max(s.memory.peak for s in pipe.stages if s.memory))
