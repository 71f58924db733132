"""Triton split-KV (FlashDecoding) decode attention over one ``kv_shard``.

Computes what :func:`tessera.kernels.reference.decode_attention_partial` computes, in two kernels:
``_decode_split_kernel`` streams each KV split with an online softmax, serving all q-heads of a kv head at
once so every K/V byte is read once; ``_merge_splits_kernel`` merges the splits by log-sum-exp. Runs on
CUDA, or on CPU under ``TRITON_INTERPRET=1``. Importing never fails: without Triton,
:func:`decode_attention_partial_triton` raises :class:`KernelUnavailableError` with the reason.

References: thesis §4.4; FlashDecoding. Kernel design: docs/cp.md.
"""

from __future__ import annotations

import math

import torch

from tessera.core.errors import LaunchError
from tessera.kernels.reference import check_decode_shapes

__all__ = [
    "MIN_HEAD_DIM",
    "KernelUnavailableError",
    "decode_attention_partial_triton",
    "default_num_splits",
    "triton_unavailable_reason",
]

try:  # Triton is optional (the `kernels` extra); the reason is kept for reports and test skips.
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a broken install failing at import time
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    _TRITON_IMPORT_ERROR = f"triton is not importable ({type(exc).__name__}: {exc})"


class KernelUnavailableError(LaunchError):
    """A kernel implementation cannot run here (its library is missing, or no device for it)."""


MIN_HEAD_DIM = 16  # tl.dot's smallest K dimension


def _interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter.

    Triton fixes this when it is imported: ``TRITON_INTERPRET`` is read as ``triton.language`` jits its
    own library functions (``tl.zeros`` …), so setting it later has no effect. The kernels' own type
    tells which mode they were built in.
    """
    if triton is None:
        return False
    return type(_decode_split_kernel).__name__ == "InterpretedFunction"


def _mode_mismatch() -> str | None:
    """A reason when tessera's kernels and Triton's library were built in different modes."""
    library = type(getattr(tl, "zeros", None)).__name__
    if (
        library in ("JITFunction", "InterpretedFunction")
        and (library == "InterpretedFunction") != _interpreting()
    ):
        return "TRITON_INTERPRET changed between importing triton and tessera.kernels; set it before both"
    return None


def triton_unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the Triton kernel cannot run (on ``device`` if given), or ``None`` when it can.

    CPU tensors need Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before Triton is
    first imported); CUDA tensors need a visible GPU.
    """
    if _TRITON_IMPORT_ERROR is not None:
        return _TRITON_IMPORT_ERROR
    mismatch = _mode_mismatch()
    if mismatch is not None:
        return mismatch
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is visible to torch"
    if dev.type == "cpu":
        if _interpreting():
            return None
        return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported"
    return f"device type {dev.type!r} is not supported by the Triton decode kernel"


if triton is not None:

    @triton.jit
    def _decode_split_kernel(  # noqa: PLR0913
        q_ptr,
        k_ptr,
        v_ptr,
        kv_len_ptr,
        o_part_ptr,
        lse_part_ptr,
        stride_qb,
        stride_qh,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vs,
        stride_vd,
        seq_len,
        num_kv_heads,
        num_splits,
        split_size,
        qk_scale_log2,
        HEAD_DIM: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_KV_LEN: tl.constexpr,
        USE_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_IN_FP32: tl.constexpr,
    ):
        split = tl.program_id(0)
        bh = tl.program_id(1)
        # int64 base offsets: a 128K-token cache at batch 8 and 32 kv heads exceeds 2**31 elements.
        b = (bh // num_kv_heads).to(tl.int64)
        h = (bh % num_kv_heads).to(tl.int64)

        offs_g = tl.arange(0, BLOCK_G)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < GROUP
        mask_d = offs_d < HEAD_DIM

        # The G q-heads that share kv head h are rows h*G .. h*G+G-1 of q[b].
        q_rows = h * GROUP + offs_g
        q_ptrs = q_ptr + b * stride_qb + q_rows[:, None] * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
        if DOT_IN_FP32:
            q = q.to(tl.float32)

        if HAS_KV_LEN:
            kv_len = tl.minimum(tl.load(kv_len_ptr + b).to(tl.int32), seq_len)
        else:
            kv_len = seq_len
        lo = split * split_size
        hi = tl.minimum(lo + split_size, kv_len)

        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh

        # Online softmax state per q-head, scores in base 2 (exp2); m starts at -inf, l at 0.
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

        for start_n in range(lo, hi, BLOCK_N):
            pos = start_n + offs_n
            mask_n = pos < hi
            # A mask only along the sequence when D fills the tile keeps the loads vectorized along D.
            if HEAD_DIM == BLOCK_D:
                kv_mask = mask_n[:, None]
            else:
                kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(
                k_base + pos[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0
            )
            v = tl.load(
                v_base + pos[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0
            )
            if DOT_IN_FP32:
                k = k.to(tl.float32)
            if USE_DOT:
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            else:
                s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            s = tl.where(mask_n[None, :], s * qk_scale_log2, float("-inf"))
            # Every block inside [lo, hi) has a valid position, so m_new is finite here.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if USE_DOT:
                # p is rounded to the cache dtype for the tensor-core product, as FlashAttention does.
                p_lo = p.to(v_ptr.dtype.element_ty)
                if DOT_IN_FP32:
                    pv = tl.dot(p_lo.to(tl.float32), v.to(tl.float32), input_precision=DOT_PRECISION)
                else:
                    pv = tl.dot(p_lo, v, input_precision=DOT_PRECISION)
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        # An empty split (lo >= hi) never entered the loop: l = 0 gives o = 0 and lse = -inf.
        nonempty = l_i > 0.0
        l_safe = tl.where(nonempty, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))

        # Partials are [B, Hq, num_splits, D] and [B, Hq, num_splits], fp32, contiguous.
        row = (b * num_kv_heads * GROUP + q_rows) * num_splits + split
        tl.store(
            o_part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_g[:, None] & mask_d[None, :]
        )
        tl.store(lse_part_ptr + row, lse, mask=mask_g)

    @triton.jit
    def _merge_splits_kernel(  # noqa: PLR0913
        o_part_ptr,
        lse_part_ptr,
        o_ptr,
        lse_ptr,
        num_splits,
        stride_ob,
        stride_oh,
        stride_od,
        num_q_heads,
        HEAD_DIM: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        b = bh // num_q_heads
        h = bh % num_q_heads
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM

        # Online log-sum-exp merge (natural log) over the splits, BLOCK_S at a time; -inf splits get
        # weight 0, and a finite stand-in for an all -inf max avoids exp(-inf - -inf) = NaN.
        m = tl.full([1], float("-inf"), dtype=tl.float32)
        total = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start_s in range(0, num_splits, BLOCK_S):
            idx = start_s + offs_s
            mask_s = idx < num_splits
            rows = bh * num_splits + idx
            lse_s = tl.load(lse_part_ptr + rows, mask=mask_s, other=float("-inf"))
            o_s = tl.load(
                o_part_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                mask=mask_s[:, None] & mask_d[None, :],
                other=0.0,
            )
            m_new = tl.maximum(m, tl.max(lse_s, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            w = tl.exp(lse_s - m_safe)
            total = total * alpha + tl.sum(w, axis=0)
            acc = acc * alpha + tl.sum(w[:, None] * o_s, axis=0)
            m = m_new

        nonempty = total > 0.0
        total_safe = tl.where(nonempty, total, 1.0)
        m_safe = tl.where(nonempty, m, 0.0)
        o = acc / total_safe
        lse = tl.where(nonempty, m_safe + tl.log(total_safe), float("-inf"))
        tl.store(
            o_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
            o.to(o_ptr.dtype.element_ty),
            mask=mask_d,
        )
        tl.store(lse_ptr + bh + tl.zeros([1], dtype=tl.int64), lse)


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def default_num_splits(
    batch: int, num_kv_heads: int, seq_len: int, block_n: int, device: torch.device | str
) -> int:
    """Splits per (request, kv head): enough programs for ~8 waves per SM on a GPU.

    Each split keeps at least 4 blocks of ``block_n`` positions so the per-split partial (written and
    re-read by the merge) stays small next to the K/V bytes it summarizes. On the CPU interpreter the
    same rule with one "SM" keeps the program count (and the test time) small.
    """
    num_blocks = max(1, -(-seq_len // block_n))
    target_programs = 8 * _num_sms(torch.device(device))
    splits = -(-target_programs // max(1, batch * num_kv_heads))
    return max(1, min(splits, -(-num_blocks // 4)))


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def decode_attention_partial_triton(  # noqa: PLR0913
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kv_len: torch.Tensor | None = None,
    scale: float | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton FlashDecoding over one ``kv_shard``; same contract as ``decode_attention_partial``.

    Parameters
    ----------
    q : ``[B, Hq, D]``; k, v : ``[B, Hkv, S, D]`` (any strides; contiguous along ``D`` is fastest).
    kv_len : optional int ``[B]``, valid positions of each request in this shard (clamped to ``S``).
    scale : softmax scale (default ``1 / sqrt(D)``).
    block_n : KV positions per inner block (default 64 with the tensor-core path, 32 for MHA).
    num_splits : splits of the shard per (request, kv head) (default :func:`default_num_splits`).
    num_warps, num_stages : Triton launch options for the split kernel (GPU tuning knobs).

    Returns
    -------
    ``(o, lse)``: ``o`` ``[B, Hq, D]`` in ``q.dtype``; ``lse`` ``[B, Hq]`` fp32, the natural log of the
    shard's ``Σ exp(scale · q·k)`` (``-inf`` with ``o = 0`` where the shard is empty for a request).

    Raises
    ------
    KernelUnavailableError : Triton is missing, or the tensors' device cannot run it.
    ValueError : shapes or dtypes that do not fit.
    """
    reason = triton_unavailable_reason(q.device)
    if reason is not None:
        raise KernelUnavailableError(f"Triton decode attention is unavailable: {reason}")
    b, hq, hkv, s, d = check_decode_shapes(q, k, v, kv_len)
    if not (q.device == k.device == v.device) or (kv_len is not None and kv_len.device != q.device):
        raise ValueError("q, k, v and kv_len must be on the same device")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one of fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if d < MIN_HEAD_DIM:
        raise ValueError(f"head dim D={d} is below the kernel's minimum of {MIN_HEAD_DIM}")
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    use_dot = group > 1
    # Triton 3.x's interpreter multiplies bf16 dot operands as their raw uint16 bits; there the kernel
    # upcasts them (after the same bf16 rounding of p) so the interpreter computes what the GPU does.
    dot_in_fp32 = _interpreting() and q.dtype == torch.bfloat16
    if block_n is None:
        block_n = 64 if use_dot else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16; got {block_n}")
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, s, block_n, q.device)
    num_blocks = max(1, -(-s // block_n))
    num_splits = max(1, min(int(num_splits), num_blocks))
    # Each split covers a whole number of blocks, so only a split's last block straddles its end.
    split_size = -(-num_blocks // num_splits) * block_n
    num_splits = max(1, -(-s // split_size))

    block_d = max(16, _next_pow2(d))
    block_g = max(16, _next_pow2(group)) if use_dot else _next_pow2(group)
    o_part = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    o = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq), dtype=torch.float32, device=q.device)
    if b == 0 or hq == 0:
        return o, lse

    launch: dict[str, int] = {}
    if num_warps is not None:
        launch["num_warps"] = num_warps
    if num_stages is not None:
        launch["num_stages"] = num_stages
    kv_len_arg = kv_len if kv_len is not None else lse_part  # unused pointer when HAS_KV_LEN is False
    _decode_split_kernel[(num_splits, b * hkv)](
        q,
        k,
        v,
        kv_len_arg,
        o_part,
        lse_part,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        s,
        hkv,
        num_splits,
        split_size,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        HEAD_DIM=d,
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_KV_LEN=kv_len is not None,
        USE_DOT=use_dot,
        # fp32 inputs: full-precision products (TF32 would miss fp32 tolerances); fp16/bf16: tensor cores.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or dot_in_fp32 else "tf32",
        DOT_IN_FP32=dot_in_fp32,
        **launch,
    )
    _merge_splits_kernel[(b * hq,)](
        o_part,
        lse_part,
        o,
        lse,
        num_splits,
        *o.stride(),
        hq,
        HEAD_DIM=d,
        BLOCK_S=min(64, _next_pow2(num_splits)),
        BLOCK_D=block_d,
    )
    return o, lse
