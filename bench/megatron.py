"""tessera's 3D plans against Megatron-LM's published configurations, on one cost model.

The GPT models of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC'21), Table 1 (A100 GPUs, 8 a node; sequence 2,048, vocabulary 51,200; the
tensor- and pipeline-parallel sizes and batch sizes as its reproduction script
``examples/sc21/run_table_1.sh`` in NVIDIA/Megatron-LM sets them), built lazily, each planned on the
``dgx-a100`` preset extended to the row's GPU count, mini-batch = the row's global batch, ZeRO off (the
paper's runs predate the distributed optimizer):

- **Megatron's shape**: ``--tensor-parallel t --stages p`` (data parallelism fills the rest), full
  recomputation as the paper's runs; stage boundaries and micro-batch chosen by tessera;
- **tessera's own**: ``--tensor-parallel auto`` with the same full recomputation: the tensor-parallel
  degree, stages and replicas chosen.

Both are simulated on tessera's roofline cost model of the A100 (not measured). Beside them, the
throughput Megatron measured on Selene, converted from its published aggregate PFLOP/s with the
paper's own FLOPs count per sequence (its eq. 3, recomputation included).

    .venv/bin/python bench/megatron.py    # writes bench/results/megatron.md
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from scale import generated, point_process, preset_cluster, timed_plan, write_result  # noqa: E402

SEQ, VOCAB, PER_NODE = 2048, 51200, 8
# Table 1: name -> (heads, hidden, layers, t, p, GPUs, global batch, published aggregate PFLOP/s)
TABLE_1 = {
    "18.4B": (48, 6144, 40, 8, 1, 256, 1024, 34.6),
    "39.1B": (64, 8192, 48, 8, 2, 512, 1536, 70.8),
    "76.1B": (80, 10240, 60, 8, 4, 1024, 1792, 143.8),
    "145.6B": (96, 12288, 80, 8, 8, 1536, 2304, 227.1),
    "310.1B": (128, 16384, 96, 8, 16, 1920, 2160, 297.4),
    "529.6B": (128, 20480, 105, 8, 35, 2520, 2520, 410.2),
    "1008.0B": (160, 25600, 128, 8, 64, 3072, 3072, 502.0),
}


def flops_per_sequence(hidden: int, layers: int) -> float:
    """The paper's eq. 3 for one sequence: 96·s·l·h²·(1 + s/(6h) + V/(16·l·h)) (with recomputation)."""
    return 96 * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def point(name: str, which: str) -> dict:
    """One plan, timed in this process (run as ``--point NAME megatron|tessera``)."""
    from tessera.core.graph import load_graph
    from tessera.models.gpt import GPTConfig, build_gpt
    from tessera.planners.pipeline.plan import pipeline_options
    from tessera.planners.pipeline.search import micro_batch_candidates

    heads, hidden, layers, t, p, gpus, batch, _ = TABLE_1[name]
    config = GPTConfig(
        layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=VOCAB, seq=SEQ
    )
    graph = load_graph(build_gpt(config, lazy=True))
    cluster = preset_cluster("dgx-a100", gpus)
    shape = (
        {"tensor_parallel": t, "stages": p, "recompute": "all"}
        if which == "megatron"
        else {"tensor_parallel": "auto", "recompute": "all"}
    )
    opts = pipeline_options(cluster, mini_batch=batch, devices=gpus, zero=0, **shape)
    if not micro_batch_candidates(opts):  # 2,520 sequences: 315 micro-batches of 8, past the default 256
        opts = dataclasses.replace(opts, max_micro_batches=2 * opts.max_micro_batches)
    return timed_plan(graph, cluster, opts)


def main() -> None:
    rows = {}
    for name in TABLE_1:
        rows[name] = {which: point_process(__file__, name, which) for which in ("megatron", "tessera")}
        print(name, json.dumps(rows[name]), flush=True)
    write(rows)


def _cell(r: dict, base: float | None) -> str:
    if "error" in r:
        return f"— ({r['error'][:80]})"
    ratio = f" ({r['throughput'] / base:.2f}×)" if base else ""
    replicas = "/".join(map(str, r["replicas"]))
    return (
        f"{r['throughput']:,.1f}{ratio} — {r['stages']} × {replicas} × {r['tensor_parallel']}, "
        f"micro-batch {r['micro_batch']}, {r['recompute']}/{r['stages']} recomputed — {r['seconds']:.1f} s"
    )


def write(rows: dict[str, dict[str, dict]]) -> None:
    lines = [
        "# tessera's 3D plans against Megatron-LM's published configurations",
        "",
        generated(__file__),
        "GPT models of Megatron-LM's SC'21 paper, Table 1 (sequence 2,048, vocabulary 51,200; t, p and",
        "the global batch as its `run_table_1.sh` sets them), built lazily, on `dgx-a100` nodes (8",
        "A100-80GB, NVLink) extended to the row's GPUs, ZeRO off. Simulated on tessera's roofline cost",
        "model (sequences/s), not measured. *Megatron's shape*: `--tensor-parallel t --stages p",
        "--recompute all` (stage boundaries, replicas and micro-batch by tessera); *tessera*:",
        "`--tensor-parallel auto --recompute all`; 529.6B's 2,520 sequences plan with up to 512",
        "micro-batches (the default's 256 have no power-of-two micro-batch dividing them). *Published*: Megatron's measured aggregate",
        "PFLOP/s on Selene over the paper's FLOPs per sequence (eq. 3). Cells: sequences/s (× Megatron's",
        "shape) — stages × replicas × t, micro-batch, stages recomputed — planning seconds.",
        "",
        "| model | GPUs | Megatron t × p × d | published seq/s | Megatron's shape, simulated | tessera, simulated |",
        "| --- | ---: | --- | ---: | --- | --- |",
    ]
    for name, got in rows.items():
        heads, hidden, layers, t, p, gpus, batch, pflops = TABLE_1[name]
        published = pflops * 1e15 / flops_per_sequence(hidden, layers)
        base = got["megatron"].get("throughput")
        lines.append(
            f"| {name} ({layers} × {hidden:,}) | {gpus:,} | {t} × {p} × {gpus // (t * p)} | {published:,.1f} | "
            f"{_cell(got['megatron'], None)} | {_cell(got['tessera'], base)} |"
        )
    write_result("megatron.md", lines)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--point":
        print(json.dumps(point(sys.argv[2], sys.argv[3])))
    else:
        main()
