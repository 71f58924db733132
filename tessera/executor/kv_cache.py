"""A rank's static KV cache for one group of requests, and attention over it.

:class:`GroupCache` preallocates, per layer, ``K [B, Hc, T, D]`` and ``V [B, Hc, T, Dv]`` for the
``T`` positions this rank will hold of the group's requests (from the plan: the prompt, every
decode step, the KV layout), and writes each new position in place, in the next free slot. Keys
the graph repeats for grouped-query attention are stored once per KV head (checked on the first
write, not assumed). :func:`attention_partial` attends over any subset of positions, scored as the
graph scores them, as a mergeable partial. See docs/executor.md ("Decoding from the graph").
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from tessera.planners.cp.scores import ScoreMod

__all__ = ["GroupCache", "attention_partial", "decode_partial"]

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def decode_partial(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor] | None:
    """One new token's plain attention over these keys as a mergeable partial, in one fused call:
    ``q`` ``[B, H, D]``, ``k``/``v`` ``[B, Hc, T, D]`` → ``(o [B, H, Dv], lse [B, H])`` (natural log),
    each KV head's query heads taken as its queries. None where torch's fused CPU kernel does not
    apply (another device, no keys, no such kernel): the caller's kernel does it."""
    if _FLASH_CPU is None or q.device.type != "cpu" or k.shape[2] == 0 or not q.dtype == k.dtype == v.dtype:
        return None
    b, h, d = q.shape
    hc = k.shape[1]
    o, lse = _FLASH_CPU(q.reshape(b, hc, h // hc, d), k, v, scale=scale)
    return o.reshape(b, h, v.shape[-1]), lse.reshape(b, h)


def attention_partial(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    scores: ScoreMod,
    heads: slice = slice(None),
    *,
    sink: bool = True,
) -> tuple[Tensor, Tensor]:
    """Attention of queries ``q`` ``[B, H, S, D]`` at positions ``q_pos`` ``[S]`` over keys and values
    ``[B, Hc, T, D]`` at ``k_pos`` ``[T]`` (``H`` a multiple of ``Hc``: each KV head serves ``H/Hc``
    consecutive query heads), scored as the graph scores them (``heads``: which of the model's
    heads ``q`` holds, for ALiBi's slopes): ``(o [B, H, S, Dv], lse [B, H, S])``, normalized within
    these keys (o = 0, lse = -inf for a query that sees none), mergeable with
    :func:`~tessera.kernels.merge_partials`. Masks and biases use absolute positions, so any shard
    of the cache attends exactly as the whole would. A per-head attention sink (``scores.sinks``) is
    one more key of value 0 at no position: ``sink`` says this partial holds it (exactly one of
    the partials merged for a query does)."""
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
        self.positions = torch.zeros(self.slots, dtype=torch.long, device=device)
        self.held: dict[int, int] = {}  # layer -> slots written
        self.layers: dict[int, tuple[Tensor, Tensor]] = {}
        self.folds: dict[int, int] = {}  # layer -> query heads per stored head of the graph's K

    def write(self, layer: int, k: Tensor, v: Tensor, past: int) -> int:
        """Store the positions ``past .. past + S - 1`` of ``k``/``v`` ``[B, H, S, D]`` this rank holds,
        in place; return how many slots ``layer`` now holds."""
        mine = np.flatnonzero(self.owner[past : past + k.shape[2]] == self.rank)
        if layer not in self.layers:
            self._allocate(layer, k, v)
        start = self.held.get(layer, 0)
        end = start + len(mine)
        if len(mine):
            keys, values = self.layers[layer]
            fold = self.folds[layer]
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
