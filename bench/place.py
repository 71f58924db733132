"""Placed (composite) models vs every single backend, and placement search time (Collage §5).

For each model — the zoo's tiny models, real torch.onnx exports (``bench/exports.py``: the corpus's
transformers models and CNNs, SqueezeNet 1.1) and the onnx wheel's "light" CNNs — in one process:

1. search a placement over onnxruntime + OpenVINO with a cold profile cache (a fresh file), then
   again with the warm cache (the second number is what a user sees on every later run);
2. time the placed model and each single backend running the whole model — onnxruntime, OpenVINO and
   TVM (untuned: TVM's default schedules) — interleaved in rounds, medians.

TVM is a baseline here, not a search backend: untuned, it is 10-100x slower than the others on these
models (see the table), so it never wins a group and its candidates cost seconds each to build.

    .venv/bin/python bench/place.py [MODEL ...]      # writes bench/results/place.md
"""

from __future__ import annotations

import logging
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import onnx
from exports import EXPORTS, export_path

from tessera.backends.composite import CompositeModel, latencies, random_feeds
from tessera.backends.measure import Measurer
from tessera.backends.profile_cache import ProfileCache
from tessera.backends.registry import default_registry
from tessera.core.files import write_atomic
from tessera.core.graph import Graph, load_graph
from tessera.models import build
from tessera.planners.placement import PlacementOptions, plan_placement

ZOO = ["mmt", "dlrm", "candle_uno", "resnext", "bert", "gpt"]
# Mid-size variants (tessera.models.build overrides), where layers are large enough for the backends'
# kernels, not their per-call costs, to decide.
MID = {
    "gpt_mid": (
        "gpt",
        {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 4, "ffn": 1024, "vocab": 8192, "seq": 64},
    ),
    "bert_mid": ("bert", {"layers": 4, "hidden": 256, "heads": 4, "ffn": 1024, "vocab": 8192, "seq": 64}),
    # multi-branch: two transformer towers, seven MLP towers (parallel branches)
    "mmt_mid": ("mmt", {"layers": 2, "seq": 64, "hidden": 256, "heads": 4, "ffn": 1024}),
    "candle_uno_mid": ("candle_uno", {"feature_dim": 512, "hidden": 512}),
}
LIGHT_DIR = Path(onnx.__file__).parent / "backend/test/data/light"
LIGHT = [
    "light_squeezenet",
    "light_shufflenet",
    "light_inception_v1",
    "light_bvlc_alexnet",
    "light_zfnet512",
    "light_vgg19",
    "light_resnet50",
    "light_inception_v2",
    "light_densenet121",
]
SEARCH_BACKENDS = ("onnxruntime", "openvino")
BASELINES = ("onnxruntime", "openvino", "tvm")
OUT = Path(__file__).parent / "results" / "place.md"


def ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 1e3:.3f}"


def load_model(name: str) -> Graph:
    """A benchmark model: a zoo model (tiny), a mid-size variant (MID), a real export (EXPORTS) or an
    onnx light model."""
    if name in MID:
        return load_graph(build(MID[name][0], "tiny", **MID[name][1]))
    if name in EXPORTS:
        return load_graph(export_path(name))
    return load_graph(build(name, "tiny") if name in ZOO else str(LIGHT_DIR / f"{name}.onnx"))


def run(
    default: list[str],
    rows_of: Callable[[str, Path], list[dict[str, object]]],
    render: Callable[[list[dict[str, object]]], str],
    out: Path,
) -> None:
    """Benchmark the models named on the command line (or ``default``), one profile-cache folder for
    the run; ``out`` is rewritten after each model, the table printed at the end."""
    logging.basicConfig(level=logging.ERROR)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in sys.argv[1:] or default:
            print(f"{name} ...", file=sys.stderr, flush=True)
            rows += rows_of(name, Path(tmp))
            write_atomic(out, render(rows))
    print(render(rows))


def bench(name: str, cache_dir: Path) -> dict[str, object]:
    graph = load_model(name)
    cache = ProfileCache(cache_dir / f"{name}.sqlite")
    options = PlacementOptions(backends=SEARCH_BACKENDS)
    t0 = time.perf_counter()
    plan_placement(graph, options, measurer=Measurer(cache))
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = plan_placement(graph, options, measurer=Measurer(cache))
    warm = time.perf_counter() - t0
    timings = result.report["timings"]
    plan = result.plan
    feeds = random_feeds(graph)
    registry = default_registry()
    # A one-group plan is that backend alone: it is timed once, as that backend.
    alone = plan.groups[0].backend if len(plan.groups) == 1 else None
    placed = CompositeModel(
        graph, [(g.backend, g.nodes) for g in plan.groups], registry=registry, concurrent=plan.concurrent
    )
    runs = {} if alone else {"placed": lambda: placed.run(feeds)}
    for b in BASELINES:
        try:
            single = CompositeModel(graph, [(b, graph.order)], registry=registry)
        except Exception as exc:  # noqa: BLE001
            logging.warning("%s cannot run %s: %s", b, name, exc)
            continue
        runs[b] = lambda s=single: s.run(feeds)
    lat = latencies(runs, rounds=9)
    lat["placed"] = lat[alone] if alone else lat["placed"]
    singles = {b: lat.get(b, math.inf) for b in BASELINES}
    correct = {b: b not in plan.measured.get("wrong_outputs", []) for b in SEARCH_BACKENDS}
    best = min((b for b in SEARCH_BACKENDS if correct[b]), key=lambda b: singles[b])
    searched = plan.measured["searched_placement_latency_s"]
    return {
        "name": name,
        "nodes": graph.num_nodes,
        "groups": len(plan.groups),
        "per_backend": {b: sum(len(g.nodes) for g in plan.groups if g.backend == b) for b in SEARCH_BACKENDS},
        "chosen": plan.search["chosen"],
        "predicted": plan.predicted["latency_s"],
        "placed": lat["placed"],
        "searched": searched,
        "dp_predicted": plan.predicted["op_level_latency_s"],
        "dp_groups": result.report["op_level_groups"],
        "singles": singles,
        "best": best,
        "ratio": singles[best] / lat["placed"],
        "searched_ratio": plan.measured["single_backend_latency_s"][best] / searched,
        "wrong": plan.measured.get("wrong_outputs", []),
        "cold": cold,
        "warm": warm,
        "warm_search": timings["candidates_s"] + timings["op_level_s"],
        "candidates": plan.search["candidates"],
    }


def render(rows: list[dict[str, object]]) -> str:
    lines = [
        "# Placement: composite model vs single backends",
        "",
        "Generated by `bench/place.py` (one process per run; medians of 9 interleaved rounds, each in its own",
        "seeded order). Latencies in ms.",
        "Search over onnxruntime + OpenVINO (op-level DP, `--search op`); TVM (untuned) is timed as a baseline.",
        "*ratio* = best correct single backend / placed model (≥ 1: the placement is as fast or faster); a",
        "one-group plan is that backend alone and is timed once, as that backend (ratio 1 or the gap to the best).",
        "`gpt_mid`/`bert_mid`: `build(name, 'tiny', layers=4, hidden=256, heads=4, ffn=1024, vocab=8192, seq=64)`;",
        "`mmt_mid`: `build('mmt', 'tiny', layers=2, seq=64, hidden=256, heads=4, ffn=1024)`; `candle_uno_mid`:",
        "`build('candle_uno', 'tiny', feature_dim=512, hidden=512)`. `export:MODEL:EXPORTER` = the real-model corpus's",
        "torch.onnx exports (static batch; `bench/exports.py`); `squeezenet` = SqueezeNet 1.1 (torchvision's",
        "architecture, Kaiming init) exported at 1x3x224x224. TVM `-`: TVM cannot build the model.",
        "*DP placement* = the op-level DP's own placement before the final choice (its groups, its predicted",
        "latency — Eq. 3: measured group costs + ε — and its latency measured during the search, with the ratio",
        "against the best single backend in that same measurement). The DP's candidates include regions up to",
        "the whole model (`region_candidates`), so a single-group DP placement is the DP choosing one backend.",
        "*search warm* = the whole `place` run",
        "with a warm cache (candidates + DP + the final interleaved timing); *DP warm* = candidates + DP only.",
        "The machine is a 2-core CPU VM, quiet during the run: expect ±10% noise.",
        "",
        "| model | nodes | ORT | OpenVINO | TVM | placed | ratio | chosen | DP groups | DP predicted | DP measured (ratio) "
        "| groups (ORT/OV ops) "
        "| search cold s | search warm s | DP warm s | candidates |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["singles"]
        wrong = f" (OV wrong: {','.join(r['wrong'])})" if r["wrong"] else ""
        pb = r["per_backend"]
        lines.append(
            f"| {r['name']} | {r['nodes']} | {ms(s['onnxruntime'])} | {ms(s['openvino'])}{wrong} | {ms(s['tvm'])} "
            f"| {ms(r['placed'])} | {r['ratio']:.2f} | {r['chosen']} | {r['dp_groups']} | {ms(r['dp_predicted'])} "
            f"| {ms(r['searched'])} ({r['searched_ratio']:.2f}) "
            f"| {r['groups']} ({pb['onnxruntime']}/{pb['openvino']}) | {r['cold']:.1f} | {r['warm']:.1f} "
            f"| {r['warm_search']:.2f} | {r['candidates']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    run(ZOO + list(MID) + EXPORTS + LIGHT, lambda name, cache_dir: [bench(name, cache_dir)], render, OUT)


if __name__ == "__main__":
    main()
