"""Tensor-parallel stages in plans at scale: the 70B-parameter Llama-shaped decoder of
``bench/scale.py`` on DGX A100 nodes (8 A100-80GB each) extended to N devices, one sequence of
2,048 tokens per device, ``--zero 1 --recompute all``, planned with ``--tensor-parallel`` 1 (pipeline
× data parallelism), 2, 4, 8 and ``auto``, side by side: the simulated throughput (sequences/s, the
ratio to t = 1), the plan's shape, the planning time and the planning process's peak memory. Each
point runs in a process of its own.

    .venv/bin/python bench/tensor_parallel.py             # writes bench/results/tensor_parallel.md
    .venv/bin/python bench/tensor_parallel.py --largest 256
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from scale import (  # noqa: E402
    LLAMA70,
    cluster_of,
    generated,
    model_of,
    point_process,
    timed_plan,
    write_result,
)

DEVICES = (64, 256, 1024, 4096, 16384)
DEGREES = ("1", "2", "4", "8", "auto")


def point(n: int, t: str) -> dict:
    """One plan, timed in this process (run as ``--point N T``)."""
    from tessera.planners.pipeline.plan import pipeline_options

    cluster = cluster_of(LLAMA70, n)
    options = pipeline_options(cluster, mini_batch=n, devices=n, zero=1, recompute="all", tensor_parallel=t)
    return timed_plan(model_of(LLAMA70), cluster, options)


def main(largest: int) -> None:
    rows: dict[int, dict[str, dict]] = {}
    for n in DEVICES:
        if n > largest:
            break
        rows[n] = {}
        for t in DEGREES:
            got = rows[n][t] = point_process(__file__, str(n), t)
            print(n, t, json.dumps(got), flush=True)
    if largest >= DEVICES[-1]:
        write(rows)


def write(rows: dict[int, dict[str, dict]]) -> None:
    lines = [
        "# Tensor-parallel stages at scale",
        "",
        generated(__file__),
        "Llama-70B-shaped decoder (80 layers of 8,192, GQA 64/8, SwiGLU 28,672, vocabulary 32,000,",
        "sequence 2,048; built lazily) on DGX A100 nodes (8 A100-80GB each, NVLink within a node), one",
        "sequence per device, `tessera plan --zero 1 --recompute all --no-baseline --tensor-parallel T`.",
        "Simulated on tessera's roofline cost model (not measured on GPUs). Cells: sequences/s",
        "(× the t = 1 plan's) — stages × replicas × t — planning seconds / peak MiB.",
        "",
        "| devices | " + " | ".join(f"t = {t}" for t in DEGREES) + " |",
        "| ---: | " + " | ".join("---" for _ in DEGREES) + " |",
    ]
    for n, by_t in rows.items():
        base = by_t.get("1", {}).get("throughput")
        cells = []
        for t in DEGREES:
            r = by_t[t]
            if "error" in r:
                cells.append(f"— ({r['error'][:60]})")
                continue
            ratio = f" ({r['throughput'] / base:.2f}×)" if base else ""
            cells.append(
                f"{r['throughput']:,.1f}{ratio} — {r['stages']} × {max(r['replicas'])} × {r['tensor_parallel']} — "
                f"{r['seconds']:.1f} s / {r['peak_rss_bytes'] / 2**20:.0f}"
            )
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "`auto` plans every degree dividing a node's 8 devices and keeps the fastest as simulated.",
        "Megatron-LM's published configurations (tensor × pipeline × data for a model and GPU count)",
        "beside tessera's own plans on the same cost model: `bench/results/megatron.md`.",
    ]
    write_result("tensor_parallel.md", lines)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--point":
        print(json.dumps(point(int(sys.argv[2]), sys.argv[3])))
    elif len(sys.argv) == 3 and sys.argv[1] == "--largest":
        main(int(sys.argv[2]))
    else:
        main(DEVICES[-1])
