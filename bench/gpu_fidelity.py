"""Predictions on a GPU (issue #28's table, on a lent GPU machine): each model planned with
``tessera plan --profile`` for a one-GPU cluster (the operators measured for the search, then the
chosen plan's stages measured on this GPU as the executor runs them), launched, and its predicted
iteration set against the measured one. Run by ``bench/gpu_checks.sh fidelity``; results in
docs/gpu.md.

    python3 bench/gpu_fidelity.py --cluster h200 --out gpu_out/gpu_fidelity.md
    .venv/bin/python bench/gpu_fidelity.py --cluster local-cpu --quick   # the same on the CPU
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CORPUS = Path(".gl/corpus")  # exports of the corpus (tests/corpus), carried to the GPU machine
MODELS = [  # label, model (zoo:NAME:SIZE or an ONNX file), --input-shape, mini-batches
    ("gpt (zoo, tiny)", "zoo:gpt:tiny", None, (8, 32)),
    ("BERT export", str(CORPUS / "bert-legacy-dynamic.onnx"), "input_ids=1x16", (16, 64)),
    ("GPT-2 export", str(CORPUS / "gpt2-legacy-dynamic.onnx"), "input_ids=1x16", (16, 64)),
    ("ResNet export", str(CORPUS / "resnet-dynamo-dynamic.onnx"), "pixel_values=1x3x32x32", (16, 64)),
    ("ViT export", str(CORPUS / "vit-dynamo-dynamic.onnx"), "pixel_values=1x3x32x32", (16, 64)),
    ("bert (zoo, tiny)", "zoo:bert:tiny", None, (8, 32)),
    ("BERT-base (zoo, paper)", "zoo:bert:paper", None, (8, 32)),
]
STEPS = 20


def tessera(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python -m tessera ARGS``; past ``timeout`` seconds, exit 124 (as ``timeout(1)``)."""
    command = [sys.executable, "-m", "tessera", *args]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(command, 124, "", f"timed out after {timeout:.0f} s")


def model_file(source: str, folder: Path) -> Path | None:
    if not source.startswith("zoo:"):
        return Path(source) if Path(source).is_file() else None
    _, name, size = source.split(":")
    path = folder / f"{name}-{size}.onnx"
    if not path.exists() and tessera("zoo", "build", name, "--size", size, "-o", str(path)).returncode:
        return None
    return path


def one(label: str, path: Path, shape: str | None, batch: int, cluster: str, folder: Path) -> dict:
    plan = folder / f"{path.stem}-{batch}.json"
    args = ["plan", str(path), "--cluster", cluster, "--mini-batch", str(batch), "--profile"]
    args += ["--cache", str(folder / "profiles.sqlite"), "--no-baseline", "-o", str(plan)]
    start = time.perf_counter()
    planned = tessera(*args, *(["--input-shape", shape] if shape else []))
    row: dict = {"model": label, "mini_batch": batch, "plan_s": time.perf_counter() - start}
    if planned.returncode:
        return {**row, "error": f"plan exit {planned.returncode}: {planned.stderr.strip()[-300:]}"}
    launched = tessera("launch", str(plan), "--steps", str(STEPS), "--json")
    if launched.returncode:
        return {**row, "error": f"launch exit {launched.returncode}: {launched.stderr.strip()[-300:]}"}
    report = json.loads(launched.stdout)
    stages = json.loads(plan.read_text())["stages"]
    replicas = "x".join(str(len(st["devices"])) for st in stages)
    return {
        **row,
        "structure": f"{len(stages)} stage(s) on {replicas} device(s), micro-batch {stages[0]['micro_batch_size']}",
        "predicted_ms": report["fidelity"]["iteration"]["predicted_s"] * 1e3,
        "measured_ms": report["fidelity"]["iteration"]["measured_s"] * 1e3,
        "stages": report["fidelity"]["stages"],
    }


def render(rows: list[dict], cluster: str) -> str:
    lines = [
        f"# Predicted against launched on `{cluster}`",
        "",
        f"`plan --profile` then `launch --steps {STEPS}` (measured: the mean of steps 2..{STEPS}).",
        "",
        "| model | mini-batch | plan | predicted ms | measured ms | error | per stage busy measured/predicted ms |",
        "|---|---|---|---|---|---|---|",
    ]
    errors = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mini_batch']} | failed: {r['error']} | | | | |")
            continue
        error = r["measured_ms"] / r["predicted_ms"] - 1
        errors.append(abs(error))
        busy = "; ".join(
            f"{s['id']}: {s['busy']['measured_s'] * 1e3:.2f}/{(s['busy']['predicted_s'] or 0) * 1e3:.2f}"
            for s in r["stages"]
        )
        lines.append(
            f"| {r['model']} | {r['mini_batch']} | {r['structure']} | {r['predicted_ms']:.2f} | "
            f"{r['measured_ms']:.2f} | {error:+.0%} | {busy} |"
        )
    if errors:
        lines += [
            "",
            f"Mean |measured/predicted - 1| over {len(errors)} plans: {sum(errors) / len(errors):.0%}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="h200")
    parser.add_argument("--out", default="gpu_out/gpu_fidelity.md")
    parser.add_argument("--quick", action="store_true", help="the zoo's tiny models only")
    parser.add_argument("--only", help="comma-separated parts of model labels (default: every model)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for label, source, shape, batches in MODELS:
            if args.quick and not source.endswith(":tiny"):
                continue
            if args.only and not any(part in label for part in args.only.split(",")):
                continue
            path = model_file(source, folder)
            for batch in batches:
                if path is None:
                    rows.append(
                        {"model": label, "mini_batch": batch, "error": f"{source}: not found or built"}
                    )
                    continue
                rows.append(one(label, path, shape, batch, args.cluster, folder))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "stages"}), flush=True)
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(render(rows, args.cluster))


if __name__ == "__main__":
    main()
