"""Attention operators (opset 23): Attention (scaled dot-product attention with grouped KV heads, a
boolean or additive mask, a causal mask and a soft-cap; 3-D inputs with ``q_num_heads`` /
``kv_num_heads``) and RotaryEmbedding (half-split or interleaved, full or partial, cos/sin caches
indexed by position ids). Forms a cache would need (``past_key``, extra outputs) are refused."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from tessera.backends.torch_ops import Inputs, given, op


def heads_first(t: Tensor, heads: int | None) -> Tensor:
    """``[B, S, heads·D]`` → ``[B, heads, S, D]``; a 4-D tensor is already so."""
    if t.dim() == 4:
        return t
    if not heads:
        raise NotImplementedError("3-D Attention inputs need q_num_heads and kv_num_heads")
    b, s, width = t.shape
    return t.reshape(b, s, heads, width // heads).transpose(1, 2)


def attention_scores(q: Tensor, k: Tensor, a: Mapping[str, Any]) -> Tensor:
    """``[B, Hq, S, T]`` scores: scale·Q·Kᵀ (KV heads repeated for grouped-query), then soft-capped."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = a.get("scale")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    softcap = a.get("softcap", 0.0)
    return torch.tanh(scores / softcap) * softcap if softcap and softcap > 0 else scores


@op("Attention")
def _attention(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    if any(given(x, i) is not None for i in (4, 5, 6)):
        raise NotImplementedError("Attention with past_key/past_value or nonpad_kv_seqlen (a KV cache input)")
    if a.get("left_window_size", -1) != -1 or a.get("right_window_size", -1) != -1:
        raise NotImplementedError("Attention with left_window_size/right_window_size (opset 25)")
    q3 = x[0].dim() == 3
    q = heads_first(x[0], a.get("q_num_heads"))
    k, v = (heads_first(t, a.get("kv_num_heads")) for t in (x[1], x[2]))
    scores = attention_scores(q, k, a)
    s, t = scores.shape[-2:]
    if a.get("is_causal", 0):
        future = torch.ones(s, t, dtype=torch.bool, device=scores.device).triu(1 + t - s)
        scores = scores.masked_fill(future, float("-inf"))
    if (mask := given(x, 3)) is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if v.shape[1] != q.shape[1]:
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    y = torch.softmax(scores, dim=-1) @ v
    return y.transpose(1, 2).reshape(y.shape[0], s, -1) if q3 else y


@op("RotaryEmbedding")
def _rotary(x: Inputs, a: Mapping[str, Any]) -> Tensor:
    data, cos, sin = x[0], x[1], x[2]
    four = data.dim() == 4
    t = data.transpose(1, 2) if four else data  # [B, S, H, D] or [B, S, hidden]
    if t.dim() == 3:
        t = t.reshape(*t.shape[:2], a["num_heads"], -1)
    dim = a.get("rotary_embedding_dim", 0) or t.shape[-1]
    turned, kept = t[..., :dim], t[..., dim:]
    if (positions := given(x, 3)) is not None:
        cos, sin = cos[positions], sin[positions]  # [B, S, dim/2]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if a.get("interleaved", 0):
        x1, x2 = turned[..., 0::2], turned[..., 1::2]
        real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
        turned = torch.stack([real, imag], dim=-1).flatten(-2)
    else:
        x1, x2 = turned.chunk(2, dim=-1)
        turned = torch.cat([cos * x1 - sin * x2, sin * x1 + cos * x2], dim=-1)
    out = torch.cat([turned, kept], dim=-1)
    if four:
        return out.transpose(1, 2)
    return out.reshape(data.shape)
