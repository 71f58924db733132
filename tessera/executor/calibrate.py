"""``tessera calibrate``: measure this machine as ``ranks`` CPU devices running at once and write
the cluster spec the planners read (``tessera plan MODEL --cluster SPEC``).

:func:`calibrate` starts the ranks (:mod:`tessera.executor.calibrate_worker`, launched as
``launch`` starts workers), gathers what they measured and fits the spec's fields;
:meth:`Calibration.spec_yaml` writes the spec with comments saying where every number came from.
Details: docs/executor.md ("Calibrating this machine").
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera import __version__
from tessera.core.errors import InputError, LaunchError
from tessera.core.specs import ClusterSpec, DeviceType, Link, parse_cluster
from tessera.executor.calibrate_pipeline import measure_pipeline_overhead, pipeline_rounds
from tessera.executor.calibrate_worker import (
    CHAIN_NODES,
    CHAIN_WIDTH,
    COPY_BYTES,
    LOADED_BYTES,
    CalibrateWorkerSpec,
    calibrate_worker,
    chain_model,
)

DEVICE_TYPE = "cpu-rank"
MEMORY_FRACTION = 0.85
"""The share of the machine's memory the spec gives its devices (the rest to the OS and the rest
of the machine's processes)."""
MAX_RANKS_PER_CORE = 4
"""More ranks than this per core would measure only their contention for it."""
MAX_SECONDS = 3600.0


@dataclass(frozen=True)
class CalibrateOptions:
    """``ranks`` processes of ``threads`` torch threads each; ``seconds``: the measuring budget
    (the workers' start-up comes on top)."""

    ranks: int = 2
    threads: int | None = None  # None: cores // ranks, at least 1
    seconds: float = 10.0


def machine_cores() -> int:
    """The cores this process may run on (its affinity mask: ``taskset`` and cgroups count)."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def resolve_options(options: CalibrateOptions, cores: int) -> tuple[int, int]:
    """``(ranks, threads)`` checked against a machine of ``cores`` cores; InputError (exit 2) for
    values no measurement could use."""
    most = MAX_RANKS_PER_CORE * cores
    if not 2 <= options.ranks <= most:
        raise InputError(
            f"--ranks {options.ranks}: expected 2 to {most} ({MAX_RANKS_PER_CORE} per core on this "
            f"{cores}-core machine; the link between ranks is measured, so at least 2)"
        )
    threads = options.threads if options.threads is not None else max(1, cores // options.ranks)
    if not 1 <= threads <= cores:
        raise InputError(f"--threads-per-rank {threads}: expected 1 to {cores} (the cores of this machine)")
    if not 0 < options.seconds <= MAX_SECONDS:
        raise InputError(f"--seconds {options.seconds:g}: expected more than 0 and at most {MAX_SECONDS:g}")
    return options.ranks, threads


@dataclass
class Calibration:
    """What :func:`calibrate` measured (``measured``, SI units, medians), the machine it ran on and
    the spec made of it (``spec``)."""

    host: str
    cpu: str
    cores: int
    ranks: int
    threads: int
    seconds: float
    torch_version: str
    memory_total: int
    wall_s: float
    measured: dict[str, Any]
    ranks_raw: list[dict[str, Any]] = field(repr=False)

    @property
    def shares_cores(self) -> bool:
        """More threads over all ranks than the machine has cores: the ranks slow each other."""
        return self.ranks * self.threads > self.cores

    @property
    def device_cores(self) -> int:
        """The cores a device of the spec counts: its threads, or its share of the cores (at least 1)
        when the ranks share them."""
        return max(1, self.cores // self.ranks) if self.shares_cores else self.threads

    @property
    def device_memory(self) -> int:
        """Bytes per device: :data:`MEMORY_FRACTION` of the machine's memory over the ranks, whole MiB."""
        return int(self.memory_total * MEMORY_FRACTION / self.ranks) // 2**20 * 2**20

    @property
    def name(self) -> str:
        host = re.sub(r"[^A-Za-z0-9_.-]+", "-", self.host).strip("-._") or "host"
        return f"calibrated-{host}"

    def spec_yaml(self) -> str:
        """The cluster spec as YAML with comments naming what every number came from; no dates, so
        the same measurements give the same file."""
        return _spec_yaml(self)

    def spec(self) -> ClusterSpec:
        """The spec as the planners load it (from :meth:`spec_yaml`)."""
        import yaml

        return parse_cluster(yaml.safe_load(self.spec_yaml()), source="<calibrated spec>")

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": {
                "host": self.host,
                "cpu": self.cpu,
                "cores": self.cores,
                "memory_total_bytes": self.memory_total,
                "torch": self.torch_version,
            },
            "ranks": self.ranks,
            "threads_per_rank": self.threads,
            "shares_cores": self.shares_cores,
            "seconds": self.seconds,
            "wall_s": self.wall_s,
            "measured": self.measured,
            "per_rank": self.ranks_raw,
            "spec": self.spec().to_json_dict(),
        }


def calibrate(options: CalibrateOptions) -> Calibration:
    """Start ``options.ranks`` workers on this machine, let every one measure at the same time,
    and fit the spec's numbers. LaunchError (exit 4) when a worker fails."""
    import torch

    from tessera.executor.launcher import LaunchOptions, launch_workers

    cores = machine_cores()
    ranks, threads = resolve_options(options, cores)
    timeout_s = max(60.0, 4 * options.seconds)
    spec = CalibrateWorkerSpec(
        world_size=ranks, threads=threads, seconds=options.seconds, timeout_s=timeout_s
    )
    start = time.perf_counter()
    results = launch_workers(
        calibrate_worker, (spec,), ranks, LaunchOptions(nproc_per_node=ranks, timeout_s=timeout_s)
    )
    wall_s = time.perf_counter() - start
    raw = [results[r] for r in sorted(results)]
    cal = Calibration(
        host=socket.gethostname(),
        cpu=cpu_name(),
        cores=cores,
        ranks=ranks,
        threads=threads,
        seconds=options.seconds,
        torch_version=torch.__version__,
        memory_total=memory_total(),
        wall_s=wall_s,
        measured=summarize(raw, ranks),
        ranks_raw=raw,
    )
    # Last, the stage workers' own cost per action, message and all-reduce, measured by running
    # them on the spec so far.
    rounds = pipeline_rounds(options.seconds)
    cal.measured["pipeline"] = measure_pipeline_overhead(cal.spec(), timeout_s, rounds)
    cal.wall_s = time.perf_counter() - start
    return cal


def summarize(raw: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    """The ranks' measurements as the spec's numbers: the median over ranks of each rank's median
    (the slowest rank for an all-reduce), the link fitted to the point-to-point times, the launch
    overhead solved from the executor's cost per operator."""
    matmul = statistics.median(r["matmul"]["flops_per_s"] for r in raw)
    copy = statistics.median(r["bandwidth"]["copy_bytes_per_s"] for r in raw)
    per_op = statistics.median(r["per_op"]["forward_backward_s"] for r in raw)
    pairs = [r["p2p"] for r in raw if r["p2p"] is not None]
    p2p_bytes = pairs[0]["bytes"]
    one_way = [statistics.median(p["one_way_s"][i] for p in pairs) for i in range(len(p2p_bytes))]
    latency, bandwidth = fit_link(p2p_bytes, one_way)
    link = Link(bandwidth=bandwidth, latency=latency)
    loaded = [r["p2p_loaded"] for r in raw if r.get("p2p_loaded") is not None]
    sent = [x["send_s"] for x in loaded if "send_s" in x]
    received = [x["receive_s"] for x in loaded if "receive_s" in x]
    allreduce_bytes = raw[0]["allreduce"]["bytes"]
    allreduce = [max(r["allreduce"]["seconds"][i] for r in raw) for i in range(len(allreduce_bytes))]
    zero_measured = [max(r["allreduce"]["zero_seconds"][i] for r in raw) for i in range(len(allreduce_bytes))]
    zero_sync = non_decreasing(zero_measured)  # a larger exchange is never faster: a dip is noise
    ring_latency, ring_bandwidth = fit_ring(allreduce_bytes, allreduce, ranks)
    from tessera.core.cost import allreduce_time

    return {
        "matmul": {"n": raw[0]["matmul"]["n"], "flops_per_s": matmul},
        "bandwidth": {
            "bytes": COPY_BYTES,
            "copy_bytes_per_s": copy,
            "sum_bytes_per_s": statistics.median(r["bandwidth"]["sum_bytes_per_s"] for r in raw),
        },
        "decode_op": {
            "operations": raw[0]["decode_op"]["operations"],
            "step_s": statistics.median(r["decode_op"]["step_s"] for r in raw),
            "op_s": statistics.median(r["decode_op"]["op_s"] for r in raw),
            "compiled_step_s": statistics.median(r["decode_op"]["compiled_step_s"] for r in raw),
            "compiled_op_s": statistics.median(r["decode_op"]["compiled_op_s"] for r in raw),
        },
        "decode_exchange": _median_of(raw, "decode_exchange", "exchange_s"),
        "decode_rank_skew": _median_of(raw, "decode_exchange", "rank_skew"),
        "per_op": {
            "nodes": list(CHAIN_NODES),
            "forward_s": statistics.median(r["per_op"]["forward_s"] for r in raw),
            "forward_backward_s": per_op,
            "kernel_launch_overhead_s": launch_overhead(per_op, matmul, copy),
        },
        "p2p": {
            "bytes": p2p_bytes,
            "one_way_s": one_way,
            "pairs": [p["pair"] for p in pairs],
            "latency_s": latency,
            "bandwidth_bytes_per_s": bandwidth,
            # While both ranks compute, as a pipeline's do: each end's own time per message.
            "send_s": statistics.median(sent) if sent else 0.0,
            "receive_s": statistics.median(received) if received else 0.0,
        },
        "allreduce": {
            "bytes": allreduce_bytes,
            "seconds": allreduce,
            "ring_model_s": [allreduce_time(n, ranks, link) for n in allreduce_bytes],
            # A ZeRO-1 step's reduce-scatter then all-gather of the same buffers.
            "zero_seconds": zero_sync,
            "zero_measured_s": zero_measured,
            "latency_s": ring_latency,
            "bandwidth_bytes_per_s": ring_bandwidth,
        },
    }


def _median_of(raw: list[dict[str, Any]], phase: str, key: str) -> float | None:
    """The median over the ranks of a phase's number; None where a rank did not measure it."""
    values = [r[phase][key] for r in raw if r.get(phase)]
    return statistics.median(values) if values and len(values) == len(raw) else None


def fit_ring(nbytes: Sequence[float], seconds: Sequence[float], ranks: int) -> tuple[float, float]:
    """``(latency, bandwidth)`` of one ring step such that ``core.cost.allreduce_time`` gives the
    measured all-reduce times: ``t = 2(p−1)·latency + 2(p−1)/p · n / bandwidth``."""
    a, inverse_b = fit_link(nbytes, seconds)  # t = a + n / inverse_b
    steps = 2 * (ranks - 1)
    return a / steps, steps / ranks * inverse_b


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in squared error (isotonic regression, pool
    adjacent violators): each run that falls is replaced by its mean."""
    blocks: list[tuple[float, int]] = []  # (mean, count)
    for v in values:
        mean, count = float(v), 1
        while blocks and blocks[-1][0] > mean:
            m, c = blocks.pop()
            mean, count = (m * c + mean * count) / (c + count), c + count
        blocks.append((mean, count))
    return [mean for mean, count in blocks for _ in range(count)]


def fit_link(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """``(latency, bandwidth)`` of the alpha-beta model ``t = latency + n / bandwidth`` (the link's
    :meth:`~tessera.core.specs.Link.transfer_time`) fitted to one-way times ``seconds`` of messages
    of ``nbytes``: least squares of the relative error, so that 4 B counts as much as 16 MiB. A
    negative latency (noise) gives way to the smallest message's time."""
    import numpy as np

    n, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    rows = np.stack([1 / t, n / t], axis=1)
    (latency, inverse_bandwidth), *_ = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)
    if not inverse_bandwidth > 0:
        raise LaunchError(
            f"the point-to-point times do not grow with the message size ({', '.join(f'{s:.3g}' for s in t)} s); "
            "measure again with more --seconds"
        )
    if not latency > 0:
        latency = float(t[np.argmin(n)])
    return float(latency), float(1 / inverse_bandwidth)


def launch_overhead(per_op_s: float, flops: float, bandwidth: float) -> float:
    """The spec's ``kernel_launch_overhead``: the cost model charges it once in an operator's forward
    and once in its backward (:mod:`tessera.core.cost`), so it is half the measured forward +
    backward time of one chain node less the roofline time the model gives such a node."""
    from tessera.core.cost import CostModel
    from tessera.core.graph import load_graph

    device = DeviceType(
        kind="cpu",
        memory=2**30,
        flops={"fp32": flops},
        memory_bandwidth=bandwidth,
        kernel_launch_overhead=0.0,
    )
    cost = CostModel.for_device(device)
    ops = load_graph(chain_model(CHAIN_NODES[0]), label="<chain>").ops()
    roofline = statistics.fmean(cost.forward_time(op, 1) + cost.backward_time(op, 1) for op in ops)
    overhead = (per_op_s - roofline) / 2
    if not overhead > 0:
        raise LaunchError(
            f"the executor's time per operator ({per_op_s * 1e6:.3g} us) did not come out positive; "
            "measure again with more --seconds"
        )
    return overhead


def memory_total() -> int:
    """Bytes of memory this machine has for its processes: ``MemTotal``, capped by a cgroup v2
    limit; ``os.sysconf`` where there is no /proc."""
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo", encoding="ascii") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:")]
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit != "max":
            found.append(int(limit))
    if not found:
        found.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return min(found)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's machine type."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.partition(":")[2].split())
    return platform.machine() or "unknown CPU"


# ---------------------------------------------------------------------------------------------------
# The spec as YAML


def _quantity(value: float, unit: str, prefixes: Sequence[tuple[float, str]]) -> str:
    """``value`` with the largest prefix that leaves at least 1, four significant digits: 142.3GFLOPS."""
    for factor, prefix in prefixes:
        if value >= factor or factor == prefixes[-1][0]:
            return f"{value / factor:.4g}{prefix}{unit}"
    raise AssertionError("unreachable")


def flops_text(value: float) -> str:
    return _quantity(value, "FLOPS", [(1e12, "T"), (1e9, "G"), (1e6, "M")])


def bandwidth_text(value: float) -> str:
    return _quantity(value, "B/s", [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")])


def seconds_text(value: float) -> str:
    return _quantity(value, "s", [(1.0, ""), (1e-3, "m"), (1e-6, "u"), (1e-9, "n")])


def bytes_text(value: int) -> str:
    return f"{value / 2**30:.1f} GiB" if value >= 2**30 else f"{value // 2**20} MiB"


def size_text(nbytes: int) -> str:
    """A message size: 4 B, 64 KiB, 16 MiB."""
    for factor, unit in ((2**20, "MiB"), (2**10, "KiB")):
        if nbytes >= factor:
            return f"{nbytes / factor:g} {unit}"
    return f"{nbytes} B"


def p2p_text(p2p: dict[str, Any]) -> str:
    """The one-way times by message size: ``4 B 85.1us, 1 KiB 86.0us, …``."""
    pairs = zip(p2p["bytes"], p2p["one_way_s"], strict=True)
    return ", ".join(f"{size_text(n)} {seconds_text(t)}" for n, t in pairs)


def allreduce_text(reduce: dict[str, Any]) -> str:
    """The all-reduce times by size, each with the ring model's: ``4 B 120us (ring model 170us), …``."""
    rows = zip(reduce["bytes"], reduce["seconds"], reduce["ring_model_s"], strict=True)
    return ", ".join(f"{size_text(n)} {seconds_text(t)} (ring model {seconds_text(p)})" for n, t, p in rows)


def _comments(cal: Calibration) -> list[str]:
    m = cal.measured
    matmul, copy, per_op, p2p, reduce = m["matmul"], m["bandwidth"], m["per_op"], m["p2p"], m["allreduce"]
    per_rank = ", ".join(flops_text(r["matmul"]["flops_per_s"]) for r in cal.ranks_raw)
    pairs = ", ".join(f"{a}-{b}" for a, b in p2p["pairs"])
    reduces = zip(reduce["bytes"], reduce["seconds"], reduce["ring_model_s"], strict=True)
    lines = [
        f"Measured by `tessera calibrate --ranks {cal.ranks} --threads-per-rank {cal.threads} "
        f"--seconds {cal.seconds:g}`",
        f"(tessera {__version__}, torch {cal.torch_version}) on a {cal.cores}-core {cal.cpu}:",
        f"{cal.ranks} ranks of {cal.threads} torch thread(s) each, measuring at the same time as the workers",
        "of a launch run. Every number is the median of repeated runs on each rank, then the median",
        "over the ranks.",
        f"  flops.fp32: torch.mm {matmul['n']}x{matmul['n']} fp32 (2n^3 FLOPs): "
        f"{flops_text(matmul['flops_per_s'])} (ranks: {per_rank})",
        f"  memory_bandwidth: copying {COPY_BYTES // 2**20} MiB of fp32, bytes read + written: "
        f"{bandwidth_text(copy['copy_bytes_per_s'])}",
        f"    (summing them, bytes read: {bandwidth_text(copy['sum_bytes_per_s'])})",
        f"  kernel_launch_overhead: tessera's torch executor (OnnxModule), chains of {per_op['nodes'][0]} "
        f"and {per_op['nodes'][1]} Add/Mul",
        f"    nodes on [1, {CHAIN_WIDTH}]: {seconds_text(per_op['forward_backward_s'])} per node forward + "
        f"backward ({seconds_text(per_op['forward_s'])} forward). The cost model",
        "    charges the overhead in the forward and again in the backward: half of it, less the",
        "    roofline time of such a node.",
        "  decode_op_overhead: the zoo's tiny GPT decoded as a dp rank does (a traced step, a static cache):",
        f"    {seconds_text(m['decode_op']['step_s'])} a step over its {m['decode_op']['operations']} operations",
        "  decode_compiled_op_overhead: the same step compiled by torch.compile's inductor (launch --compile):",
        f"    {seconds_text(m['decode_op']['compiled_step_s'])} a step over the same operations",
        *(
            [
                "  decode_exchange_overhead, decode_rank_skew: the compiled step's cores' outputs gathered between",
                f"    ranks (as tp and cp launches): {seconds_text(m['decode_exchange'])} a gather, and the first of a "
                f"layer waits for the later rank: +{m['decode_rank_skew']:.1%} of the step",
            ]
            if m.get("decode_exchange")
            else []
        ),
        f"  memory: {MEMORY_FRACTION:.0%} of this machine's {bytes_text(cal.memory_total)} over {cal.ranks} ranks",
        f"  links.intra_node: gloo send/recv between ranks {pairs} (pairs at once), half the round trip:",
        f"    {p2p_text(p2p)};",
        "    latency + bytes / bandwidth fitted to them (least squares of the relative error):",
        f"    {seconds_text(p2p['latency_s'])} + bytes / {bandwidth_text(p2p['bandwidth_bytes_per_s'])};",
        f"    gloo alone, each end's own time for a {size_text(LOADED_BYTES)} message while both ranks compute",
        f"    (receives posted ahead): sending {seconds_text(p2p['send_s'])}, receiving "
        f"{seconds_text(p2p['receive_s'])};",
        *_pipeline_comments(cal.measured.get("pipeline")),
        f"  allreduce_*: gloo all-reduce over {cal.ranks} ranks (the slowest rank's median; the ring model",
        "    with the point-to-point link in brackets); allreduce_curve holds them (the planners",
        f"    interpolate between them for {cal.ranks} ranks), fitted as the ring's per-step latency and",
        "    bandwidth for other sizes and rank counts:",
        *(f"    {size_text(n)} {seconds_text(t)} (ring model {seconds_text(p)})" for n, t, p in reduces),
        "  zero_sync_curve: a ZeRO-1 step's reduce-scatter then all-gather of the same buffers, as",
        "    executor/zero.py runs them (through shared memory where the ranks share a host) (the",
        "    slowest rank's median; where a larger size measured faster, the pooled mean of the run, as",
        "    a larger exchange is never faster), which ZeRO-1 stages pay in place of the all-reduce: "
        + ", ".join(
            f"{size_text(n)} {seconds_text(t)}"
            + (f" (measured {seconds_text(raw)})" if abs(raw - t) > 1e-9 else "")
            for n, t, raw in zip(
                reduce["bytes"],
                reduce["zero_seconds"],
                reduce.get("zero_measured_s", reduce["zero_seconds"]),
                strict=True,
            )  # fmt: skip
        ),
    ]
    if cal.shares_cores:
        lines.append(
            f"  cores: the {cal.ranks} ranks x {cal.threads} thread(s) share {cal.cores} cores: "
            f"each device counts {cal.device_cores}"
        )
    return ["# " + line for line in lines]


def link_latency(measured: dict[str, Any]) -> float:
    """The spec's link latency: what a message keeps a pipeline's receiver waiting, fitted to the
    two-stage run (the idle links' fit without that phase)."""
    pipeline = measured.get("pipeline")
    return pipeline["latency_s"] if pipeline else measured["p2p"]["latency_s"]


def link_overhead(measured: dict[str, Any]) -> float:
    """The spec's link overhead, a sender's per message: the stage workers' (gloo's alone without
    that phase)."""
    pipeline = measured.get("pipeline")
    return pipeline["overhead_s"] if pipeline else measured["p2p"]["send_s"]


def _pipeline_comments(pipeline: dict[str, Any] | None) -> list[str]:
    if not pipeline:
        return ["    the overhead written is gloo's sending time, the receive_overhead its receiving time"]
    ranks = ", ".join(seconds_text(x) for x in pipeline["overhead_per_rank_s"])
    rounds = pipeline.get("contention_per_round_s", [pipeline["contention_overhead_s"]])
    return [
        "    the overhead written is the stage workers' own (tessera launch's executor) on an",
        f"    {pipeline['model']}, mini-batch {pipeline['mini_batch']} in micro-batches of "
        f"{pipeline['micro_batch']}, {pipeline['steps']} steps, in {len(rounds)} round(s) of one rank as one stage",
        "    then two as two (each time below: the median over the rounds): one rank",
        f"    spends {seconds_text(pipeline['action_overhead_s'])} an action on neither compute nor the "
        "optimizer step (the device's action_overhead);",
        "    two ranks as two stages spend beyond that, per step, over the messages they send",
        f"    ({'/'.join(map(str, pipeline['sent_per_step']))} a step): "
        f"{seconds_text(pipeline['overhead_s'])} per message ({ranks} by rank in the median round): the",
        "    link's overhead, a sender's; its receive_overhead is gloo's receiving time above;",
        f"    and compute {'+'.join(seconds_text(x) for x in pipeline['busy_per_rank_s'])} a step, the one "
        f"rank {seconds_text(pipeline['busy_alone_s'])} (the median round): the difference over their",
        f"    actions is the device's contention_overhead ({seconds_text(pipeline['contention_overhead_s'])} "
        f"an action; rounds: {', '.join(seconds_text(x) for x in rounds)});",
        *_replica_comments(pipeline),
        f"    their step takes {seconds_text(pipeline['iteration_s'])}, which the simulator gives with those "
        "times and a link latency",
        f"    of {seconds_text(pipeline['latency_s'])} (the idle links' {seconds_text(pipeline['latency_floor_s'])}): "
        "the latency written, a message's wait in a pipeline;",
        f"    two ranks as one data-parallel stage of an {pipeline['allreduce_model']} all-reduce its",
        f"    {size_text(pipeline['allreduce_bytes'])} of "
        f"gradients in {seconds_text(pipeline['allreduce_in_step_s'])} a step",
        f"    (the replica that got there last), {seconds_text(pipeline['allreduce_predicted_s'])} by the "
        "curve below: the difference is allreduce_overhead",
    ]


def _replica_comments(pipeline: dict[str, Any]) -> list[str]:
    rounds = ", ".join(f"{x:.1%}" for x in pipeline["replica_contention_per_round"])
    return [
        "    two ranks as one data-parallel stage of the same MLP, each replica computing what the one",
        "    rank did: the slower replica's compute beyond the one rank's, a fraction of it, is the",
        f"    device's replica_contention ({pipeline['replica_contention']:.1%}, the median of the rounds: {rounds});",
    ]


def _spec_yaml(cal: Calibration) -> str:
    m = cal.measured
    description = f"one of {cal.ranks} ranks of {cal.threads} thread(s) on a {cal.cores}-core {cal.cpu}"
    p2p = m["p2p"]
    reduce = m["allreduce"]
    curve, zero = (
        ", ".join(f"[{n}, {seconds_text(t)}]" for n, t in zip(reduce["bytes"], reduce[key], strict=True))
        for key in ("seconds", "zero_seconds")
    )
    lines = [
        *_comments(cal),
        f"name: {cal.name}",
        "device_types:",
        f"  {DEVICE_TYPE}:",
        "    kind: cpu",
        f"    name: {json.dumps(description)}",
        f"    cores: {cal.device_cores}",
        f"    memory: {cal.device_memory // 2**20}MiB",
        f"    flops: {{fp32: {flops_text(m['matmul']['flops_per_s'])}}}",
        f"    memory_bandwidth: {bandwidth_text(m['bandwidth']['copy_bytes_per_s'])}",
        f"    kernel_launch_overhead: {seconds_text(m['per_op']['kernel_launch_overhead_s'])}",
        f"    decode_op_overhead: {seconds_text(m['decode_op']['op_s'])}",
        f"    decode_compiled_op_overhead: {seconds_text(m['decode_op']['compiled_op_s'])}",
        *(
            [f"    decode_exchange_overhead: {seconds_text(m['decode_exchange'])}"]
            + [f"    decode_rank_skew: {m['decode_rank_skew']:.4g}"]
            if m.get("decode_exchange")
            else []
        ),
        *(
            [
                f"    action_overhead: {seconds_text(m['pipeline']['action_overhead_s'])}",
                f"    contention_overhead: {seconds_text(m['pipeline']['contention_overhead_s'])}",
                f"    replica_contention: {m['pipeline']['replica_contention']:.4f}",
            ]
            if m.get("pipeline")
            else []
        ),
        "nodes:",
        f"  - {{name: local, count: 1, devices: [{{type: {DEVICE_TYPE}, count: {cal.ranks}}}]}}",
        "links:",
        f"  intra_node: {{bandwidth: {bandwidth_text(p2p['bandwidth_bytes_per_s'])}, "
        f"latency: {seconds_text(link_latency(m))}, overhead: {seconds_text(link_overhead(m))}, "
        f"receive_overhead: {seconds_text(p2p['receive_s'])},",
        f"               allreduce_bandwidth: {bandwidth_text(m['allreduce']['bandwidth_bytes_per_s'])}, "
        f"allreduce_latency: {seconds_text(m['allreduce']['latency_s'])},"
        + (
            f" allreduce_overhead: {seconds_text(m['pipeline']['allreduce_overhead_s'])},"
            if m.get("pipeline")
            else ""
        ),
        f"               allreduce_ranks: {cal.ranks}, allreduce_curve: [{curve}],",
        f"               zero_sync_curve: [{zero}]}}",
    ]
    return "\n".join(lines) + "\n"


def write_spec(cal: Calibration, path: str) -> None:
    """Write the spec to ``path`` atomically (readers see the old file or the new one), after
    checking it loads as a cluster spec."""
    from tessera.core.files import write_output

    text = cal.spec_yaml()
    cal.spec()  # a spec the planners would refuse is a bug here, not the user's file
    write_output(path, text)
