"""PyTorch reference for split-KV (cache-parallel) decode attention and its exact merge.

:func:`decode_attention_partial` attends one new token per request (``q`` ``[B, Hq, D]``) to one
``kv_shard`` (``k``, ``v`` ``[B, Hkv, S, D]``; GQA/MQA when ``Hkv < Hq``; ``kv_len`` valid positions per
request) and returns ``(o, lse)``: the shard-normalized output and ``lse = ln Σ exp(scale·q·k)`` in fp32.
:func:`merge_partials` combines shards exactly, ``lse = ln Σ_n exp(lse_n)``, ``o = Σ_n exp(lse_n − lse)·o_n``
(FlashDecoding across devices); an empty shard gives ``o = 0, lse = -inf`` and merges without NaN.

References: thesis §4.4. Conventions shared with the Triton kernel: docs/cp.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tessera.core.kv_blocks import block_aligned_split

__all__ = [
    "KVShard",
    "check_decode_shapes",
    "decode_attention_partial",
    "full_decode_attention",
    "merge_partials",
    "shard_sizes",
    "split_kv",
]


def check_decode_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor | None
) -> tuple[int, int, int, int, int]:
    """Validate decode-attention operands; return ``(B, Hq, Hkv, S, D)``.

    Raises ``ValueError`` with the offending shapes when they do not fit together.
    """
    if q.dim() != 3 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"decode attention expects q [B, Hq, D] and k, v [B, Hkv, S, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    b, hq, d = q.shape
    bk, hkv, s, dk = k.shape
    if bk != b or dk != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq={hq} must be a positive multiple of Hkv={hkv} (GQA/MQA grouping)")
    if kv_len is not None:
        if kv_len.shape != (b,):
            raise ValueError(f"kv_len must have shape [B]=[{b}]; got {tuple(kv_len.shape)}")
        if kv_len.dtype.is_floating_point or kv_len.dtype == torch.bool:
            raise ValueError(f"kv_len must be an integer tensor; got {kv_len.dtype}")
    return b, hq, hkv, s, d


def _default_scale(d: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _valid_mask(kv_len: torch.Tensor | None, b: int, s: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[B, S]``: position ``i`` of request ``b`` is valid iff ``i < kv_len[b]``."""
    if kv_len is None:
        return torch.ones(b, s, dtype=torch.bool, device=device)
    positions = torch.arange(s, device=device)
    return positions[None, :] < kv_len.to(device=device, dtype=torch.int64)[:, None]


def _grouped_scores(
    q: torch.Tensor, k: torch.Tensor, kv_len: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Scaled fp32 scores ``[B, Hkv, G, S]`` with invalid positions set to ``-inf``."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    group = hq // hkv
    qg = q.float().reshape(b, hkv, group, d)
    scores = torch.einsum("bhgd,bhsd->bhgs", qg, k.float()) * scale
    valid = _valid_mask(kv_len, b, s, q.device)
    return scores.masked_fill(~valid[:, None, None, :], float("-inf"))


def decode_attention_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kv_len: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one decode token over one KV shard, as a mergeable partial (thesis §4.4).

    Parameters
    ----------
    q : ``[B, Hq, D]`` query of the new token.
    k, v : ``[B, Hkv, S, D]`` the local ``kv_shard``; ``Hq % Hkv == 0`` (GQA / MQA).
    kv_len : optional int ``[B]``, valid positions of each request in this shard (default: all S).
    scale : softmax scale (default ``1 / sqrt(D)``).

    Returns
    -------
    o : ``[B, Hq, D]`` in ``q.dtype``, ``softmax(scale · q kᵀ) v`` normalized within the shard
        (0 where the shard is empty for a request).
    lse : ``[B, Hq]`` fp32, the **natural** log of ``Σ_i exp(scale · q·k_i)`` over the shard's valid
        positions (``-inf`` where the shard is empty). Equals ``m + ln(s)`` in the thesis' notation.
    """
    b, hq, hkv, s, d = check_decode_shapes(q, k, v, kv_len)
    scale = _default_scale(d, scale)
    scores = _grouped_scores(q, k, kv_len, scale)  # [B, Hkv, G, S]
    lse = torch.logsumexp(scores, dim=-1) if s > 0 else scores.new_full(scores.shape[:-1], -math.inf)
    # exp(score - lse) is a proper softmax where the shard has a valid position; where it has none
    # lse = -inf and every score is -inf, so use a finite stand-in to get p = 0 instead of NaN.
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - lse_safe[..., None])
    o = torch.einsum("bhgs,bhsd->bhgd", p, v.float())
    return o.reshape(b, hq, d).to(q.dtype), lse.reshape(b, hq)


def merge_partials(
    os: Sequence[torch.Tensor] | torch.Tensor, lses: Sequence[torch.Tensor] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N shard partials exactly with log-sum-exp weights (FlashDecoding across devices).

    ``lse = ln Σ_n exp(lse_n)`` and ``o = Σ_n exp(lse_n - lse) · o_n``, computed in fp32 around the
    largest ``lse_n`` so nothing overflows. Shards with ``lse_n = -inf`` (empty) get weight 0; when
    every shard is empty for a (request, head) the result is ``o = 0, lse = -inf`` (no NaN). The merge
    is associative and commutative, so partials can be merged in any tree (e.g. per node, then
    across nodes), and a merged result is itself a partial.

    Parameters
    ----------
    os : ``[N, B, Hq, D]`` (stacked, or a list of N ``[B, Hq, D]``) shard outputs.
    lses : ``[N, B, Hq]`` (stacked, or a list) natural-log sums of the shards.

    Returns
    -------
    ``(o, lse)``: ``o`` ``[B, Hq, D]`` in the dtype of ``os``; ``lse`` ``[B, Hq]`` fp32.
    """
    o_stack = torch.stack(list(os)) if not isinstance(os, torch.Tensor) else os
    lse_stack = torch.stack(list(lses)) if not isinstance(lses, torch.Tensor) else lses
    if o_stack.dim() < 2 or o_stack.shape[:-1] != lse_stack.shape or o_stack.shape[0] == 0:
        raise ValueError(
            f"merge_partials expects os [N, ..., D] and lses [N, ...] with N >= 1; got "
            f"{tuple(o_stack.shape)} and {tuple(lse_stack.shape)}"
        )
    lse_f = lse_stack.float()
    return merge_outputs(o_stack, lse_f), torch.logsumexp(lse_f, dim=0)  # -inf where all are empty


def merge_outputs(os: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The merged output of :func:`merge_partials` alone, of stacked ``os`` ``[N, ..., D]`` and
    ``lses`` ``[N, ...]``: what a cp decode step needs once a layer, in four operations."""
    # exp(lse_n - lse) for each shard, computed around the largest (softmax): 0 for an empty shard;
    # NaN where every shard is empty, which gets weight 0 (o = 0).
    weights = torch.softmax(lses.float(), dim=0).nan_to_num_(0.0)
    return (weights.unsqueeze(-1) * os.float()).sum(dim=0).to(os.dtype)


def full_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a whole (unsharded) cache: the ground truth the merges are checked on.

    Computed independently of :func:`decode_attention_partial` (a plain masked ``softmax``), with the
    same shapes and conventions; ``kv_len`` is then each request's total length. Returns ``(o, lse)``
    with ``lse`` the natural log-sum-exp of the scaled scores (``-inf`` and ``o = 0`` for a request
    with no valid position).
    """
    b, hq, hkv, s, d = check_decode_shapes(q, k, v, kv_len)
    scale = _default_scale(d, scale)
    group = hq // hkv
    # Repeat kv heads to q heads (the textbook GQA formulation) rather than grouping the query.
    k_rep = k.float().repeat_interleave(group, dim=1)  # [B, Hq, S, D]
    v_rep = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k_rep) * scale
    valid = _valid_mask(kv_len, b, s, q.device)[:, None, :].expand_as(scores)
    scores = scores.masked_fill(~valid, float("-inf"))
    any_valid = valid.any(dim=-1, keepdim=True)
    # softmax of an all -inf row is NaN; such a request has no keys, so its output is defined as 0.
    probs = torch.softmax(scores, dim=-1).where(any_valid, torch.zeros((), device=q.device))
    o = torch.einsum("bhs,bhsd->bhd", probs, v_rep)
    lse = torch.logsumexp(scores, dim=-1) if s > 0 else scores.new_full((b, hq), -math.inf)
    return o.to(q.dtype), lse


@dataclass(frozen=True)
class KVShard:
    """One contiguous slice ``[start, start + size)`` of a KV cache along the sequence.

    ``k`` and ``v`` are ``[B, Hkv, size, D]`` views of the full cache (not copies); ``kv_len`` is
    int ``[B]``, the valid positions of each request inside this shard,
    ``clamp(total_len - start, 0, size)``.
    """

    start: int
    k: torch.Tensor
    v: torch.Tensor
    kv_len: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.k.shape[2])


def shard_sizes(seq_len: int, num_shards: int, *, block: int = 16) -> list[int]:
    """Even split of ``seq_len`` positions over ``num_shards`` in whole blocks of ``block`` positions.

    Blocks (the paged cache's unit) are dealt out so shard sizes differ by at most one block; earlier
    shards get the extra blocks, and the last block may be partial. Shards may be empty when there
    are fewer blocks than shards.
    """
    return [stop - start for start, stop in block_aligned_split(seq_len, num_shards, block=block)]


def split_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    num_shards: int,
    *,
    block: int = 16,
    sizes: Sequence[int] | None = None,
) -> list[KVShard]:
    """Split a KV cache ``[B, Hkv, S, D]`` along the sequence into ``num_shards`` ``kv_shard`` s.

    Parameters
    ----------
    k, v : the full cache.
    kv_len : optional int ``[B]``, each request's total valid length (default: all ``S``).
    num_shards : N, the number of devices of the cache-parallel group.
    block : positions per cache block for the even split (see :func:`shard_sizes`).
    sizes : explicit, possibly uneven, shard sizes summing to ``S`` (overrides ``block``;
        zeros allowed).

    Returns
    -------
    N :class:`KVShard` in sequence order; each carries its per-request ``kv_len`` clipped to the
    shard, so a request shorter than a shard's start has an empty shard there (``kv_len = 0``).
    """
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k, v must both be [B, Hkv, S, D]; got {tuple(k.shape)} and {tuple(v.shape)}")
    b, _, s, _ = k.shape
    if sizes is None:
        sizes = shard_sizes(s, num_shards, block=block)
    else:
        sizes = [int(x) for x in sizes]
        if len(sizes) != num_shards or sum(sizes) != s or min(sizes) < 0:
            raise ValueError(f"sizes {sizes} must be {num_shards} non-negative ints summing to S={s}")
    total = (
        torch.full((b,), s, dtype=torch.int32, device=k.device)
        if kv_len is None
        else kv_len.to(device=k.device)
    )
    if total.shape != (b,):
        raise ValueError(f"kv_len must have shape [B]=[{b}]; got {tuple(total.shape)}")
    shards, start = [], 0
    for size in sizes:
        local_len = (total - start).clamp(min=0, max=size).to(total.dtype)
        shards.append(
            KVShard(
                start=start,
                k=k[:, :, start : start + size],
                v=v[:, :, start : start + size],
                kv_len=local_len,
            )
        )
        start += size
    return shards
