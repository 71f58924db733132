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
    """Plan the MLP as a two-stage sequential pipeline on the first two devices of ``cluster``,
    launch it, and return the workers' overhead per message (the median over ranks of their
    steady per-step overhead over their messages per step) with what it was measured on."""
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
            mini_batch=MINI_BATCH, num_devices=2, micro_batch_sizes=(MICRO_BATCH,), precision="fp32"
        )
        whole, _, _ = plan_gpp(graph, cluster, options, kind="spp", baseline=False)
        # Two stages: a device too small for the whole model (and so for data parallelism).
        limited = dataclasses.replace(options, memory_limit=0.7 * whole.stages[0].memory.peak)
        plan, _, _ = plan_gpp(graph, cluster, limited, kind="spp", baseline=False)
        if len(plan.stages) != 2:
            raise LaunchError(f"calibrate: the pipeline phase planned {len(plan.stages)} stage(s), not 2")
        run = run_gpp_plan(
            plan, graph, str(path), TrainOptions(steps=STEPS), LaunchOptions(timeout_s=timeout_s)
        )
    ranks = run.to_json()["ranks"]
    per_message = [r["overhead_s"] / r["messages"] for r in ranks if r["messages"]]
    return {
        "model": f"MLP {LAYERS} x MatMul {WIDTH}x{WIDTH} + Relu, 2 stages (1F1B)",
        "mini_batch": MINI_BATCH,
        "micro_batch": MICRO_BATCH,
        "steps": STEPS,
        "messages_per_step": [r["messages"] for r in ranks],
        "overhead_per_rank_s": per_message,
        "overhead_s": statistics.median(per_message),
    }
