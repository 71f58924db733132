"""``tessera launch`` of cp plans against transformers' own ``generate()``, side by side in one run.

Every decoder of the real-export corpus (``tests/corpus``: transformers models with seeded random
weights, exported by torch.onnx), and a larger Llama-style export (4 layers, hidden 256, GQA 8/2,
vocab 8192) at batch 1 and 8, prompts 128 and 1024. For each: transformers' ``generate()`` of the
same weights (greedy, its dynamic KV cache and its static one, eager, one thread), then ``tessera
plan --kind cp`` and ``tessera launch`` of the export for dp x1, cp x2 and tp x2 on the
``local-cpu-split`` cluster (one core per rank; ``--calibrate``: on a spec ``tessera calibrate``
measures at the start of the run, as a user plans; ``--profile``: each plan made with ``plan
--profile``, the model's own decode step timed). Per-token latency is the mean decode step after the
prefill; the table gives it as a ratio to transformers' faster cache, the plan's predicted
per-token latency and its error, and whether tessera's tokens equal the export's own greedy tokens
(onnxruntime running the whole graph, no cache: the reference the tests use) and transformers'.

    .venv/bin/python bench/decode.py            # writes bench/results/decode.md
    .venv/bin/python bench/decode.py --quick    # corpus decoders only
    .venv/bin/python bench/decode.py --compiled-only   # corpus decoders, launch --compile of plans
                                                       # made with --compile (bench/results/decode_compiled.md)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from corpus.exports import ENTRIES, _export, build_corpus, cache_dir
from corpus.models import MODELS, _PlainLogits, _rescaled

from tessera.core.files import write_atomic

OUT = Path(__file__).parent / "results" / "decode.md"
OUT_COMPILED = Path(__file__).parent / "results" / "decode_compiled.md"
TESSERA = [sys.executable, "-m", "tessera"]
STRATEGIES = (("dp", 1), ("cp", 2), ("tp", 2))
NEW_TOKENS = 32
LAUNCHES = 3  # launches of each plan; the table keeps the fastest


def prompts_of(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, size=(batch, length)).tolist()


def hf_per_token(
    model: torch.nn.Module, prompts: list[list[int]], new: int, cache: str
) -> tuple[float, list]:
    """Seconds per decode step of ``generate()`` (the best of three runs of ``new`` tokens less one of 2
    tokens, over the steps between) and its tokens; ``cache``: ``dynamic`` or ``static``."""
    ids = torch.tensor(prompts)
    extra = {"cache_implementation": "static"} if cache == "static" else {}

    def run(n: int) -> tuple[float, torch.Tensor]:
        best, out = float("inf"), None
        for _ in range(3):
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0, **extra,
                )  # fmt: skip
            best = min(best, time.perf_counter() - t0)
        return best, out

    short, _ = run(2)
    full, out = run(new)
    return (full - short) / (new - 2), out[:, ids.shape[1] :].tolist()


def tessera_run(
    path: str,
    prompts: list[list[int]],
    new: int,
    strategy: str,
    degree: int,
    work: Path,
    *,
    compile_: bool = False,
    planning: tuple[str, ...] = ("--cluster", "local-cpu-split"),
) -> dict:
    """``tessera plan --kind cp`` (with ``planning``: the cluster, ``--profile``) then ``tessera
    launch --json`` of ``path`` on ``prompts``, the fastest of ``LAUNCHES`` launches."""
    lines = work / "prompts.txt"
    lines.write_text("".join(" ".join(map(str, p)) + "\n" for p in prompts))
    plan = work / f"{strategy}{degree}.json"
    planned = subprocess.run(
        [*TESSERA, "plan", path, "--kind", "cp", *planning, "--batch", str(len(prompts)),
         "--context", str(len(prompts[0])), "--output-len", str(new), "--strategy", strategy,
         "--degree", str(degree), "-o", str(plan), *(["--compile"] if compile_ else [])],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if planned.returncode:
        return {"error": planned.stderr.strip().splitlines()[-1]}
    best: dict = {}
    for _ in range(LAUNCHES):  # the fastest launch, as generate() gets the best of three runs
        launched = subprocess.run(
            [*TESSERA, "launch", str(plan), "--model", path, "--prompts", str(lines), "--new-tokens", str(new),
             "--json", "--timeout", "300", *(["--compile"] if compile_ else [])],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if launched.returncode:
            return {"error": launched.stderr.strip().splitlines()[-1]}
        report = json.loads(launched.stdout)
        if not best or _per_token(report) < _per_token(best):
            best = report
    return best


def _per_token(report: dict) -> float:
    return report["measured"]["per_token_latency_s"]


def big_llama() -> tuple[torch.nn.Module, str]:
    """The Llama-style model (4 layers, hidden 256, GQA 8/2, vocab 8192), exported once (dynamo,
    dynamic batch and sequence) into the corpus cache."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=688, vocab_size=8192, max_position_embeddings=2048, initializer_range=0.2,
    )  # fmt: skip
    module = _PlainLogits(_rescaled(transformers.LlamaForCausalLM(config), 0.2)).eval()
    path = cache_dir() / "bench-llama-4x256.onnx"
    if not path.is_file():
        error = _export(
            module, torch.randint(0, 8192, (2, 16)), "input_ids", "dynamo", ("batch", "sequence"), path
        )
        if error:
            raise SystemExit(f"exporting the Llama-style model failed: {error}")
    return module, str(path)


def row(  # noqa: PLR0913 - the bench's grid
    label: str,
    model: torch.nn.Module,
    path: str,
    batch: int,
    prompt: int,
    new: int,
    work: Path,
    vocab: int,
    *,
    traced: bool = True,
    planning: tuple[str, ...] = ("--cluster", "local-cpu-split"),
) -> dict:
    prompts = prompts_of(vocab, batch, prompt)
    hf = {}
    for cache in ("dynamic", "static"):
        try:
            hf[cache] = hf_per_token(model, prompts, new, cache)
        except Exception as exc:  # noqa: BLE001 - a model without a static cache in transformers
            hf[cache] = (None, f"{type(exc).__name__}")
    runs = {
        f"{s}{d}": tessera_run(path, prompts, new, s, d, work, planning=planning)
        for s, d in STRATEGIES
        if traced
    }
    if batch == 1:
        for s, d in STRATEGIES:
            runs[f"{s}{d}-compiled"] = tessera_run(
                path, prompts, new, s, d, work, compile_=True, planning=planning
            )
    from decode_reference import greedy_tokens

    try:
        reference = greedy_tokens(path, prompts, new) if batch * (prompt + new) <= 4096 else None
    except Exception as exc:  # noqa: BLE001 - onnxruntime refusing the graph past its positions
        print(f"{label}: no onnxruntime reference ({str(exc).splitlines()[0][:160]})", flush=True)
        reference = None
    return {
        "label": label, "batch": batch, "prompt": prompt, "new": new, "hf": hf, "runs": runs,
        "reference": reference, "generate_agrees": reference is None or hf["dynamic"][1] == reference,
    }  # fmt: skip


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | batch | prompt | generate() dynamic / static ms | tessera ms (× generate's faster) | predicted ms (error) | tokens = the export's (generate()'s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        hf = [r["hf"][c][0] for c in ("dynamic", "static")]
        best = min((t for t in hf if t is not None), default=None)
        cells, preds, equal = [], [], []
        for name, rep in r["runs"].items():
            if "error" in rep:
                cells.append(f"{name}: refused ({rep['error'][:80]})")
                continue
            got = rep["measured"]["per_token_latency_s"]
            ratio = f" ({got / best:.2f}×)" if best else ""
            cells.append(f"{name} {_ms(got)}{ratio}")
            want = rep["predicted"].get("per_token_latency_s")
            preds.append(f"{name} {_ms(want)} ({(got - want) / want:+.0%})" if want else f"{name} -")
            want = r["reference"] if r["reference"] is not None else r["hf"]["dynamic"][1]
            equal.append("yes" if rep["tokens"] == want else "NO")
        agrees = "" if r["generate_agrees"] else " (generate() differs from the export)"
        lines.append(
            f"| {r['label']} | {r['batch']} | {r['prompt']} | {_ms(hf[0])} / {_ms(hf[1])} | {'; '.join(cells)} | "
            f"{'; '.join(preds)} | {', '.join(equal)}{agrees} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the corpus decoders only")
    parser.add_argument(
        "--compiled-only",
        action="store_true",
        help="the corpus decoders' compiled runs only (their own file)",
    )
    parser.add_argument("--models", default="", help="comma-separated corpus decoders (default: all)")
    parser.add_argument(
        "--out", type=Path, default=None, help="the results file (default: by --compiled-only)"
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="plan on a spec tessera calibrate measures first, in this run (not local-cpu-split's)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="plan with --profile: each model's own decode step timed, its operations charged that",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    keys = [k for k in ENTRIES if MODELS[k[0]].decoder and k[1:] == ("dynamo", "dynamic")]
    corpus = build_corpus([k for k in keys if not args.models or k[0] in args.models.split(",")])
    header = [
        "# Decoding: tessera launch against transformers' generate()",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, transformers "
        f"{__import__('transformers').__version__}, Python {platform.python_version()}. transformers "
        "runs eager on one thread; each tessera rank is one process on one core (planned on "
        f"{'a spec `tessera calibrate --seconds 20` measured at the start of the run' if args.calibrate else '`local-cpu-split`'}"
        f"{'; `plan --profile`: each model its own decode step timed when planned' if args.profile else ''}). "
        "ms: milliseconds per decode step (one token per request) after the prefill (generate(): the "
        f"best of three runs; tessera: the fastest of {LAUNCHES} launches of the plan); ratio: tessera's "
        "over generate()'s faster cache; error: measured against the plan's predicted per-token latency. "
        "`-compiled`: `launch --compile` (torch.compile of the decode step; its compile time is "
        "excluded) of a plan made with `plan --compile` (its prediction the compiled step's). Regenerate "
        f"with `.venv/bin/python bench/decode.py{' --compiled-only' if args.compiled_only else ''}"
        f"{' --calibrate' if args.calibrate else ''}{' --profile' if args.profile else ''}"
        f"{f' --models {args.models}' if args.models else ''}"
        f"{f' --out {args.out}' if args.out else ''}`.",
        "",
    ]
    out = args.out or (OUT_COMPILED if args.compiled_only else OUT)

    def save(rows: list[dict]) -> None:  # after every row: a run stopped half-way keeps its rows
        write_atomic(out, "\n".join(header + table(rows)) + "\n")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cluster = "local-cpu-split"
        if args.calibrate:  # the user's workflow: this machine measured now, then planned on
            cluster = str(work / "calibrated.yaml")
            subprocess.run([*TESSERA, "calibrate", "--seconds", "20", "--out", cluster], check=True)
        planning: tuple[str, ...] = ("--cluster", cluster)
        if args.profile:  # each model's own step timed by plan (a cache of the run's own)
            planning += ("--profile", "--cache", str(work / "profiles.sqlite"))
        for (name, _, _), made in corpus.entries.items():
            if made.path is None:
                continue
            module = corpus.reference(name)[0].model
            from tessera.executor.graph_decode_worker import graph_decoder

            limit = graph_decoder(made.path).max_positions or 4096  # a position table bounds the run
            new = min(NEW_TOKENS, limit // 2)
            prompt = min(128, limit - new)
            vocab = module.config.vocab_size
            rows.append(
                row(
                    name,
                    module,
                    made.path,
                    1,
                    prompt,
                    new,
                    work,
                    vocab,
                    traced=not args.compiled_only,
                    planning=planning,
                )
            )
            print(table(rows)[-1], flush=True)
            save(rows)
        if not (args.quick or args.compiled_only):
            module, path = big_llama()
            for batch in (1, 8):
                for prompt in (128, 1024):
                    rows.append(
                        row(
                            "llama-4x256",
                            module.model,
                            path,
                            batch,
                            prompt,
                            32,
                            work,
                            8192,
                            planning=planning,
                        )
                    )
                    print(table(rows)[-1], flush=True)
                    save(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
