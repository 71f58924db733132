"""A simulated pipeline iteration as trace-event tracks (``plan --trace``; beside the measured ones
in ``launch --trace``): one track per device, its forwards and backwards on the compute stream,
each transfer on a stream per peer with an arrow from the sender to the receiver, the all-reduce
on a stream of its own. Data-parallel replicas of a stage run the same schedule."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tessera.core.plans import GppPlan
from tessera.core.specs import ClusterSpec
from tessera.core.trace import COMPUTE, Trace
from tessera.planners.pipeline.links import clip_time, nic_route, ring_nics
from tessera.planners.sim import Event, SimEdge, SimResult, SimStage, simulate_steps

__all__ = ["add_schedule", "device_tracks", "schedule_trace", "simulate_plan"]

ALLREDUCE = "all-reduce"


def device_tracks(stages: Sequence[tuple[int, Sequence[str]]]) -> dict[str, int]:
    """A track number per device, in the stages' order: ``stages`` are ``(stage id, devices)``."""
    tracks: dict[str, int] = {}
    for _, devices in stages:
        for device in devices:
            tracks.setdefault(device, len(tracks))
    return tracks


def schedule_trace(plan: GppPlan, sim: SimResult) -> dict[str, Any]:
    """``plan``'s simulated iteration ``sim`` as a trace-event document (``plan --trace``)."""
    stages = [(st.id, st.devices) for st in plan.stages]
    pids = device_tracks(stages)
    trace = Trace()
    stage_of = {d: sid for sid, devs in stages for d in devs}
    for device, pid in pids.items():
        trace.track(pid, f"{device} (stage {stage_of[device]})")
    add_schedule(trace, sim, stages, pids, cat="simulated")
    return trace.to_json(
        what=f"tessera plan --kind {plan.kind}: one simulated iteration",
        model=plan.model.path if plan.model is not None else None,
        cluster=(plan.cluster or {}).get("name"),
        iteration_time_s=plan.predicted.get("iteration_time_s"),
    )


def simulate_plan(
    plan: GppPlan, cluster: ClusterSpec, floating: Callable[[str], bool] = lambda name: True
) -> SimResult:
    """One iteration of a saved plan simulated again from what it records (each stage's predicted
    times and schedule, each edge's bytes) and the links of ``cluster`` between its devices, as the
    planner simulated it: what ``launch --trace`` shows beside the run. ``floating``: whether a
    tensor carries a gradient back (an edge of none sends no gradient)."""
    measured = plan.predicted.get("cost_model") != "roofline"  # stage times measured: overheads too
    ranks = [d for st in plan.stages for d in st.devices]
    clip = clip_time(cluster, ranks, plan.training.max_grad_norm if plan.training else None)
    stages = []
    for st in plan.stages:
        p = st.predicted
        devices = [cluster.device(d) for d in st.devices]
        stages.append(
            SimStage(
                id=st.id,
                micro_batch_size=st.micro_batch_size,
                forward_time=p["forward_time_s"],
                backward_time=p["backward_time_s"],
                actions=tuple(st.schedule.actions),
                devices=len(devices),
                allreduce_time=p["allreduce_time_s"],
                allreduce_nics=ring_nics(cluster, devices),
                action_overhead=devices[0].type.action_overhead if measured else 0.0,
            )
        )
    by_id = {st.id: st for st in plan.stages}
    edges = []
    for e in plan.edges:
        src, dst = by_id[e.src].devices, by_id[e.dst].devices
        src_nics, dst_nics, share = nic_route(cluster, src, dst)
        link = cluster.links.inter_node if src_nics else cluster.link_between(src[0], dst[0])
        edges.append(
            SimEdge(
                e.src,
                e.dst,
                e.bytes / by_id[e.src].micro_batch_size,
                link.bandwidth if link else float("inf"),
                link.latency if link else 0.0,
                src_nics,
                dst_nics,
                share,
                link.overhead if link else 0.0,
                link.receive_overhead if link else 0.0,
                any(floating(t.name) for t in e.tensors),
            )  # fmt: skip
        )
    steps = {st.id: st.predicted.get("step_time_s", 0.0) for st in plan.stages}
    return simulate_steps(stages, edges, plan.mini_batch_size, steps, clip)


def add_schedule(
    trace: Trace,
    sim: SimResult,
    stages: Sequence[tuple[int, Sequence[str]]],
    pids: Mapping[str, int],
    *,
    offset: float = 0.0,
    cat: str = "predicted",
) -> None:
    """``sim``'s events on the tracks ``pids[device]`` of each stage's devices, ``offset`` seconds
    later (the tracks must be declared)."""
    devices = {sid: list(devs) for sid, devs in stages}
    for e in sim.events:
        start, end = offset + e.start, offset + e.end
        senders = devices[e.stage]
        if e.kind in ("F", "B"):
            for d in senders:
                trace.span(pids[d], COMPUTE, f"{e.kind}{e.micro_batch}", start, end, cat=cat)
        elif e.kind == "allreduce":
            for d in senders:
                trace.span(pids[d], ALLREDUCE, "all-reduce", start, end, cat=cat)
        else:
            _transfer(trace, e, senders, devices[e.peer] if e.peer is not None else [], pids, offset, cat)


def _transfer(
    trace: Trace,
    e: Event,
    senders: list[str],
    receivers: list[str],
    pids: Mapping[str, int],
    offset: float,
    cat: str,
) -> None:
    """A send of micro-batch ``e.micro_batch`` (activations or gradients): replica ``i`` of the
    sender sends to replica ``i`` modulo the receiver's replicas."""
    what = "activations" if e.kind == "send_F" else "gradients"
    name = f"{what} {e.micro_batch}"
    start, end = offset + e.start, offset + e.end
    out, into = f"send → stage {e.peer}", f"receive ← stage {e.stage}"
    for d in senders:
        trace.span(pids[d], out, name, start, end, cat=cat)
    for d in receivers:
        trace.span(pids[d], into, name, start, end, cat=cat)
    for i, d in enumerate(senders):
        if receivers:
            r = receivers[i % len(receivers)]
            trace.flow(name, (pids[d], out, start), (pids[r], into, start), cat=cat)
