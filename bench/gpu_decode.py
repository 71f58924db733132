"""Decoding on a GPU: tessera's decode step against transformers' ``generate()`` of the same shape,
and against the HBM roofline of what a step reads.

For an LLM preset (default GPT-2 small; seeded random weights, fp32 as ``launch`` decodes it) at
each batch and prompt length: tessera's step as its traced program with the dynamic-shape cache
(every kernel launched from Python), the same step in fixed shapes captured as a CUDA graph
(``executor/graphed_step.py``; both must give the same tokens), and transformers' GPT-2 of the same
sizes (its own random weights: latency, not tokens, is compared) with its dynamic and static KV
caches. Roofline: the weights plus the mean KV cache a step reads, at the device-to-device copy
bandwidth measured in the same run. Runs on the CPU too (nothing captured there).

    python3 bench/gpu_decode.py --out bench/results/gpu_decode.md     # on a GPU machine
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from tessera.core.files import write_atomic
from tessera.core.weights import materialize
from tessera.executor.decode_program import compile_step
from tessera.executor.graph_decode_worker import _attention, graph_decoder
from tessera.executor.graphed_step import GraphedStep
from tessera.executor.kv_cache import GroupCache
from tessera.models.gpt import llm_gpt
from tessera.planners.cp.llm import load_llm_config


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a device-to-device copy moves (read and written), best of ten."""
    x = torch.empty(2**28, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * x.numel() / best


def tessera_steps(decoder, prompts: torch.Tensor, new: int, *, fixed: bool) -> tuple[list[float], list, str]:
    """Per-step seconds, the tokens, and how the step ran (``fixed``: the fixed-shape step, captured
    on CUDA)."""
    device = prompts.device
    batch, length = prompts.shape
    cache = GroupCache(np.zeros(length + new - 1, dtype=np.int64), 0, device)

    def attend(layer, q, k, v, scores, past):
        keys, values, positions = cache.read(layer, cache.write(layer, k, v, past))
        return _attention(q, keys, values, positions, past, scores, slice(None))

    last = torch.argmax(decoder.logits(prompts, 0, attend)[:, -1], dim=-1).tolist()
    tokens, times = [last], []
    graphed = GraphedStep(decoder, cache, batch, capture=device.type == "cuda") if fixed else None
    for k in range(new - 1):
        sync(device)
        t0 = time.perf_counter()
        if graphed is not None:
            last = graphed.run(last, length + k)
        else:
            logits = decoder.logits(torch.tensor(last, device=device)[:, None], length + k, attend)
            last = torch.argmax(logits[:, -1], dim=-1).tolist()
        sync(device)
        times.append(time.perf_counter() - t0)
        tokens.append(last)
    how = (
        "fx program" if graphed is None else "captured" if graphed.graph is not None else str(graphed.why_not)
    )
    return times[2:], tokens, how  # the first steps capture and warm up


def hf_per_token(llm, device: torch.device, prompts: torch.Tensor, new: int, cache: str) -> float:
    """Seconds per decode step of transformers' GPT-2 of these sizes: (new tokens − 2 tokens) / steps;
    ``cache``: ``dynamic``, ``static`` (eager) or ``compiled`` (static, the forward compiled by
    transformers, as it does by default on a GPU)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=llm.layers, n_embd=llm.hidden, n_head=llm.heads, n_inner=llm.ffn, vocab_size=llm.vocab,
        n_positions=max(1024, prompts.shape[1] + new), tie_word_embeddings=llm.tied_embeddings,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).eval().to(device)
    # transformers compiles the forward itself for a static cache on a GPU, unless told not to
    extra = (
        {"cache_implementation": "static", "disable_compile": cache == "static"} if cache != "dynamic" else {}
    )

    def run(n: int) -> float:
        best = float("inf")
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(
                    prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0, **extra,
                )  # fmt: skip
            sync(device)
            best = min(best, time.perf_counter() - t0)
        return best

    return (run(new) - run(2)) / (new - 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llm", default="gpt2")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--prompt", default="128,1024")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' generate()")
    parser.add_argument(
        "--hf-compiled",
        action="store_true",
        help="also generate() with its forward compiled (minutes per shape)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    llm, _ = load_llm_config(args.llm)
    decoder = graph_decoder(materialize(llm_gpt(llm.to_json(), 0)), label=f"--llm {args.llm}")
    decoder.module.to(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in decoder.module.parameters())
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        for length in (int(p) for p in args.prompt.split(",")):
            g = torch.Generator().manual_seed(0)
            prompts = torch.randint(1, llm.vocab, (batch, length), generator=g).to(device)
            t0 = time.perf_counter()
            whys = [compile_step(decoder, batch, n) for n in (length, 1)]
            traced_s = time.perf_counter() - t0
            eager, want, _ = tessera_steps(decoder, prompts, args.new, fixed=False)
            try:
                fixed, got, how = tessera_steps(decoder, prompts, args.new, fixed=True)
            except ValueError as exc:  # no traced program: nothing to capture
                fixed, got, how = [float("nan")], None, str(exc)
            mean_len = length + args.new / 2
            kv = 2 * llm.layers * llm.kv_heads * llm.head_dim * 4 * batch * mean_len
            roofline = (weight_bytes + kv) / (bandwidth / 2)  # bytes read once at the copy's read rate
            caches = (
                ()
                if args.no_hf
                else ("dynamic", "static", "compiled")
                if args.hf_compiled
                else ("dynamic", "static")
            )
            hf = {c: hf_per_token(llm, device, prompts, args.new, c) for c in caches}
            row = {
                "batch": batch, "prompt": length, "traced": whys, "traced_s": traced_s, "how": how,
                "eager_ms": 1e3 * float(np.median(eager)), "fixed_ms": 1e3 * float(np.median(fixed)),
                "fixed_p99_ms": 1e3 * float(np.percentile(fixed, 99)), "same_tokens": got == want,
                "roofline_ms": 1e3 * roofline, "hf_ms": {c: 1e3 * s for c, s in hf.items()},
            }  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    lines = [
        f"# Decoding on {name}: tessera's step against transformers' generate()",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {name}, torch {torch.__version__}, Python "
        f"{platform.python_version()}; `--llm {args.llm}` ({llm.layers} layers, hidden {llm.hidden}, "
        f"{weight_bytes / 2**20:.0f} MiB of fp32 weights), {args.new} new tokens, greedy. ms: median per "
        f"decode step. Roofline: weights + mean KV cache read at {bandwidth / 2e12:.2f} TB/s (half the "
        "measured device-to-device copy rate, which counts bytes read and written). transformers: GPT-2 of "
        "the same sizes, its own random weights, eager. Regenerate with `python3 bench/gpu_decode.py`.",
        "",
        "| batch | prompt | fx program ms | captured step ms (p99) | × fx | roofline ms | generate() dynamic / static (/ compiled) ms | captured × generate()'s fastest | same tokens |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        hf = r["hf_ms"]
        best = min(hf.values()) if hf else None
        lines.append(
            f"| {r['batch']} | {r['prompt']} | {r['eager_ms']:.3f} | {r['fixed_ms']:.3f} ({r['fixed_p99_ms']:.3f}; {r['how']}) "
            f"| {r['fixed_ms'] / r['eager_ms']:.2f}× | {r['roofline_ms']:.3f} | "
            + (
                f"{' / '.join(f'{v:.3f}' for v in hf.values())} | {r['fixed_ms'] / best:.2f}× "
                if hf
                else "— | — "
            )
            + f"| {'yes' if r['same_tokens'] else 'NO'} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_atomic(Path(args.out), text.encode())


if __name__ == "__main__":
    main()
