"""The last phase of ``tessera calibrate``: what the stage workers themselves cost beyond compute,
measured by running them on a small MLP (many micro-batches of a few samples, so actions and
messages are many and compute small): one rank as one stage (its time per action: the device's
``action_overhead``), two ranks as two pipeline stages (the time per message beyond that: the
link's ``overhead``), two ranks as one data-parallel stage (its all-reduce in a step beyond the
measured curve: the link's ``allreduce_overhead``). Details: docs/executor.md ("Calibrating this
machine").
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.core.cost import allreduce_time
from tessera.core.specs import ClusterSpec
from tessera.planners.pipeline.links import ring_link

if TYPE_CHECKING:
    from tessera.core.graph import Graph

WIDTH = 64
LAYERS = 4
MINI_BATCH = 32
MICRO_BATCH = 2
STEPS = 12
GRADIENT_BYTES = LAYERS * WIDTH * WIDTH * 4  # the MLP's fp32 weights


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


def measure_pipeline_overhead(cluster: ClusterSpec, timeout_s: float) -> dict[str, Any]:
    """Launch the MLP on the first devices of ``cluster``: on one rank as one stage, on two as a
    two-stage sequential pipeline, and on two as one data-parallel stage; return the workers' own
    time per action (the one-rank run's time on neither compute nor the optimizer step, over its
    actions), per message (the two-stage run's overhead beyond its actions' share, over its
    messages; the median over the ranks) and per in-step all-reduce beyond ``cluster``'s, with
    what was run."""
    from tessera.core.graph import load_graph

    with tempfile.TemporaryDirectory(prefix="tessera-calibrate-") as folder:
        path = Path(folder) / "mlp.onnx"
        path.write_bytes(mlp().SerializeToString())
        graph = load_graph(str(path))
        (alone,) = _overhead_run(graph, path, cluster, 1, timeout_s)
        piped = _overhead_run(graph, path, cluster, 2, timeout_s)
        replicas = _overhead_run(graph, path, cluster, 2, timeout_s, stages=1)
    # With no peer, a rank never waits: its "wait" is the inputs' handling, part of every action.
    per_action = (alone["wait_s"] + alone["overhead_s"]) / alone["actions"]
    in_overhead = alone["overhead_s"] / alone["actions"]  # the part the two-stage runs count as overhead
    per_message = [max(r["overhead_s"] - in_overhead * r["actions"], 0.0) / r["messages"] for r in piped]
    # Data parallel: the gradients' all-reduce as a step runs it (the replica that reached it last
    # waits least), against the all-reduce the spec so far predicts for its size.
    in_step = min(r["allreduce_s"] for r in replicas)
    predicted = allreduce_time(GRADIENT_BYTES, 2, ring_link(cluster, cluster.devices()[:2]))
    return {
        "model": f"MLP {LAYERS} x MatMul {WIDTH}x{WIDTH} + Relu",
        "mini_batch": MINI_BATCH,
        "micro_batch": MICRO_BATCH,
        "steps": STEPS,
        "actions_per_step": alone["actions"],
        "action_overhead_s": per_action,
        "messages_per_step": [r["messages"] for r in piped],
        "overhead_per_rank_s": per_message,
        "overhead_s": statistics.median(per_message),
        "allreduce_bytes": GRADIENT_BYTES,
        "allreduce_in_step_s": in_step,
        "allreduce_predicted_s": predicted,
        "allreduce_overhead_s": max(in_step - predicted, 0.0),
    }


def _overhead_run(
    graph: Graph,
    path: Path,
    cluster: ClusterSpec,
    devices: int,
    timeout_s: float,
    *,
    stages: int | None = None,
) -> list[dict[str, Any]]:
    """The ranks' rows of a launch of the MLP (``graph``, saved at ``path``) on ``devices`` devices
    as ``stages`` stages (default: one per device; one stage on several: data parallelism)."""
    from tessera.core.errors import LaunchError
    from tessera.executor.gpp_run import run_gpp_plan
    from tessera.executor.launcher import LaunchOptions
    from tessera.executor.training import TrainOptions
    from tessera.planners.pipeline.plan import plan_gpp
    from tessera.planners.pipeline.types import PartitionOptions

    options = PartitionOptions(
        mini_batch=MINI_BATCH, num_devices=devices, micro_batch_sizes=(MICRO_BATCH,), precision="fp32"
    )
    stages = devices if stages is None else stages
    plan, _, _ = plan_gpp(graph, cluster, options, kind="spp", baseline=False)
    if stages > 1:  # a device too small for the whole model (and so for data parallelism)
        limited = dataclasses.replace(options, memory_limit=0.7 * plan.stages[0].memory.peak)
        plan, _, _ = plan_gpp(graph, cluster, limited, kind="spp", baseline=False)
    elif devices > 1:  # the one stage replicated on every device: data parallelism
        ids = [d.id for d in cluster.devices()[:devices]]
        plan = plan.model_copy(update={"stages": [plan.stages[0].model_copy(update={"devices": ids})]})
    if len(plan.stages) != stages or sum(len(st.devices) for st in plan.stages) != devices:
        raise LaunchError(
            f"calibrate: planned {len(plan.stages)} stage(s) of the MLP on {devices} device(s), not {stages}"
        )
    run = run_gpp_plan(plan, graph, str(path), TrainOptions(steps=STEPS), LaunchOptions(timeout_s=timeout_s))
    return [_typical(steps) for _, steps in sorted(run.rank_steps.items())]


def _typical(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A rank's step: the median of each time over the counted steps (one step another process
    slows by milliseconds moves a mean of 12: an in-step all-reduce that one calibration read as
    0.8 ms, the next read as 4.5 ms), its actions and messages."""
    from tessera.executor.report import counted_steps

    kept = counted_steps(steps)
    times = {k: statistics.median(s[k] for s in kept) for k in ("wait_s", "overhead_s", "allreduce_s")}
    return {**times, "actions": steps[0]["actions"], "messages": steps[0]["messages"]}
