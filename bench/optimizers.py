"""Predicted against launched iteration time per optimizer and loss (``plan --profile --optimizer``).

For each model (the zoo's tiny MMT and GPT, and the corpus's GPT-2 export), a plan at mini-batch 8
is profiled with each optimizer (SGD, AdamW), clipping to a global norm, and launched with them (20
steps), in three rounds of plan-then-launch (the error: the median of the rounds'); the decoders also train on a token file with cross-entropy
(``--loss ce``), from a plan profiled with ``--loss ce``. Two layouts: one device (``local-cpu``: no messages, so the error is the
stage's compute, its optimizer step and the loss) and two stages on the spec ``tessera calibrate``
writes in the same run (``--stages 2``: the messages, and the clipping norm's all-reduce, too).
Both charge the clipping: its pass in each stage's measured step, its all-reduce in the simulation.

    .venv/bin/python bench/optimizers.py        # writes bench/results/optimizers.md (~20 min)
"""

from __future__ import annotations

import itertools
import json
import platform
import sys
import tempfile
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import torch
from cli_runner import run_cli
from corpus.exports import entry

from tessera.backends.base import cpu_model
from tessera.core.files import write_atomic
from tessera.core.graph import load_graph
from tessera.models import build
from tessera.planners.cp.recognize import recognize_decoder

OUT = Path(__file__).parent / "results" / "optimizers.md"
STEPS, ROUNDS = 20, 3


def _models(work: Path) -> dict[str, tuple[Path, bool]]:
    """name -> (model file, whether it is a decoder of token ids)."""
    models = {}
    for name in ("mmt", "gpt"):
        path = work / f"{name}.onnx"
        path.write_bytes(build(name, "tiny", seed=0).SerializeToString())
        models[name] = (path, name == "gpt")
    made = entry("gpt2", "dynamo", "dynamic")
    if made.path is not None:
        models["gpt2 (export)"] = (Path(made.path), True)
    return models


def _vocab(model: Path) -> int:
    """The rows of the table the token ids index."""
    return recognize_decoder(load_graph(str(model))).config.vocab


def _tokens(work: Path, vocab: int) -> Path:
    path = work / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, vocab, size=1 << 16, dtype=np.int64))
    return path


def _launch(plan: Path, *args: str) -> float:
    """The launch's median step."""
    run = run_cli("launch", str(plan), "--steps", str(STEPS), "--json", *args)
    assert run.code == 0, run.err
    return float(json.loads(run.out)["measured"]["iteration_median_s"])


def _calibrated(work: Path) -> Path:
    spec = work / "calibrated.yaml"
    made = run_cli("calibrate", "-o", str(spec))
    assert made.code == 0, made.err
    return spec


def main() -> None:
    rows: dict[tuple[str, str, str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        layouts = {
            "1 device": ["--cluster", "local-cpu"],
            "2 stages": ["--cluster", str(_calibrated(work)), "--stages", "2"],
        }
        models = _models(work)
        # Rounds: every row planned (a profile of its own, in a fresh cache) and launched right after,
        # once per round, the rows in turn; the error is the median over the rounds of each round's
        # launch against its own plan, so a minute the host ran slow or fast moves one pair, not a row.
        for round_ in range(ROUNDS):
            for name, (model, decoder) in models.items():
                shapes = ["--input-shape", "input_ids=8x32"] if name == "gpt2 (export)" else []
                cases = [("sgd", "mse"), ("adamw", "mse")] + ([("adamw", "ce")] if decoder else [])
                for (layout, where), (optimizer, loss) in itertools.product(layouts.items(), cases):
                    plan = work / f"{name}-{layout}-{optimizer}-{loss}.json"
                    made = run_cli("plan", str(model), *shapes, *where, "--mini-batch", "8", "--profile",
                                   "--cache", str(work / f"p{round_}.sqlite"), "--optimizer", optimizer,
                                   "--loss", loss, "--max-grad-norm", "1.0", "--no-baseline", "-o", str(plan))  # fmt: skip
                    assert made.code == 0, made.err
                    predicted = json.loads(plan.read_text())["predicted"]["iteration_time_s"]
                    extra = (
                        ["--data", str(_tokens(work, _vocab(model))), "--loss", "ce"] if loss == "ce" else []
                    )
                    measured = _launch(plan, "--optimizer", optimizer, "--max-grad-norm", "1.0", *extra)
                    rows.setdefault((name, layout, optimizer, loss), []).append((predicted, measured))
                    print(round_, name, layout, optimizer, loss, predicted, measured, flush=True)
    write(rows)


def write(rows: dict[tuple[str, str, str, str], list[tuple[float, float]]]) -> None:
    """The results table of ``rows``: (model, plan, optimizer, loss) -> each round's (predicted,
    measured) seconds."""
    lines = [
        "# Predicted against launched, per optimizer and loss",
        "",
        f"Measured on {platform.machine()} ({cpu_model()}), {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"Python {platform.python_version()}, {date.today()}; mini-batch 8, `plan --profile --optimizer --max-grad-norm 1.0` on "
        "`local-cpu` (one device) or with `--stages 2` on the spec `tessera calibrate` wrote in the same run, "
        f"then `launch --steps {STEPS} --max-grad-norm 1.0` with that optimizer (its median step), in "
        f"{ROUNDS} rounds: each round plans every row afresh (a cold profile cache) and launches it right "
        "after; predicted and measured are the medians over the rounds, the error the median of each "
        "round's launch against its own plan. `ce` rows are planned with `--loss ce` (the profile scores the logits by "
        "cross-entropy) and train on a token file with it. Regenerate with `.venv/bin/python bench/optimizers.py`.",
        "",
        "| model | plan | optimizer | loss | predicted ms | measured ms | error | spread of the rounds' errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    errors: dict[str, list[float]] = {}
    all_errors = []
    for (name, layout, optimizer, loss), pairs in rows.items():
        each = [m / p - 1 for p, m in pairs]
        error = float(np.median(each))
        all_errors.append(error)
        errors.setdefault(layout, []).append(abs(error))
        predicted, measured = (float(np.median([pair[i] for pair in pairs])) for i in (0, 1))
        lines.append(
            f"| {name} | {layout} | {optimizer} | {loss} | {predicted * 1e3:.3f} | {measured * 1e3:.3f} | "
            f"{error:+.1%} | {min(each):+.1%} .. {max(each):+.1%} |"
        )
    for layout, found in errors.items():
        lines += ["", f"{layout}: mean |error| {np.mean(found):.1%}, largest {max(found):.1%}."]
        trained = [abs(e) for (*_, where, o, loss), e in zip(rows, all_errors, strict=True) if where == layout
                   and (o, loss) != ("sgd", "mse")]  # fmt: skip
        lines.append(f"{layout}, AdamW or cross-entropy rows: mean |error| {np.mean(trained):.1%}.")
    write_atomic(OUT, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
