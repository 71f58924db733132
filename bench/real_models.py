"""Real exports end to end (issue #26): the corpus of tests/corpus (transformers models and a
MobileNetV3-style CNN exported by torch.onnx's legacy and dynamo exporters, dynamic batch).

Per export, in one run: FLOPs tessera counts against torch's FlopCounterMode of the same forward;
``place`` (onnxruntime, OpenVINO) against the best single backend, measured in the same process;
a 1-stage training plan on 2 gloo ranks (local-cpu-split) launched for a few steps, its predicted
against measured iteration; and whether its losses equal single-process training's (1e-5).

    .venv/bin/python bench/real_models.py        # writes bench/results/real_models.md
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from cli_runner import run_cli
from corpus.exports import ENTRIES, entry

from tessera.core.files import write_atomic
from tessera.core.graph import load_graph
from tessera.core.specs import load_cluster
from tessera.executor.gpp_run import run_gpp_plan
from tessera.executor.launcher import LaunchOptions
from tessera.executor.training import TrainOptions, train_reference
from tessera.planners.pipeline.plan import pipeline_options, plan_gpp

OUT = Path(__file__).parent / "results" / "real_models.md"
STEPS, MINI_BATCH = 4, 4


def row(key: tuple[str, str, str], cache: Path) -> dict:
    made = entry(*key)
    if made.path is None:
        return {"name": made.name, "error": made.error}
    shape = f"{made.input}={'x'.join(map(str, made.shape))}"
    inspected = json.loads(run_cli("inspect", made.path, "--input-shape", shape, "--json").out)
    placed = run_cli(
        "place", made.path, "--input-shape", shape, "--backends", "onnxruntime,openvino",
        "--cache", str(cache), "--verify", "--json",
    )  # fmt: skip
    measured = json.loads(placed.out)["plan"]["measured"]
    graph = load_graph(made.path, input_shapes={made.input: (1, *made.shape[1:])})
    cluster = load_cluster("local-cpu-split")
    plan, _, _ = plan_gpp(graph, cluster, pipeline_options(cluster, mini_batch=MINI_BATCH), baseline=False)
    options = TrainOptions(steps=STEPS, lr=0.05, seed=1)
    run = run_gpp_plan(plan, graph, made.path, options, LaunchOptions(timeout_s=120))
    reference = train_reference(graph, STEPS, MINI_BATCH, seed=1, lr=0.05)
    report = run.to_json()
    return {
        "name": made.name,
        "nodes": inspected["nodes"],
        "flops": inspected["flops"],
        "torch_flops": made.torch_flops,
        "placed_ms": measured["latency_s"] * 1e3,
        "best_single": measured["best_single_backend"],
        "best_single_ms": measured["single_backend_latency_s"][measured["best_single_backend"]] * 1e3,
        "place_ok": placed.code == 0,
        "predicted_ms": report["predicted"]["iteration_time_s"] * 1e3,
        "measured_ms": report["measured"]["iteration_time_s"] * 1e3,
        "exact": bool(np.allclose(run.losses, reference.losses, rtol=1e-5)),
    }


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for key in [e for e in ENTRIES if e[2] == "dynamic"]:
            rows.append(row(key, Path(scratch) / "profiles.sqlite"))
            print(rows[-1], flush=True)
    lines = [
        "# Real exports end to end",
        "",
        "`bench/real_models.py`: the corpus of `tests/corpus` (dynamic batch), on this machine (2 CPU cores).",
        "FLOPs at batch 2 against torch's `FlopCounterMode` of the same forward; `place` with onnxruntime and",
        "OpenVINO against the best single backend, measured in the same process; a 1-stage plan on 2 gloo",
        f"ranks (`local-cpu-split`, mini-batch {MINI_BATCH}, {STEPS} steps): predicted (roofline) against measured",
        "iteration, and whether its losses equal single-process training's (rtol 1e-5).",
        "",
        "| export | nodes | FLOPs | torch FLOPs | ratio | placed ms | best single | ratio | predicted ms | measured ms | measured/predicted | exact |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | exporter failed: {r['error'][:90]} |||||||||||")
            continue
        lines.append(
            f"| {r['name']} | {r['nodes']} | {r['flops']:,} | {r['torch_flops']:,} | {r['flops'] / r['torch_flops']:.3f} "
            f"| {r['placed_ms']:.3f} | {r['best_single']} {r['best_single_ms']:.3f} | {r['best_single_ms'] / r['placed_ms']:.2f} "
            f"| {r['predicted_ms']:.2f} | {r['measured_ms']:.2f} | {r['measured_ms'] / r['predicted_ms']:.1f}x "
            f"| {'yes' if r['exact'] else 'NO'} |"
        )
    write_atomic(OUT, "\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
