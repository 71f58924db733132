"""The last phase of ``tessera calibrate``: the stage workers' own cost per message, measured by
running them. Two ranks train a small MLP cut into two pipeline stages (1F1B, many micro-batches
of a few samples, so messages are many and compute small) and report per step the time their
actions spend on neither compute nor waiting, and the messages they send and receive; that time
per message is the spec's link ``overhead``. Details: docs/executor.md ("Calibrating this machine").
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tessera.core.specs import ClusterSpec

WIDTH = 64
LAYERS = 4
MINI_BATCH = 32
MICRO_BATCH = 2
STEPS = 12


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
    """Launch the MLP on one rank as one stage, then on two as a two-stage sequential pipeline
    (the first devices of ``cluster``), and return the workers' own time per action (the one-rank
    run's time on neither compute nor the optimizer step, over its actions) and per message (the
    two-rank run's overhead beyond its actions' share, over its messages; the median over the
    ranks), with what was run."""
    (alone,) = _overhead_run(cluster, 1, timeout_s)
    # With no peer, a rank never waits: its "wait" is the inputs' handling, part of every action.
    per_action = (alone["wait_s"] + alone["overhead_s"]) / alone["actions"]
    in_overhead = alone["overhead_s"] / alone["actions"]  # the part the two-stage runs count as overhead
    piped = _overhead_run(cluster, 2, timeout_s)
    per_message = [max(r["overhead_s"] - in_overhead * r["actions"], 0.0) / r["messages"] for r in piped]
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
    }


def _overhead_run(cluster: ClusterSpec, devices: int, timeout_s: float) -> list[dict[str, Any]]:
    """The ranks' rows of a launch of the MLP on ``devices`` devices (two: as two stages)."""
    from tessera.core.errors import LaunchError
    from tessera.core.graph import load_graph
    from tessera.executor.gpp_run import run_gpp_plan
    from tessera.executor.launcher import LaunchOptions
    from tessera.executor.training import TrainOptions
    from tessera.planners.pipeline.plan import plan_gpp
    from tessera.planners.pipeline.types import PartitionOptions

    with tempfile.TemporaryDirectory(prefix="tessera-calibrate-") as folder:
        path = Path(folder) / "mlp.onnx"
        path.write_bytes(mlp().SerializeToString())
        graph = load_graph(str(path))
        options = PartitionOptions(
            mini_batch=MINI_BATCH, num_devices=devices, micro_batch_sizes=(MICRO_BATCH,), precision="fp32"
        )
        plan, _, _ = plan_gpp(graph, cluster, options, kind="spp", baseline=False)
        if devices > 1:  # two stages: a device too small for the whole model (and so for data parallelism)
            limited = dataclasses.replace(options, memory_limit=0.7 * plan.stages[0].memory.peak)
            plan, _, _ = plan_gpp(graph, cluster, limited, kind="spp", baseline=False)
        if len(plan.stages) != devices:
            raise LaunchError(
                f"calibrate: planned {len(plan.stages)} stage(s) of the MLP on {devices} device(s)"
            )
        run = run_gpp_plan(
            plan, graph, str(path), TrainOptions(steps=STEPS), LaunchOptions(timeout_s=timeout_s)
        )
    return run.to_json()["ranks"]
