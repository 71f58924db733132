"""The last phase of ``tessera calibrate``: what the stage workers themselves cost beyond compute,
measured by running them on MLPs: one rank as one stage (its time per action: the device's
``action_overhead``), two ranks as two pipeline stages (the time per message beyond that: the
link's ``overhead``; their compute beyond the one rank's: the device's ``contention_overhead``),
two ranks as one data-parallel stage, each replica the one rank's work (their compute beyond it:
the device's ``replica_contention``), and so on a small MLP (its all-reduce in a step beyond the
measured curve: the link's ``allreduce_overhead``). Details: docs/executor.md ("Calibrating this machine").
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.core.cost import allreduce_time
from tessera.core.specs import ClusterSpec
from tessera.planners.pipeline.links import ring_link

if TYPE_CHECKING:
    from tessera.core.graph import Graph
    from tessera.planners.pipeline.types import Pipeline

# The actions and messages are measured on an MLP whose actions compute for a while (~0.1 ms
# each, four micro-batches), as a model's do: on a tiny one (width 64, 16 micro-batches of 2) the
# two ranks did nothing but exchange messages, and each message cost 3-4x what it costs between
# the stages of real models (300 us against 50-90 us measured in their launches).
WIDTH = 512
LAYERS = 4
MINI_BATCH = 32
MICRO_BATCH = 8
STEPS = 40  # a step of the MLP takes a few ms: medians over many steps cost little
# One rank, then two, this many times (with calibrate's default --seconds 10; a round per 2 s of a
# shorter budget, at least one): the host's load drifts over seconds, and the contention is the
# difference of the two runs' compute (one calibration read 0.5 us where others read 50-90 us).
ROUNDS = 5
SECONDS_PER_ROUND = 2.0
# The in-step all-reduce is measured on a small MLP (64 KiB of gradients): its fixed cost, which a
# large one hides in the curve's bandwidth term.
ALLREDUCE_WIDTH = 64
GRADIENT_BYTES = LAYERS * ALLREDUCE_WIDTH * ALLREDUCE_WIDTH * 4  # the small MLP's fp32 weights


def mlp(width: int = WIDTH, layers: int = LAYERS) -> Any:
    """An ONNX MLP: ``layers`` × (MatMul by a width × width weight, Relu) on ``[batch, width]``."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for i in range(layers):
        w = numpy_helper.from_array(
            (rng.standard_normal((width, width)) / width**0.5).astype("float32"), f"w{i}"
        )
        weights.append(w)
        nodes += [
            helper.make_node("MatMul", [x, w.name], [f"h{i}"]),
            helper.make_node("Relu", [f"h{i}"], [f"y{i}"]),
        ]
        x = f"y{i}"
    graph = helper.make_graph(
        nodes,
        "calibrate-mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", width])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tessera")


def pipeline_rounds(seconds: float) -> int:
    """The rounds a measuring budget of ``seconds`` buys (:data:`ROUNDS` at most, one at least)."""
    return max(1, min(ROUNDS, int(seconds / SECONDS_PER_ROUND)))


def measure_pipeline_overhead(
    cluster: ClusterSpec, timeout_s: float, rounds_n: int = ROUNDS
) -> dict[str, Any]:
    """Launch the MLP on the first devices of ``cluster``, in ``rounds_n`` rounds: on one rank
    as one stage, then on two as a two-stage sequential pipeline (each round's numbers:
    :func:`round_overheads`); then (the small MLP) on two as one data-parallel stage. Return the
    rounds' medians of the workers' own time per action, per message and the compute an action
    adds while the other rank computes, the link latency that makes the simulator give the median
    round's step, and the in-step all-reduce beyond ``cluster``'s, with what was run."""
    from tessera.core.graph import load_graph

    rounds = []
    with tempfile.TemporaryDirectory(prefix="tessera-calibrate-") as folder:
        path, small_path = Path(folder) / "mlp.onnx", Path(folder) / "mlp-small.onnx"
        path.write_bytes(mlp().SerializeToString())
        small_path.write_bytes(mlp(ALLREDUCE_WIDTH).SerializeToString())
        graph, small = load_graph(str(path)), load_graph(str(small_path))
        for _ in range(rounds_n):
            (alone,), _ = _overhead_run(graph, path, cluster, 1, timeout_s)
            piped, pipe = _overhead_run(graph, path, cluster, 2, timeout_s)
            # Each replica of the data-parallel run computes what the one rank did alone.
            twins, _ = _overhead_run(graph, path, cluster, 2, timeout_s, stages=1, replicas=2)
            rounds.append((round_overheads(alone, piped) | replica_overhead(alone, twins), piped))
        replicas, _ = _overhead_run(small, small_path, cluster, 2, timeout_s, stages=1)
    found = {
        k: statistics.median(r[k] for r, _ in rounds)
        for k in ("action_overhead_s", "overhead_s", "replica_contention")
    }
    contention = [r["contention_overhead_s"] for r, _ in rounds]
    # The round of the median contention tells its numbers (a round the host slowed reads high or
    # low: one reading 0.5 us where the rounds around it read 50-90 us).
    typical, piped = rounds[contention.index(statistics.median_low(contention))]
    floor = ring_link(cluster, cluster.devices()[:2]).latency
    model = pipeline_model(pipe, piped, found["action_overhead_s"], found["overhead_s"])
    latency = pipeline_latency(model, typical["iteration_s"], floor)
    # Data parallel: the gradients' all-reduce as a step runs it (the replica that reached it last
    # waits least), against the all-reduce the spec so far predicts for its size.
    in_step = min(r["allreduce_s"] for r in replicas)
    predicted = allreduce_time(GRADIENT_BYTES, 2, ring_link(cluster, cluster.devices()[:2]))
    return {
        "model": f"MLP {LAYERS} x MatMul {WIDTH}x{WIDTH} + Relu",
        "mini_batch": MINI_BATCH,
        "micro_batch": MICRO_BATCH,
        "steps": STEPS,
        "rounds": rounds_n,
        **typical,
        **found,
        "contention_per_round_s": contention,
        "replica_contention_per_round": [r["replica_contention"] for r, _ in rounds],
        "latency_floor_s": floor,
        "latency_s": latency,
        "allreduce_model": f"MLP {LAYERS} x MatMul {ALLREDUCE_WIDTH}x{ALLREDUCE_WIDTH} + Relu",
        "allreduce_bytes": GRADIENT_BYTES,
        "allreduce_in_step_s": in_step,
        "allreduce_predicted_s": predicted,
        "allreduce_overhead_s": max(in_step - predicted, 0.0),
    }


def round_overheads(alone: dict[str, Any], piped: list[dict[str, Any]]) -> dict[str, Any]:
    """One round's numbers from its one-rank run's row ``alone`` and its two-stage run's rows
    ``piped`` (medians over their steps): the time per action on neither compute nor the optimizer
    step (``action_overhead_s``), per message beyond that (``overhead_s``: the median over the
    ranks), and the two stages' compute beyond the one rank's, per action
    (``contention_overhead_s``)."""
    # With no peer, a rank never waits: its "wait" is the inputs' handling, part of every action.
    per_action = (alone["wait_s"] + alone["overhead_s"]) / alone["actions"]
    in_overhead = alone["overhead_s"] / alone["actions"]  # the part the two-stage runs count as overhead
    # Per message sent: a rank's overhead is its sends' (packing, handing to gloo, the yield to
    # gloo's thread); taking a message in is in its wait, which the receive_overhead and the
    # latency fitted to the step account for.
    per_message = [max(r["overhead_s"] - in_overhead * r["actions"], 0.0) / max(r["sent"], 1) for r in piped]
    # The same layers computed by two ranks at once take longer than by one alone: shared caches,
    # memory and cores (gloo's threads). Per action, as the simulator charges it.
    piped_busy = sum(r["busy_s"] for r in piped)
    return {
        "actions_per_step": alone["actions"],
        "action_overhead_s": per_action,
        "messages_per_step": [r["messages"] for r in piped],
        "sent_per_step": [r["sent"] for r in piped],
        "overhead_per_rank_s": per_message,
        "overhead_s": statistics.median(per_message),
        "busy_alone_s": alone["busy_s"],
        "busy_per_rank_s": [r["busy_s"] for r in piped],
        "contention_overhead_s": max(piped_busy - alone["busy_s"], 0.0) / sum(r["actions"] for r in piped),
        "iteration_s": statistics.median(r["iteration_s"] for r in piped),
    }


def replica_overhead(alone: dict[str, Any], twins: list[dict[str, Any]]) -> dict[str, Any]:
    """One round's replica contention: the slower of two data-parallel replicas, each computing
    what the one rank of ``alone`` computed, against that rank, as a fraction of its compute
    (``replica_contention``; none when the replicas were faster, a round the host slowed)."""
    busy = max(r["busy_s"] for r in twins)
    return {
        "busy_replicas_s": [r["busy_s"] for r in twins],
        "replica_contention": max(busy - alone["busy_s"], 0.0) / alone["busy_s"],
    }


def pipeline_model(
    pipe: Pipeline, rows: list[dict[str, Any]], action_overhead: float, overhead: float
) -> Callable[[float], float]:
    """The simulator's iteration of the two-stage run ``pipe`` as a function of the link latency,
    its stages computing, stepping and sending messages as its ranks' ``rows`` measured them (a
    receiver's time per message: its link's ``receive_overhead``)."""
    from tessera.planners.sim import simulate_pipeline

    by_stage = {r["stage"]: r for r in rows}
    stages = []
    for st in pipe.stages:
        r = by_stage[st.id]
        micro_batches = r["actions"] // 2
        own = r["iteration_s"] - r["busy_s"] - r["wait_s"] - r["overhead_s"] - r["allreduce_s"]
        stages.append(
            dataclasses.replace(
                st,
                forward_time=r["forward_busy_s"] / micro_batches,
                backward_time=(r["busy_s"] - r["forward_busy_s"]) / micro_batches,
                allreduce_time=0.0,
                step_time=max(own, 0.0),
                action_overhead=action_overhead,
            )
        )

    def predicted(latency: float) -> float:
        update = {"latency": latency, "overhead": overhead}
        edges = [
            e if e.link is None else dataclasses.replace(e, link=e.link.model_copy(update=update))
            for e in pipe.edges
        ]
        piped = dataclasses.replace(pipe, stages=stages, edges=edges)
        return simulate_pipeline(piped, trace=False).iteration_time

    return predicted


def pipeline_latency(predicted: Callable[[float], float], measured: float, floor: float) -> float:
    """The link latency, at least ``floor`` (the idle links' fit), with which ``predicted`` (see
    :func:`pipeline_model`) gives the ``measured`` iteration: the time a message keeps its
    receiver waiting in a pipeline, its wake-up included (docs/executor.md, "Calibrating this
    machine")."""
    low, high = floor, max(2 * floor, 1e-5)
    if predicted(low) >= measured:
        return floor
    while predicted(high) < measured and high < 1.0:
        low, high = high, 2 * high
    for _ in range(30):  # bisection: the iteration grows with the latency
        middle = (low + high) / 2
        low, high = (middle, high) if predicted(middle) < measured else (low, middle)
    return high


def _overhead_run(
    graph: Graph,
    path: Path,
    cluster: ClusterSpec,
    devices: int,
    timeout_s: float,
    *,
    stages: int | None = None,
    replicas: int = 1,
) -> tuple[list[dict[str, Any]], Pipeline]:
    """The ranks' rows of a launch of the MLP (``graph``, saved at ``path``) on ``devices`` devices
    as ``stages`` stages (default: one per device; one stage on several: data parallelism), and the
    pipeline planned. ``replicas``: the mini- and micro-batch that many times larger (a
    data-parallel run whose every replica computes what one rank alone does)."""
    from tessera.core.errors import LaunchError
    from tessera.executor.gpp_run import run_gpp_plan
    from tessera.executor.launcher import LaunchOptions
    from tessera.executor.training import TrainOptions
    from tessera.planners.pipeline.plan import plan_gpp
    from tessera.planners.pipeline.types import PartitionOptions

    options = PartitionOptions(
        mini_batch=MINI_BATCH * replicas,
        num_devices=devices,
        micro_batch_sizes=(MICRO_BATCH * replicas,),
        precision="fp32",
    )
    stages = devices if stages is None else stages
    whole = dataclasses.replace(options, num_devices=1)  # the whole model as one stage
    plan, pipe, _ = plan_gpp(graph, cluster, whole, kind="spp", baseline=False)
    if stages > 1:  # devices too small for the whole model (or a replica of it) split it
        limited = dataclasses.replace(options, memory_limit=0.6 * plan.stages[0].memory.peak)
        plan, pipe, _ = plan_gpp(graph, cluster, limited, kind="spp", baseline=False)
    elif devices > 1:  # the one stage replicated on every device: data parallelism
        ids = [d.id for d in cluster.devices()[:devices]]
        plan = plan.model_copy(update={"stages": [plan.stages[0].model_copy(update={"devices": ids})]})
    if len(plan.stages) != stages or sum(len(st.devices) for st in plan.stages) != devices:
        raise LaunchError(
            f"calibrate: planned {len(plan.stages)} stage(s) of the MLP on {devices} device(s), not {stages}"
        )
    run = run_gpp_plan(plan, graph, str(path), TrainOptions(steps=STEPS), LaunchOptions(timeout_s=timeout_s))
    stage_of = {r["rank"]: r["stage"] for r in run.ranks}
    return [
        {**_typical(steps), "stage": stage_of[rank]} for rank, steps in sorted(run.rank_steps.items())
    ], pipe


def _typical(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A rank's step: the median of each time over the counted steps (one step another process
    slows by milliseconds moves a mean of 12: an in-step all-reduce that one calibration read as
    0.8 ms, the next read as 4.5 ms), its actions and messages."""
    from tessera.executor.report import counted_steps

    kept = counted_steps(steps)
    keys = ("iteration_s", "busy_s", "forward_busy_s", "wait_s", "overhead_s", "allreduce_s")
    times = {k: statistics.median(s[k] for s in kept) for k in keys}
    return {
        **times,
        "actions": steps[0]["actions"],
        "messages": steps[0]["messages"],
        "sent": steps[0]["messages_sent"],
    }
