"""Cluster and device specs: the typed, validated form of a cluster YAML file.

:func:`load_cluster` reads a file or a preset from ``configs/clusters/`` (format: ``configs/README.md``;
quantities: :mod:`tessera.core.units`) and raises :class:`~tessera.core.errors.InputError` naming the file
and the field path for every problem. A :class:`ClusterSpec` resolves to the :class:`Device` list the
planners place work on; device ids read ``{node}{i}/{type}:{k}`` (e.g. ``node1/a100-80g:3``), depend only
on the spec, and are stored in plans. Details: docs/core.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tessera.core import config_files
from tessera.core.errors import InputError
from tessera.core.units import UnitError, parse_bandwidth, parse_bytes, parse_flops, parse_seconds

__all__ = [
    "DTYPES",
    "DEFAULT_KERNEL_LAUNCH_OVERHEAD",
    "MAX_DEVICES",
    "ClusterSpec",
    "Device",
    "DeviceSlot",
    "DeviceType",
    "Link",
    "Links",
    "NodeGroup",
    "list_presets",
    "load_cluster",
    "parse_cluster",
    "presets_dir",
]

# The data types a device may list a peak rate for, in the order plans print them.
DTYPES: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")

# Fixed cost of starting one kernel (GPU) or one operator (CPU), added by the cost model per operator.
# GPU: a CUDA kernel launch costs a few microseconds from the host; 5 us is the usual figure for a
# launch plus the framework's dispatch. CPU: an ONNX Runtime operator dispatch costs about 1 us.
DEFAULT_KERNEL_LAUNCH_OVERHEAD: dict[str, float] = {"gpu": 5e-6, "cpu": 1e-6}

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

MAX_DEVICES = 2**16
"""The most devices a cluster spec may hold (65,536), counting every node of every group: each is
resolved into a :class:`Device` and planners iterate over them, so a typo such as ``count:
100000000`` is refused at once instead of hanging ``plan``. It also bounds every ``count``."""


# ---------------------------------------------------------------------------------------------------
# Field types


def _unit(parse: Callable[..., Any], *, allow_zero: bool) -> BeforeValidator:
    def validate(value: object) -> Any:
        try:
            return parse(value, allow_zero=allow_zero)
        except UnitError as err:
            raise ValueError(err.detail) from None
        except OverflowError:  # an integer beyond any float
            raise ValueError(f"a number of {len(str(value))} digits is not a finite quantity") from None

    return BeforeValidator(validate)


def _check_name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(
            f"expected a name of letters, digits, '_', '-' and '.' (no spaces, '/' or ':'); got {value!r}"
        )
    return value


def _within(low: float, high: float, unit: str) -> AfterValidator:
    def check(value: float) -> float:
        if not low <= value <= high:
            raise ValueError(
                f"{value:g} {unit} is outside {low:g}..{high:g} {unit}, the range tessera computes with"
            )
        return value

    return AfterValidator(check)


# Far beyond any device, both ways (a planner must still plan an absurdly slow device), but such
# that the times planners divide out of these stay finite floats: a rate of 5e-324 FLOP/s (a
# subnormal) made every cp prediction infinite, and an int beyond 1.8e308 bytes cannot be a float.
_RANGE = (1e-250, 1e250)
Bytes = Annotated[int, _unit(parse_bytes, allow_zero=False), _within(1, _RANGE[1], "bytes")]
Bandwidth = Annotated[float, _unit(parse_bandwidth, allow_zero=False), _within(*_RANGE, "bytes/s")]
FlopRate = Annotated[float, _unit(parse_flops, allow_zero=False), _within(*_RANGE, "FLOP/s")]
Seconds = Annotated[float, _unit(parse_seconds, allow_zero=True), _within(0, _RANGE[1], "s")]


def _within_max_devices(value: int) -> int:
    if value > MAX_DEVICES:
        raise ValueError(f"{value:,} is more than the {MAX_DEVICES:,} devices a cluster may hold in all")
    return value


Count = Annotated[int, Field(strict=True, ge=1, le=MAX_DEVICES)]  # cores of a cpu device
# How many nodes or devices: each at most MAX_DEVICES (the total is checked on the spec).
DeviceCount = Annotated[int, Field(strict=True, ge=1), AfterValidator(_within_max_devices)]
Name = Annotated[str, Field(strict=True), AfterValidator(_check_name)]


class _SpecModel(config_files.ConfigModel):
    """Frozen, with unknown fields rejected by name (so a typo such as ``memroy`` is caught)."""


# ---------------------------------------------------------------------------------------------------
# The spec


def _node_instance(group: str, index: int) -> str:
    """The name of the ``index``-th node of a group: ``node0``, or ``rack1-0`` if the name ends in a digit."""
    return f"{group}-{index}" if group[-1].isdigit() else f"{group}{index}"


class DeviceType(_SpecModel):
    """One kind of device: its memory, its peak FLOP rate per data type, its memory bandwidth."""

    kind: Literal["gpu", "cpu"]
    name: str | None = None
    """A description for people, e.g. ``NVIDIA A100-SXM4-80GB``."""
    memory: Bytes
    flops: dict[str, FlopRate]
    """Peak (dense) FLOP/s per data type; ``fp32`` is required, the others optional."""
    memory_bandwidth: Bandwidth
    kernel_launch_overhead: Seconds = Field(
        default_factory=lambda data: DEFAULT_KERNEL_LAUNCH_OVERHEAD.get(data.get("kind"), 5e-6)
    )
    cores: Count | None = None
    """CPU devices only: the cores the device's FLOP rate counts (the threads a worker should use)."""
    action_overhead: Seconds = 0.0
    """The training executor's own time per forward or backward of a stage, beyond the stage's
    compute and its messages (its bookkeeping; ``tessera calibrate`` measures it)."""
    contention_overhead: Seconds = 0.0
    """The compute a forward or backward adds while other ranks of a plan compute on the same node
    (shared caches, memory bandwidth and cores; ``tessera calibrate`` measures it on CPU ranks)."""
    decode_op_overhead: Seconds | None = None
    """Host time of one operation of a traced decode step (its dispatch and a small kernel; ``tessera
    calibrate`` measures it on CPU ranks); the cp cost model charges it per operation of the
    plan's decode step. None: ``kernel_launch_overhead``."""
    decode_compiled_op_overhead: Seconds | None = None
    """The same, of the step compiled by torch.compile's inductor (``launch --compile``; ``tessera
    calibrate`` measures it on CPU ranks): charged per operation of the traced step by plans made
    with ``--compile``. None: ``decode_op_overhead``."""
    decode_exchange_overhead: Seconds | None = None
    """One exchange of a decode step between ranks of one host (tessera's shared-memory all-gather,
    the wait for the later rank included, while both compute; ``tessera calibrate`` measures it on
    CPU ranks): what a tp or cp launch's collective costs there, plus its bytes at the memory
    bandwidth. None: the intra-node link's collective."""
    decode_rank_skew: float = Field(default=0.0, ge=0.0, le=10.0)
    """Ranks of one host that exchange once a layer run in step with the slowest: a tp or cp decode
    step's own work takes this fraction longer than on one rank (``tessera calibrate`` measures it
    on CPU ranks, beside ``decode_exchange_overhead``)."""
    replica_contention: float = Field(default=0.0, ge=0.0, le=10.0)
    """Replicas of one data-parallel stage on the same node run the same operators at the same
    moment: each forward and backward takes this fraction longer than on one rank alone (instead of
    ``contention_overhead``; ``tessera calibrate`` measures it on CPU ranks)."""

    @field_validator("flops", mode="before")
    @classmethod
    def _known_dtypes(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            for key in value:
                if key not in DTYPES:
                    raise ValueError(f"unknown data type {key!r}: expected keys among {', '.join(DTYPES)}")
            if "fp32" not in value:
                raise ValueError("an fp32 rate is required (the rate planners fall back to)")
        return value

    @model_validator(mode="after")
    def _cores_on_cpu_only(self) -> DeviceType:
        if self.cores is not None and self.kind != "cpu":
            raise ValueError(f"cores applies to cpu devices only; this device type is a {self.kind}")
        return self

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``, falling back to the fp32 rate when the spec gives none for it."""
        return self.flops.get(dtype, self.flops["fp32"])


class DeviceSlot(_SpecModel):
    """``count`` devices of device type ``type`` in every instance of a node group."""

    type: Name
    count: DeviceCount = 1


class NodeGroup(_SpecModel):
    """``count`` identical nodes (machines), named ``{name}0``, ``{name}1``, … (``{name}-0`` … if
    the name ends in a digit)."""

    name: Name
    count: DeviceCount = 1
    devices: list[DeviceSlot] = Field(min_length=1, max_length=MAX_DEVICES)


class Link(_SpecModel):
    """A link between two devices: bandwidth per direction (bytes/s) and latency (s); optionally
    the alpha-beta of one step of the collective library's ring all-reduce over it, where that is
    not the point-to-point one (gloo's all-reduce on a CPU host: ``tessera calibrate`` fits both),
    and LogP's *o* at each end, the seconds of its own time a device spends on a message:
    ``overhead`` the sender's, after the computation that sends it, ``receive_overhead`` the
    receiver's, before the one that takes it (a sender's is the larger: it packs the message and
    hands it to the library; docs/executor.md, "Calibrating this machine")."""

    bandwidth: Bandwidth
    latency: Seconds = 0.0
    overhead: Seconds = 0.0
    receive_overhead: Seconds = 0.0
    allreduce_bandwidth: Bandwidth | None = None
    allreduce_latency: Seconds | None = None
    allreduce_overhead: Seconds = 0.0
    """Seconds an all-reduce costs beyond the curve or the fit when a training step calls it
    (``tessera calibrate`` measures it in a data-parallel launch of the stage workers)."""
    allreduce_ranks: Count | None = None
    allreduce_curve: list[tuple[Bytes, Seconds]] | None = None
    """Measured all-reduces over ``allreduce_ranks`` ranks, ``[bytes, seconds]`` by increasing
    size: a collective library's time is not one alpha-beta line (gloo switches algorithm with
    the size), so ``core.cost.allreduce_time`` interpolates between these (log-log) for that many
    ranks, and uses the alpha-beta fit beyond them and for other counts."""

    zero_sync_curve: list[tuple[Bytes, Seconds]] | None = None
    """Measured ZeRO-1 steps' collectives over ``allreduce_ranks`` ranks: a flat buffer's
    reduce-scatter then the all-gather of its shards, ``[bytes, seconds]`` by increasing size.
    A ring's pair moves an all-reduce's bytes, but a library may run it slower (gloo: up to 3x);
    ``core.cost.sharded_sync_time`` reads it (without it, a ZeRO-1 stage pays the all-reduce)."""

    @model_validator(mode="after")
    def _curve_increasing(self) -> Link:
        for name in ("allreduce_curve", "zero_sync_curve"):
            curve = getattr(self, name)
            if curve is None:
                continue
            if self.allreduce_ranks is None or len(curve) < 2:
                raise ValueError(f"{name} needs allreduce_ranks and at least two points")
            if any(b[0] <= a[0] or b[1] <= 0 or a[1] <= 0 for a, b in zip(curve, curve[1:], strict=False)):
                raise ValueError(f"{name}: sizes must increase and times be positive")
        return self

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` over the link: latency + size / bandwidth (the alpha-beta model)."""
        return self.latency + nbytes / self.bandwidth


class Links(_SpecModel):
    """The link between two devices of one node, and between devices of different nodes.

    ``intra_node`` is required when a node holds more than one device, ``inter_node`` when the
    cluster has more than one node.

    ``nics``: which transfers between nodes share a network interface (each direction a FIFO,
    ``inter_node``'s bandwidth): ``per-node``, one interface per node that all its devices use;
    ``per-device``, one per device (GPUDirect RDMA with a NIC per GPU, as in DGX systems), and a
    ring all-reduce between nodes runs through all its replicas' interfaces at once. Unset,
    every pair of communicating pipeline stages has an inter-node link of its own: no contention
    between the transfers of different stage pairs (optimistic where several stages on one node
    talk to other nodes at once).
    """

    intra_node: Link | None = None
    inter_node: Link | None = None
    nics: Literal["per-node", "per-device"] | None = None


@dataclass(frozen=True)
class Device:
    """One device of a cluster, resolved from the spec."""

    id: str
    """Stable id, ``{node}/{type}:{k}`` (e.g. ``node1/a100-80g:3``)."""
    rank: int
    """Index in :meth:`ClusterSpec.devices` (node by node, in spec order)."""
    node: str
    """The node instance: ``{group name}{i}`` (e.g. ``node1``; ``rack1-0`` for a name ending in a digit)."""
    node_index: int
    """Index of the node instance in the cluster (across all node groups)."""
    local_rank: int
    """Index of the device within its node instance."""
    type_name: str
    type: DeviceType = field(compare=False, repr=False)


class ClusterSpec(_SpecModel):
    """A cluster: named device types, groups of identical nodes holding devices, and the links."""

    name: Name
    device_types: dict[Name, DeviceType] = Field(min_length=1, max_length=MAX_DEVICES)
    nodes: list[NodeGroup] = Field(min_length=1, max_length=MAX_DEVICES)
    links: Links = Field(default_factory=Links)

    @model_validator(mode="after")
    def _consistent(self) -> ClusterSpec:
        # Errors raised here have no location of their own, so each message starts with its path.
        group_names: set[str] = set()
        for g, group in enumerate(self.nodes):
            if group.name in group_names:
                raise ValueError(f"nodes[{g}].name: duplicate node name {group.name!r}")
            group_names.add(group.name)
            seen: set[str] = set()
            for s, slot in enumerate(group.devices):
                path = f"nodes[{g}].devices[{s}].type"
                if slot.type not in self.device_types:
                    known = ", ".join(self.device_types)
                    raise ValueError(
                        f"{path}: unknown device type {slot.type!r} (device_types defines: {known})"
                    )
                if slot.type in seen:
                    raise ValueError(f"{path}: device type {slot.type!r} is listed twice in this node")
                seen.add(slot.type)
        total = sum(group.count * sum(slot.count for slot in group.devices) for group in self.nodes)
        if total > MAX_DEVICES:
            largest = max(
                range(len(self.nodes)),
                key=lambda g: self.nodes[g].count * sum(s.count for s in self.nodes[g].devices),
            )
            group = self.nodes[largest]
            raise ValueError(
                f"nodes[{largest}].count: the cluster has {total:,} devices in all ({group.count:,} "
                f"node(s) x {sum(s.count for s in group.devices):,} device(s) in nodes[{largest}]); "
                f"tessera plans for at most {MAX_DEVICES:,}"
            )
        instances: set[str] = set()
        for g, group in enumerate(self.nodes):
            for i in range(group.count):
                instance = _node_instance(group.name, i)
                if instance in instances:
                    raise ValueError(
                        f"nodes[{g}].name: node instance name {instance!r} is ambiguous "
                        "(node instances are named name + index); rename a node group"
                    )
                instances.add(instance)
        num_nodes = sum(group.count for group in self.nodes)
        if num_nodes > 1 and self.links.inter_node is None:
            raise ValueError(f"links.inter_node: required, the cluster has {num_nodes} nodes")
        if self.links.intra_node is None and any(
            sum(slot.count for slot in group.devices) > 1 for group in self.nodes
        ):
            raise ValueError("links.intra_node: required, a node holds more than one device")
        return self

    # -- resolved views ----------------------------------------------------------------------------

    @cached_property
    def _devices(self) -> tuple[Device, ...]:
        devices: list[Device] = []
        node_index = 0
        for group in self.nodes:
            for i in range(group.count):
                node = _node_instance(group.name, i)
                local_rank = 0
                for slot in group.devices:
                    for k in range(slot.count):
                        devices.append(
                            Device(
                                id=f"{node}/{slot.type}:{k}",
                                rank=len(devices),
                                node=node,
                                node_index=node_index,
                                local_rank=local_rank,
                                type_name=slot.type,
                                type=self.device_types[slot.type],
                            )
                        )
                        local_rank += 1
                node_index += 1
        return tuple(devices)

    @cached_property
    def _by_id(self) -> dict[str, Device]:
        return {device.id: device for device in self._devices}

    def devices(self) -> list[Device]:
        """Every device, node by node in spec order, each node's devices in slot order."""
        return list(self._devices)

    def device(self, device_id: str) -> Device:
        """The device with id ``device_id``; ``KeyError`` naming the cluster if there is none."""
        try:
            return self._by_id[device_id]
        except KeyError:
            raise KeyError(f"cluster {self.name!r} has no device {device_id!r}") from None

    @property
    def num_devices(self) -> int:
        return len(self._devices)

    @property
    def num_nodes(self) -> int:
        """The number of node instances (machines)."""
        return sum(group.count for group in self.nodes)

    def link_between(self, a: Device | str, b: Device | str) -> Link:
        """The link data takes from device ``a`` to device ``b`` (intra-node or inter-node)."""
        dev_a = a if isinstance(a, Device) else self.device(a)
        dev_b = b if isinstance(b, Device) else self.device(b)
        if dev_a.id == dev_b.id:
            raise ValueError(f"no link from device {dev_a.id!r} to itself")
        link = self.links.intra_node if dev_a.node_index == dev_b.node_index else self.links.inter_node
        # Validation guarantees the link exists wherever two devices need it.
        assert link is not None
        return link

    def to_json_dict(self) -> dict[str, Any]:
        """The resolved spec as plain data in SI units (bytes, bytes/s, FLOP/s, s), for plans.

        Deterministic: device types sorted by name, rates in :data:`DTYPES` order, devices in rank
        order. :meth:`from_json_dict` reads it back.
        """

        def link(value: Link | None) -> dict[str, float] | None:
            if value is None:
                return None
            ring = {
                "allreduce_bandwidth": value.allreduce_bandwidth,
                "allreduce_latency": value.allreduce_latency,
            }
            return {
                "bandwidth": value.bandwidth,
                "latency": value.latency,
                **({"overhead": value.overhead} if value.overhead else {}),
                **({"receive_overhead": value.receive_overhead} if value.receive_overhead else {}),
                **({"allreduce_overhead": value.allreduce_overhead} if value.allreduce_overhead else {}),
                **(
                    {
                        "allreduce_ranks": value.allreduce_ranks,
                        "allreduce_curve": [list(point) for point in value.allreduce_curve],
                    }
                    if value.allreduce_curve
                    else {}
                ),
                **(
                    {"zero_sync_curve": [list(point) for point in value.zero_sync_curve]}
                    if value.zero_sync_curve
                    else {}
                ),
                **{k: v for k, v in ring.items() if v is not None},
            }

        return {
            "name": self.name,
            "device_types": {
                name: {
                    "kind": dtype.kind,
                    "name": dtype.name,
                    "memory": dtype.memory,
                    "flops": {key: dtype.flops[key] for key in DTYPES if key in dtype.flops},
                    "memory_bandwidth": dtype.memory_bandwidth,
                    "kernel_launch_overhead": dtype.kernel_launch_overhead,
                    "cores": dtype.cores,
                    **({"action_overhead": dtype.action_overhead} if dtype.action_overhead else {}),
                    **(
                        {"contention_overhead": dtype.contention_overhead}
                        if dtype.contention_overhead
                        else {}
                    ),
                    **({"replica_contention": dtype.replica_contention} if dtype.replica_contention else {}),
                    **({"decode_op_overhead": dtype.decode_op_overhead} if dtype.decode_op_overhead else {}),
                    **(
                        {"decode_compiled_op_overhead": dtype.decode_compiled_op_overhead}
                        if dtype.decode_compiled_op_overhead
                        else {}
                    ),
                    **(
                        {"decode_exchange_overhead": dtype.decode_exchange_overhead}
                        if dtype.decode_exchange_overhead
                        else {}
                    ),
                    **({"decode_rank_skew": dtype.decode_rank_skew} if dtype.decode_rank_skew else {}),
                }
                for name, dtype in sorted(self.device_types.items())
            },
            "nodes": [
                {
                    "name": group.name,
                    "count": group.count,
                    "devices": [{"type": slot.type, "count": slot.count} for slot in group.devices],
                }
                for group in self.nodes
            ],
            "links": {
                "intra_node": link(self.links.intra_node),
                "inter_node": link(self.links.inter_node),
                **({"nics": self.links.nics} if self.links.nics else {}),
            },
            "num_nodes": self.num_nodes,
            "num_devices": self.num_devices,
            "devices": [
                {
                    "id": d.id,
                    "rank": d.rank,
                    "node": d.node,
                    "node_index": d.node_index,
                    "local_rank": d.local_rank,
                    "type": d.type_name,
                }
                for d in self._devices
            ],
        }

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any], *, source: str | None = None) -> ClusterSpec:
        """Read back :meth:`to_json_dict` (e.g. the ``cluster`` of a plan); derived keys are ignored."""
        derived = {"num_nodes", "num_devices", "devices"}
        spec = {key: value for key, value in data.items() if key not in derived}
        # Optional fields written as null read as absent.
        spec["device_types"] = {
            name: {k: v for k, v in fields.items() if v is not None}
            for name, fields in dict(spec.get("device_types") or {}).items()
        }
        links = dict(spec.get("links") or {})
        spec["links"] = {k: v for k, v in links.items() if v is not None}
        return parse_cluster(spec, source=source)


# ---------------------------------------------------------------------------------------------------
# Loading


def presets_dir() -> Path:
    """The folder of cluster presets (``configs/clusters``)."""
    return config_files.presets_dir("clusters")


def list_presets() -> list[str]:
    """The names of the cluster presets (file stems in :func:`presets_dir`), sorted."""
    return config_files.list_presets("clusters")


def parse_cluster(data: Any, *, source: str | None = None) -> ClusterSpec:
    """Validate already-loaded data (e.g. parsed YAML) as a cluster spec.

    Raises :class:`InputError` with one line naming ``source`` and the field path.
    """
    if not isinstance(data, Mapping):
        got = "an empty document" if data is None else f"a YAML {type(data).__name__}"
        raise InputError(
            f"expected a cluster spec mapping (name, device_types, nodes, links); got {got}", source=source
        )
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as err:
        raise InputError(config_files.format_validation_error(err), source=source) from None


def load_cluster(path_or_preset: str | Path) -> ClusterSpec:
    """Load a cluster spec from a YAML file or a preset name (a file stem in ``configs/clusters/``).

    Every problem raises :class:`InputError` whose one-line message names the file and, for an
    invalid spec, the field path (``device_types.a100.memory: …``) and what was expected.
    """
    path, _ = config_files.resolve_config(path_or_preset, kind="clusters", what="cluster spec")
    data, _ = config_files.read_yaml(path, what="cluster spec")
    return parse_cluster(data, source=str(path))
