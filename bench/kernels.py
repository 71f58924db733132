"""Benchmark the split-KV decode attention kernel against PyTorch on one GPU.

One decode step (one new token per request) over a long KV cache, the per-device work of cache
parallelism (thesis-jeon §4.4): B = 1..8 requests, Hq = 32 query heads, Hkv = 8 (GQA) or 32 (MHA) kv
heads, D = 128, a 128K-token cache, fp16 and bf16. For each shape it times

- ``triton``: :func:`tessera.kernels.decode_attention_partial_triton` (default launch configuration,
  and with ``--tune`` the best of a small sweep of block size, warps, stages and split counts);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa`` for GQA);
- ``torch-ref``: :func:`tessera.kernels.decode_attention_partial` (fp32 einsums; skipped when its fp32
  copies of K and V would not fit ``--ref-max-gib``),

with ``triton.testing.do_bench`` (median of repeated runs, L2 flushed between runs), and reports the
achieved HBM bandwidth, ``bytes(K) + bytes(V) / time``, against the device's peak (a table of known
GPUs, ``--peak-gbs``, and a measured device-to-device copy), plus the Triton/SDPA speedup and the
largest difference between the Triton and SDPA outputs. Results go to ``bench/results/kernels.md``.

Usage::

    python bench/kernels.py            # full sweep (a few minutes on an H200)
    python bench/kernels.py --quick    # B in {1, 8}, fp16 only, no reference
    python bench/kernels.py --tune     # also sweep Triton launch configurations

Without a CUDA GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "kernels.md"

# Peak HBM bandwidth in GB/s (10^9 B/s) by device-name substring, most specific first (vendor specs).
PEAK_GBS = [
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("GH200", 4000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX A5000", 768.0),
    ("V100", 900.0),
]
TARGET_FRACTION = 0.70  # of peak HBM bandwidth, the goal for the Triton kernel on a 128K cache


@dataclass
class Row:
    batch: int
    kv_heads: int
    dtype: str
    kv_bytes: int
    times_ms: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    best_config: str = ""
    max_err: float = math.nan


def peak_bandwidth_gbs(name: str, override: float | None) -> tuple[float | None, str]:
    if override is not None:
        return override, "--peak-gbs"
    for key, gbs in PEAK_GBS:
        if key.lower() in name.lower():
            return gbs, f"spec sheet ({key})"
    return None, "unknown device: pass --peak-gbs"


def measured_copy_gbs(do_bench: Callable[..., float]) -> float:
    """Device-to-device copy of 2 GiB: (bytes read + bytes written) / time, a practical ceiling."""
    n = 2**30 // 2  # 1 GiB of fp16 each way
    src = torch.empty(n, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def tune_configs(sweep: bool) -> list[dict[str, int | None]]:
    """Triton launch configurations to time: the defaults, and with ``sweep`` a small grid."""
    configs: list[dict[str, int | None]] = [{}]
    if not sweep:
        return configs
    for block_n in (32, 64, 128):
        for num_warps in (4, 8):
            for num_stages in (2, 3, 4):
                configs.append({"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages})
    return configs


def bench_shape(
    args: argparse.Namespace, batch: int, kv_heads: int, dtype: torch.dtype, do_bench: Callable[..., float]
) -> Row:
    import torch.nn.functional as F

    from tessera.kernels import decode_attention_partial, decode_attention_partial_triton
    from tessera.kernels.triton_decode import default_num_splits

    hq, d, s = args.q_heads, args.head_dim, args.seq_len
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, kv_heads, s, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, kv_heads, s, d, device="cuda", dtype=dtype, generator=gen)
    kv_len = torch.full((batch,), s, dtype=torch.int32, device="cuda")
    row = Row(batch, kv_heads, str(dtype).removeprefix("torch."), 2 * k.numel() * k.element_size())

    def timed(fn: Callable[[], object]) -> float:
        return do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")

    # Triton: the defaults, then (with --tune) a sweep; the fastest is reported.
    best: tuple[float, str] | None = None
    configs = tune_configs(args.tune)
    if args.tune:
        group_default_block = 64 if hq // kv_heads > 1 else 32
        base = default_num_splits(batch, kv_heads, s, group_default_block, q.device)
        configs += [{"num_splits": max(1, base // 2)}, {"num_splits": base * 2}]
    for config in configs:
        label = ", ".join(f"{key}={val}" for key, val in config.items()) or "defaults"
        try:
            ms = timed(lambda c=config: decode_attention_partial_triton(q, k, v, kv_len=kv_len, **c))
        except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
            row.notes.append(f"triton {label}: {type(exc).__name__}")
            continue
        if config == {}:
            row.times_ms["triton-default"] = ms
        if best is None or ms < best[0]:
            best = (ms, label)
    row.times_ms["triton"] = best[0] if best else None
    row.best_config = best[1] if best else "-"

    q4 = q[:, :, None, :]
    gqa = {"enable_gqa": True} if kv_heads != hq else {}
    row.times_ms["sdpa"] = timed(lambda: F.scaled_dot_product_attention(q4, k, v, **gqa))

    ref_bytes = 2 * k.numel() * 4 + batch * hq * s * 4 * 2  # fp32 K, V copies and scores
    if args.quick or ref_bytes > args.ref_max_gib * 2**30:
        row.times_ms["torch-ref"] = None
        if not args.quick:
            row.notes.append(f"torch-ref skipped: needs ~{ref_bytes / 2**30:.0f} GiB")
    else:
        row.times_ms["torch-ref"] = timed(lambda: decode_attention_partial(q, k, v, kv_len=kv_len))
        torch.cuda.empty_cache()

    o_triton, _ = decode_attention_partial_triton(q, k, v, kv_len=kv_len)
    o_sdpa = F.scaled_dot_product_attention(q4, k, v, **gqa)[:, :, 0, :]
    row.max_err = (o_triton.float() - o_sdpa.float()).abs().max().item()
    return row


def fmt_us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:,.1f}"


def fmt_gbs(row: Row, ms: float | None) -> str:
    return "-" if ms is None else f"{row.kv_bytes / (ms * 1e-3) / 1e9:,.0f}"


def render(rows: list[Row], header: list[str], peak: float | None, copy_gbs: float) -> str:
    lines = ["# Split-KV decode attention: Triton vs PyTorch", "", *header, ""]
    lines += [
        "| B | Hkv | dtype | K+V MiB | triton µs | triton GB/s | % peak | % copy | sdpa µs | sdpa GB/s "
        "| torch-ref µs | triton / sdpa speedup | max abs diff vs sdpa | triton config |",
        "|---:|---:|:--|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--|",
    ]
    for r in rows:
        t, sd = r.times_ms.get("triton"), r.times_ms.get("sdpa")
        gbs = r.kv_bytes / (t * 1e-3) / 1e9 if t else None
        pct = f"{100 * gbs / peak:.0f}%" if gbs and peak else "-"
        pct_copy = f"{100 * gbs / copy_gbs:.0f}%" if gbs else "-"
        speedup = f"{sd / t:.2f}×" if t and sd else "-"
        lines.append(
            f"| {r.batch} | {r.kv_heads} | {r.dtype} | {r.kv_bytes / 2**20:,.0f} | {fmt_us(t)} | {fmt_gbs(r, t)} "
            f"| {pct} | {pct_copy} | {fmt_us(sd)} | {fmt_gbs(r, sd)} | {fmt_us(r.times_ms.get('torch-ref'))} "
            f"| {speedup} | {r.max_err:.2e} | {r.best_config} |"
        )
    notes = [f"- B={r.batch} Hkv={r.kv_heads} {r.dtype}: {n}" for r in rows for n in r.notes]
    if notes:
        lines += ["", "Notes:", "", *notes]
    if peak:
        met = [r for r in rows if r.times_ms.get("triton")]
        ok = sum(r.kv_bytes / (r.times_ms["triton"] * 1e-3) / 1e9 >= TARGET_FRACTION * peak for r in met)
        lines += [
            "",
            f"Target: >= {TARGET_FRACTION:.0%} of peak HBM bandwidth on the 128K cache — met by {ok} of "
            f"{len(met)} shapes.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="B in {1, 8}, fp16 only, no torch reference")
    parser.add_argument("--tune", action="store_true", help="sweep Triton block/warps/stages/splits")
    parser.add_argument("--seq-len", type=int, default=128 * 1024, help="cache length (default 131072)")
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default 1 2 4 8)")
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=None, choices=["float16", "bfloat16"])
    parser.add_argument("--peak-gbs", type=float, default=None, help="peak HBM bandwidth in GB/s")
    parser.add_argument("--ref-max-gib", type=float, default=48.0, help="memory cap for the torch reference")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.")
        return 0
    try:
        import triton
        from triton.testing import do_bench
    except ImportError as exc:
        print(f"bench/kernels.py needs triton ({exc}); nothing measured.")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
    from tessera.kernels import available_implementations

    if available_implementations()["triton"] is not None:
        print(f"triton kernel unavailable: {available_implementations()['triton']}")
        return 0

    batches = args.batch or ([1, 8] if args.quick else [1, 2, 4, 8])
    dtypes = [
        getattr(torch, name)
        for name in (args.dtypes or (["float16"] if args.quick else ["float16", "bfloat16"]))
    ]
    name = torch.cuda.get_device_name()
    peak, peak_source = peak_bandwidth_gbs(name, args.peak_gbs)
    copy_gbs = measured_copy_gbs(do_bench)
    torch.cuda.empty_cache()
    header = [
        f"- device: {name}; peak HBM {peak or '?'} GB/s ({peak_source}); measured copy {copy_gbs:,.0f} GB/s",
        f"- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}",
        f"- shape: one decode step, Hq={args.q_heads}, D={args.head_dim}, cache {args.seq_len:,} tokens; "
        f"times are medians of `triton.testing.do_bench` (L2 flushed), GB/s = bytes(K+V) / time",
        f"- run: `python bench/kernels.py{' --quick' if args.quick else ''}{' --tune' if args.tune else ''}` "
        f"on {dt.date.today().isoformat()}",
    ]
    print("\n".join(header))
    rows: list[Row] = []
    for dtype in dtypes:
        for kv_heads in args.kv_heads:
            for batch in batches:
                row = bench_shape(args, batch, kv_heads, dtype, do_bench)
                torch.cuda.empty_cache()  # the shape's cache tensors died with bench_shape's frame
                rows.append(row)
                t = row.times_ms.get("triton")
                print(
                    f"B={batch} Hkv={kv_heads} {row.dtype}: triton {fmt_us(t)} µs ({fmt_gbs(row, t)} GB/s), "
                    f"sdpa {fmt_us(row.times_ms.get('sdpa'))} µs, ref {fmt_us(row.times_ms.get('torch-ref'))} µs, "
                    f"max diff {row.max_err:.1e}",
                    flush=True,
                )
    text = render(rows, header, peak, copy_gbs)
    from tessera.core.files import write_atomic

    write_atomic(args.output, text)
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
