"""A rank's static KV cache for one group of requests, and attention over it.

:class:`GroupCache` preallocates, per layer, ``K [B, Hc, T, D]`` and ``V [B, Hc, T, Dv]`` for the
``T`` positions this rank will hold of the group's requests (from the plan: the prompt, every
decode step, the KV layout), and writes each new position in place, in the next free slot. Keys
the graph repeats for grouped-query attention are stored once per KV head (checked on the first
write, not assumed). :func:`attention_partial` attends over any subset of positions, scored as the
graph scores them, as a mergeable partial (in torch's fused CPU kernel where the scores are a bias:
ALiBi, a window); :func:`whole_decode` and :func:`decode_scored` attend a decode step's one token in a
few operations. See docs/executor.md ("Decoding from the graph").
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from tessera.planners.cp.scores import ScoreMod

__all__ = [
    "GroupCache",
    "attention_partial",
    "decode_partial",
    "decode_scored",
    "whole_decode",
]

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def decode_partial(
    q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | None = None
) -> tuple[Tensor, Tensor] | None:
    """One new token's attention over these keys as a mergeable partial, in one fused call: ``q``
    ``[B, H, D]``, ``k``/``v`` ``[B, Hc, T, D]`` → ``(o [B, H, Dv], lse [B, H])`` (natural log), each
    KV head's query heads taken as its queries; ``bias``: added to the scores, ``[H, T]`` or ``[T]``
    (``-inf`` hides a key). None where torch's fused CPU kernel does not apply (another device, no
    keys, mixed dtypes or head sizes, no such kernel): the caller's kernel does it."""
    if _FLASH_CPU is None or q.device.type != "cpu" or k.shape[2] == 0 or not q.dtype == k.dtype == v.dtype:
        return None
    if k.shape[-1] != v.shape[-1]:
        return None
    b, h, d = q.shape
    hc = k.shape[1]
    mask = None if bias is None else bias.expand(h, -1).reshape(1, hc, h // hc, -1)
    o, lse = _FLASH_CPU(q.reshape(b, hc, h // hc, d), k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, h, v.shape[-1]), lse.reshape(b, h)


def attention_partial(  # noqa: PLR0913 - the positions, the scores and how, beside q, k, v
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    scores: ScoreMod,
    heads: slice = slice(None),
    *,
    sink: bool = True,
    fused: bool = False,
) -> tuple[Tensor, Tensor]:
    """Attention of queries ``q`` ``[B, H, S, D]`` at positions ``q_pos`` ``[S]`` over keys and values
    ``[B, Hc, T, D]`` at ``k_pos`` ``[T]`` (``H`` a multiple of ``Hc``: each KV head serves ``H/Hc``
    consecutive query heads), scored as the graph scores them (``heads``: which of the model's
    heads ``q`` holds, for ALiBi's slopes): ``(o [B, H, S, Dv], lse [B, H, S])``, normalized within
    these keys (o = 0, lse = -inf for a query that sees none), mergeable with
    :func:`~tessera.kernels.merge_partials`. Masks and biases use absolute positions, so any shard
    of the cache attends exactly as the whole would. A per-head attention sink (``scores.sinks``) is
    one more key of value 0 at no position: ``sink`` says this partial holds it (exactly one of
    the partials merged for a query does). ``fused``: in torch's fused CPU kernel where it applies
    (:func:`_fused_partial`); False is the reference the fused paths are tested against."""
    if fused and _fuses(q, k, v, scores, sink):
        return _fused_partial(q, k, v, q_pos, k_pos, scores, heads)
    b, h, s_len, d = q.shape
    hc = k.shape[1]
    group = q.float().reshape(b, hc, h // hc * s_len, d)  # a KV head's query heads, row after row
    t_len = k.shape[2]
    s = (group @ k.float().transpose(-1, -2)).reshape(b, h, s_len, t_len) * scores.scale
    if scores.softcap is not None:
        s = torch.tanh(s / scores.softcap) * scores.softcap
    distance = k_pos[None, :] - q_pos[:, None]  # j - i, [S, T]
    if scores.alibi is not None:
        slopes = _slopes(scores.alibi, s.device)[heads]
        s = s + slopes[:, None, None] * distance.to(s.dtype)
    hidden = distance > 0
    if scores.window is not None:
        hidden = hidden | (distance <= -scores.window)
    s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    if scores.sinks is not None and sink:
        lse = torch.logaddexp(lse, _slopes(scores.sinks, s.device)[heads][:, None].expand_as(lse))
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe[..., None]).reshape(b, hc, h // hc * s_len, t_len)
    return (p @ v.float()).reshape(b, h, s_len, v.shape[-1]), lse


def _fuses(q: Tensor, k: Tensor, v: Tensor, scores: ScoreMod, sink: bool) -> bool:
    """Whether torch's fused CPU kernel computes this partial: scores that are the scaled product
    plus a bias (not soft-capped, no sink held here), K and V of one head size, on the CPU."""
    fusable = scores.softcap is None and (scores.sinks is None or not sink)
    return (
        fusable
        and _FLASH_CPU is not None
        and q.device.type == "cpu"
        and 0 < k.shape[2]
        and k.shape[-1] == v.shape[-1]
    )


def _fused_partial(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scores: ScoreMod, heads: slice
) -> tuple[Tensor, Tensor]:
    """:func:`attention_partial` in one call of torch's fused CPU kernel: ALiBi's slopes and the
    causal and window masks (``-inf``) as one additive mask, in fp32 as the unfused path computes;
    a few operations where that path runs 15."""
    b, h, s_len, d = q.shape
    hc = k.shape[1]
    distance = k_pos[None, :] - q_pos[:, None]  # j - i, [S, T]
    hidden = distance > 0
    if scores.window is not None:
        hidden = hidden | (distance <= -scores.window)
    if scores.alibi is not None:
        bias = _slopes(scores.alibi, q.device)[heads][:, None, None] * distance.float()
    else:
        bias = torch.zeros(1, *distance.shape, device=q.device)
    bias = bias.masked_fill(hidden, float("-inf")).expand(h, s_len, -1)
    group = q.float().reshape(b, hc, h // hc * s_len, d)  # a KV head's query heads, row after row
    mask = bias.reshape(1, hc, h // hc * s_len, -1)
    o, lse = _FLASH_CPU(group, k.float(), v.float(), attn_mask=mask, scale=scores.scale)
    # A query that sees none of these keys: the kernel's o is 0 and its lse 0, a partial's is -inf.
    lse = lse.reshape(b, h, s_len).masked_fill(hidden.all(-1), float("-inf"))
    return o.reshape(b, h, s_len, v.shape[-1]), lse


def whole_decode(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scores: ScoreMod, heads: slice
) -> Tensor | None:
    """One new token's attention (``q`` ``[B, H, 1, D]``) over a whole cache, ``positions`` ``0 ..
    T - 1``, in one call of torch's fused kernel: a window is the last ``window`` keys; ALiBi's
    bias ``slope·(j − i)`` is passed as ``slope·j`` (a row's constant ``−slope·i`` leaves its softmax
    as it is, and BLOOM's graph adds ``slope·j`` itself). Soft-capped scores take a softmax in
    fp32 (6 operations, not the partial's 15). None for sinks, or ALiBi in another dtype than fp32
    (the unfused path computes those in fp32)."""
    if scores.sinks is not None or q.shape[2] != 1:
        return None
    if (
        scores.alibi is not None
        and scores.softcap is None
        and not q.dtype == k.dtype == v.dtype == torch.float32
    ):
        return None
    if scores.window is not None:
        k, v, positions = k[:, :, -scores.window :], v[:, :, -scores.window :], positions[-scores.window :]
    bias = _alibi(scores, heads, positions)
    b, h, _, d = q.shape
    hc = k.shape[1]
    if scores.softcap is not None:
        s = (q.float().reshape(b, hc, h // hc, d) @ k.float().transpose(-1, -2)) * scores.scale
        s = torch.tanh(s / scores.softcap) * scores.softcap
        if bias is not None:
            s = s + bias.reshape(hc, h // hc, -1)
        return (torch.softmax(s, dim=-1) @ v.float()).reshape(b, h, 1, v.shape[-1])
    # torch's own dispatch to the fused kernel costs twice the kernel where there is a mask
    fused = decode_partial(q[:, :, 0], k, v, scores.scale, bias)
    if fused is not None:
        return fused[0][:, :, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=None if bias is None else bias[:, None, :],
        scale=scores.scale, enable_gqa=hc != h,
    )  # fmt: skip


def decode_scored(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    past: int,
    scores: ScoreMod,
    heads: slice,
    *,
    sink: bool,
) -> tuple[Tensor, Tensor] | None:
    """One new token (``q`` ``[B, H, 1, D]``, at position ``past``) over a shard of the cache held at
    ``positions`` (all at or before ``past``), as :func:`attention_partial`'s mergeable partial in a
    few operations: ALiBi's bias as ``slope·j`` (the ``−slope·i`` every rank leaves out is one
    constant of the query's row: the merged output is the same), a window as which keys are
    visible, soft-capping by hand in fp32, the rest in torch's fused CPU kernel. None for a sink
    this partial holds, and off the CPU."""
    if (scores.sinks is not None and sink) or q.device.type != "cpu" or _FLASH_CPU is None:
        return None
    b, h, _, d = q.shape
    hc, dv = k.shape[1], v.shape[-1]
    visible = None if scores.window is None else positions > past - scores.window
    if k.shape[2] == 0 or (visible is not None and not bool(visible.any())):  # no key this query sees
        return q.new_zeros(b, h, 1, dv, dtype=torch.float32), q.new_full(
            (b, h, 1), float("-inf"), dtype=torch.float32
        )
    bias = _alibi(scores, heads, positions)
    if visible is not None:
        hidden = torch.where(visible, 0.0, float("-inf"))
        bias = hidden if bias is None else bias + hidden
    fused = (
        None
        if scores.softcap is not None
        else decode_partial(q.float()[:, :, 0], k.float(), v.float(), scores.scale, bias)
    )
    if fused is not None:
        return fused[0][:, :, None], fused[1][:, :, None]
    group = q.float().reshape(b, hc, h // hc, d)  # a KV head's query heads as its queries
    mask = None if bias is None else bias.expand(h, -1).reshape(1, hc, h // hc, -1)
    s = (group @ k.float().transpose(-1, -2)) * scores.scale
    if scores.softcap is not None:
        s = torch.tanh(s / scores.softcap) * scores.softcap
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, dim=-1)
    o = torch.exp(s - lse[..., None]) @ v.float()
    return o.reshape(b, h, 1, dv), lse.reshape(b, h, 1)


def _alibi(scores: ScoreMod, heads: slice, positions: Tensor) -> Tensor | None:
    """ALiBi's bias of keys at ``positions`` for these heads as ``slope·j`` ``[H, T]`` (the query's
    ``−slope·i`` left out: one constant of its row); None without ALiBi."""
    return (
        None
        if scores.alibi is None
        else _slopes(scores.alibi, positions.device)[heads][:, None] * positions.float()
    )


@functools.cache
def _slopes(alibi: tuple[float, ...], device: torch.device) -> Tensor:
    """Per-head values (ALiBi's slopes, sink logits) on ``device``, made once (a captured step may
    not copy from the host)."""
    return torch.tensor(alibi, dtype=torch.float32, device=device)


class GroupCache:
    """The KV cache one rank holds of one group of requests (they share positions, so slots):
    ``owner[p]`` is the rank holding position ``p`` (all of them outside cache parallelism)."""

    def __init__(self, owner: np.ndarray, rank: int, device: torch.device) -> None:
        self.owner, self.rank, self.device = owner, rank, device
        self.slots = int(np.count_nonzero(owner == rank))  # positions this rank will hold
        self.whole = self.slots == len(owner)  # every position here: slot p holds position p
        self.positions = torch.arange(self.slots, dtype=torch.long, device=device)
        self.held: dict[int, int] = {}  # layer -> slots written
        self.layers: dict[int, tuple[Tensor, Tensor]] = {}
        self.folds: dict[int, int] = {}  # layer -> query heads per stored head of the graph's K

    def write(self, layer: int, k: Tensor, v: Tensor, past: int) -> int:
        """Store the positions ``past .. past + S - 1`` of ``k``/``v`` ``[B, H, S, D]`` this rank holds,
        in place; return how many slots ``layer`` now holds."""
        if layer not in self.layers:
            self._allocate(layer, k, v)
        keys, values = self.layers[layer]
        fold, start = self.folds[layer], self.held.get(layer, 0)
        if self.whole or k.shape[2] == 1:  # every position (slot p holds p) or one: a slice in place
            end = start + k.shape[2] if self.whole or self.owner[past] == self.rank else start
            if end > start:
                keys[:, :, start:end] = k[:, ::fold]
                values[:, :, start:end] = v[:, ::fold]
                if not self.whole:  # (a whole cache's positions already hold their numbers)
                    self.positions[start] = past
            self.held[layer] = end
            return end
        mine = np.flatnonzero(self.owner[past : past + k.shape[2]] == self.rank)
        end = start + len(mine)
        if len(mine):
            index = torch.from_numpy(mine).to(k.device)
            keys[:, :, start:end] = k[:, ::fold].index_select(2, index)
            values[:, :, start:end] = v[:, ::fold].index_select(2, index)
            self.positions[start:end] = index + past
        self.held[layer] = end
        return end

    def read(self, layer: int, held: int) -> tuple[Tensor, Tensor, Tensor]:
        """The first ``held`` slots of ``layer``: K, V and their positions (views, no copy)."""
        keys, values = self.layers[layer]
        return keys[:, :, :held], values[:, :, :held], self.positions[:held]

    @property
    def positions_held(self) -> int:
        return self.held.get(0, 0)

    @property
    def nbytes(self) -> int:
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers.values()
        )

    def _allocate(self, layer: int, k: Tensor, v: Tensor) -> None:
        fold = _repeats(k)
        self.folds[layer] = fold if _repeats(v) % fold == 0 else 1
        heads, b = k.shape[1] // self.folds[layer], k.shape[0]
        self.layers[layer] = (
            torch.zeros(b, heads, self.slots, k.shape[3], dtype=k.dtype, device=self.device),
            torch.zeros(b, heads, self.slots, v.shape[3], dtype=v.dtype, device=self.device),
        )


def _repeats(t: Tensor) -> int:
    """The largest ``r`` dividing the heads of ``t`` ``[B, H, S, D]`` such that each run of ``r``
    consecutive heads holds the same values (grouped-query attention's repeated KV heads)."""
    h = t.shape[1]
    for r in range(h, 1, -1):
        if h % r == 0:
            runs = t.reshape(t.shape[0], h // r, r, *t.shape[2:])
            if bool((runs == runs[:, :, :1]).all()):
                return r
    return 1
