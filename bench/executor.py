"""The training executor against native PyTorch (issue #28): one rank's training step of a model's
ONNX export, run as ``tessera launch`` runs it (the torch.fx program generated from the ONNX,
``backends/torch_program.py``), against the same model trained natively in eager PyTorch: the same
transformers (or torch) module the export was made from, the same mini-batch, one thread, the same
loss (mean of squares of the output) and SGD step.

The corpus's models (``tests/corpus``: transformers' BERT, ViT, ResNet and GPT-2 from their configs,
a MobileNetV3-small-style CNN), both exporters. The two run in alternating rounds so that a slow
spell of this shared VM falls on both; each side's step is the median over its rounds' medians.
``--compile`` adds ``torch.compile`` of the program (inductor).

    .venv/bin/python bench/executor.py --compile  # writes bench/results/executor.md (~3 min)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from corpus.exports import entry, reference
from corpus.models import MODELS, VOCAB

from tessera.backends.torch_module import to_torch
from tessera.core.files import write_atomic
from tessera.core.graph import load_graph

OUT = Path(__file__).parent / "results" / "executor.md"
BATCH = 16
ROUNDS, STEPS = 5, 10  # per side: rounds of steps, alternating with the other side
CASES = [  # (corpus model, exporter)
    ("bert", "legacy"),
    ("bert", "dynamo"),
    ("resnet", "legacy"),
    ("resnet", "dynamo"),
    ("vit", "dynamo"),
    ("gpt2", "legacy"),
    ("mobilenetv3", "legacy"),
]


def _inputs(model: str, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    if MODELS[model].input == "input_ids":
        return torch.randint(0, VOCAB, (BATCH, *shape[1:]), generator=gen)
    return torch.randn(BATCH, *shape[1:], generator=gen)


def _trainer(
    module: torch.nn.Module, run: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], None]:
    """One training step: forward, loss = mean of squares of the output, backward, SGD step."""
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1e-9)

    def step(x: torch.Tensor) -> None:
        out = run(x)
        loss = (out * out).mean()
        float(loss.detach())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _round(step: Callable[[torch.Tensor], None], x: torch.Tensor) -> float:
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def case(model: str, exporter: str, compile_too: bool) -> dict:
    made = entry(model, exporter, "dynamic")
    if made.path is None:
        return {"model": model, "exporter": exporter, "error": made.error}
    native, _ = reference(model)  # eval mode: the export has no dropout either
    graph = load_graph(made.path, input_shapes={made.input: (BATCH, *made.shape[1:])})
    program = to_torch(graph.model, label=made.path)
    name = program.input_names[0]
    sides = {
        "native": _trainer(native, native),
        "tessera": _trainer(program, lambda x: program.run({name: x})[program.output_names[0]]),
    }
    if compile_too:
        compiled = to_torch(graph.model, label=made.path)
        compiled.compile_program()
        sides["tessera --compile"] = _trainer(
            compiled, lambda x: compiled.run({name: x})[compiled.output_names[0]]
        )
    x = _inputs(model, made.shape)
    for step in sides.values():  # warm-up (the allocator, inductor's compilation)
        for _ in range(3):
            step(x)
    rounds: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(ROUNDS):
        for side, step in sides.items():
            rounds[side].append(_round(step, x))
    ms = {side: statistics.median(r) * 1e3 for side, r in rounds.items()}
    return {"model": model, "exporter": exporter, "ms": ms, "error": None}


def render(rows: list[dict], compile_too: bool) -> str:
    extra = " | tessera --compile ms | ratio (compile)" if compile_too else ""
    lines = [
        "# The training executor against native PyTorch (CPU, one thread)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread. "
        f"One training step (forward, mean-of-squares loss, backward, SGD) at mini-batch {BATCH}: "
        "'native' = the transformers/torch module the corpus exported, in eager PyTorch; 'tessera' = the "
        "torch.fx program `tessera launch` generates from its ONNX export. Median over "
        f"{ROUNDS} alternating rounds of the median of {STEPS} steps. Ratio = tessera / native "
        "(the issue's bound: 1.15).",
        "",
        "Generated by `.venv/bin/python bench/executor.py" + (" --compile`." if compile_too else "`."),
        "",
        f"| model | exporter | native ms | tessera ms | ratio{extra} |",
        "|---|---|---|---|---|" + ("---|---|" if compile_too else ""),
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['model']} | {r['exporter']} | export failed: {r['error'][:80]} | | |")
            continue
        ms = r["ms"]
        cells = f"{ms['native']:.2f} | {ms['tessera']:.2f} | {ms['tessera'] / ms['native']:.2f}x"
        if compile_too:
            cells += f" | {ms['tessera --compile']:.2f} | {ms['tessera --compile'] / ms['native']:.2f}x"
        lines.append(f"| {r['model']} | {r['exporter']} | {cells} |")
    ratios = [r["ms"]["tessera"] / r["ms"]["native"] for r in rows if not r["error"]]
    lines += ["", f"Ratio from {min(ratios):.2f}x to {max(ratios):.2f}x over {len(ratios)} exports.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="also torch.compile of the program")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for model, exporter in CASES:
        rows.append(case(model, exporter, args.compile))
        print(rows[-1], file=sys.stderr, flush=True)
    write_atomic(OUT, render(rows, args.compile))
    print(OUT.read_text())


if __name__ == "__main__":
    main()
