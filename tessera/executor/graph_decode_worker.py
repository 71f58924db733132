"""One rank's share of a greedy decode run from the model's own ONNX graph (:mod:`graph_decoder`).

The graph's dense part runs as exported; each attention core attends over this rank's KV cache:
``dp`` ranks decode their own requests whole; ``tp`` ranks decode every request and attend with
their share of the heads (outputs all-gathered); ``cp`` ranks decode every request and attend over
the positions their KV shard holds, the partials merged exactly (log-sum-exp) after an all-gather.
Requests at the same position run as one batch. See docs/executor.md ("Decoding from the graph").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
import torch.distributed as dist
from torch import Tensor

from tessera.core.graph import load_graph
from tessera.core.weights import materialize
from tessera.executor.graph_decoder import GraphDecoder
from tessera.executor.kv_layout import KvLayout, request_slices
from tessera.kernels import merge_partials
from tessera.models.gpt import llm_gpt
from tessera.planners.cp.recognize import recognize_decoder
from tessera.planners.cp.scores import ScoreMod

__all__ = ["DecodeWorker", "attention_partial", "graph_decoder"]


def graph_decoder(model: str | onnx.ModelProto, *, label: str | None = None) -> GraphDecoder:
    """The decode step of the decoder ``model`` (a path or a model; InputError when it is none),
    recognized as loaded (symbolic dimensions bound to 1, as ``plan`` recognizes it)."""
    graph = load_graph(model, label=label)
    return GraphDecoder(graph, recognize_decoder(graph))


def attention_partial(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    scores: ScoreMod,
    heads: slice = slice(None),
) -> tuple[Tensor, Tensor]:
    """Attention of queries ``q`` ``[H, S, D]`` at positions ``q_pos`` over keys/values ``[H or 1,
    T, D]`` at ``k_pos``, scored as the graph scores them (``scores``; ``heads``: which of the
    model's heads ``q`` holds, for ALiBi's slopes): ``(o [H, S, D], lse [H, S])``, normalized within
    these keys (o = 0, lse = -inf for a query that sees none of them), mergeable with
    :func:`merge_partials`. Masks and biases use absolute positions, so any shard of the cache
    attends exactly as the whole would."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scores.scale
    if scores.softcap is not None:
        s = torch.tanh(s / scores.softcap) * scores.softcap
    distance = k_pos[None, None, :] - q_pos[None, :, None]  # j - i
    if scores.alibi is not None:
        slopes = torch.tensor(scores.alibi, dtype=s.dtype, device=s.device)[heads]
        s = s + slopes[:, None, None] * distance.to(s.dtype)
    hidden = distance > 0
    if scores.window is not None:
        hidden = hidden | (distance <= -scores.window)
    s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(s - safe[..., None]) @ v.float(), lse


class DecodeWorker:
    """One rank: its decoder, its requests and its KV cache (``tokens`` after :meth:`prefill`/:meth:`step`)."""

    def __init__(self, spec: Any, rank: int, device: torch.device) -> None:
        from tessera.kernels import get_partial_attention

        self.spec, self.rank, self.world, self.strategy = spec, rank, spec.world_size, spec.strategy
        self.device = device  # the model, its inputs and the KV cache live there (a GPU under NCCL)
        self.kernel = get_partial_attention(spec.options.attention)  # a decode step's shard attention
        if spec.model_path is not None:
            self.decoder = graph_decoder(spec.model_path)
        else:  # an --llm plan: the GPT of its config, seeded random weights
            model = materialize(llm_gpt(spec.llm, spec.options.seed))
            self.decoder = graph_decoder(model, label=f"--llm {spec.llm.get('name', 'config')}")
        self.decoder.module.to(device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.decoder.module.parameters())
        batch = len(spec.prompts)
        self.lo, self.hi = request_slices(batch, self.world)[rank]
        self.requests = list(range(self.lo, self.hi)) if self.strategy == "dp" else list(range(batch))
        self.prompt_lens = [len(p) for p in spec.prompts]
        total = [n + spec.options.new_tokens - 1 for n in self.prompt_lens]
        if self.strategy == "cp":
            layout = KvLayout(spec.kv_shards, spec.kv_block)
            self.owner = {b: layout.owners(total[b]) for b in self.requests}
        else:
            self.owner = {b: np.full(total[b], rank, dtype=np.int64) for b in self.requests}
        # Requests at one position decode as one batch; the same groups, in the same order, on every
        # rank that decodes them (tp, cp), so their collectives pair up.
        groups: dict[int, list[int]] = {}
        for b in self.requests:
            groups.setdefault(self.prompt_lens[b], []).append(b)
        most = self.decoder.fixed_batch or max(1, len(self.requests))  # a fixed batch axis bounds a pass
        self.groups = [
            groups[n][i : i + most] for n in sorted(groups) for i in range(0, len(groups[n]), most)
        ]
        self.cache: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = {}  # (request, layer) -> K, V, pos
        self.tokens: dict[int, list[int]] = {b: [] for b in self.requests}
        self.comm_s = 0.0

    # -- the decode --

    def prefill(self) -> None:
        """Each group's prompts in one pass; the first generated token of each."""
        for group in self.groups:
            prompts = torch.tensor(
                [self.spec.prompts[b] for b in group], dtype=torch.long, device=self.device
            )
            self._next(group, prompts, 0)

    def step(self, step: int) -> None:
        """Feed each request's last token (position ``prompt_len + step``), append one token."""
        for group in self.groups:
            last = torch.tensor([[self.tokens[b][-1]] for b in group], dtype=torch.long, device=self.device)
            self._next(group, last, self.prompt_lens[group[0]] + step)

    def _next(self, group: list[int], tokens: Tensor, past: int) -> None:
        logits = self.decoder.logits(tokens, past, self._attend(group))
        for b, t in zip(group, torch.argmax(logits[:, -1], dim=-1).tolist(), strict=True):
            self.tokens[b].append(int(t))

    def _attend(self, group: list[int]) -> Callable[[int, Tensor, Tensor, Tensor, ScoreMod, int], Tensor]:
        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor, scores: ScoreMod, past: int) -> Tensor:
            q_pos = torch.arange(past, past + q.shape[2])
            heads = slice(None)
            if self.strategy == "tp":
                heads = slice(*_share(q.shape[1], self.rank, self.world))
                q = q[:, heads]
                if k.shape[1] > 1:  # one K/V head (multi-query) is broadcast to every rank's heads
                    k, v = k[:, heads], v[:, heads]
            parts = [
                self._partial(b, layer, q[i], k[i], v[i], q_pos, scores, heads) for i, b in enumerate(group)
            ]
            o = torch.stack([p[0] for p in parts])
            if self.world == 1 or self.strategy == "dp":
                return o
            if self.strategy == "tp":  # every rank's heads, in order
                return torch.cat(self._all_gather(o), dim=1)
            lse = torch.stack([p[1] for p in parts])
            return merge_partials(torch.stack(self._all_gather(o)), torch.stack(self._all_gather(lse)))[0]

        return attend

    def _partial(  # noqa: PLR0913
        self,
        b: int,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_pos: Tensor,
        scores: ScoreMod,
        heads: slice,
    ) -> tuple[Tensor, Tensor]:
        """Store the new keys this rank holds for request ``b``, attend ``q`` over all it holds."""
        # Which positions this rank holds: worked out on the CPU (``q_pos`` is), used where k is.
        mine = torch.from_numpy(self.owner[b][q_pos.numpy()] == self.rank).to(k.device)
        q_pos = q_pos.to(k.device)
        new = (k[:, mine], v[:, mine], q_pos[mine])
        held = self.cache.get((b, layer))
        if held is not None:
            new = tuple(
                torch.cat([a, n], dim=-2 if n.dim() > 1 else 0) for a, n in zip(held, new, strict=True)
            )
        self.cache[(b, layer)] = new  # type: ignore[assignment]
        keys, values, positions = self.cache[(b, layer)]
        if q.shape[1] == 1 and scores.plain:  # every key held is at or before the query (--attention)
            o, lse = self.kernel(q[None, :, 0], keys[None], values[None], scale=scores.scale)
            return o[0, :, None], lse[0, :, None]
        return attention_partial(q, keys, values, q_pos, positions, scores, heads)

    def _all_gather(self, t: Tensor) -> list[Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.world)]
        t0 = time.perf_counter()
        dist.all_gather(parts, t.contiguous())
        self.comm_s += time.perf_counter() - t0
        return parts

    # -- what the report reads --

    @property
    def kv_positions(self) -> int:
        return sum(self.kv_positions_by_request().values())

    def kv_positions_by_request(self) -> dict[int, int]:
        layer0 = {b: held[2].numel() for (b, layer), held in self.cache.items() if layer == 0}
        return {b: layer0.get(b, 0) for b in self.requests}

    @property
    def kv_cache_bytes(self) -> int:
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v, _ in self.cache.values()
        )

    def request_range(self) -> list[int]:
        """``[first, end)`` of the requests this rank decodes (dp: its own; tp, cp: all)."""
        return [self.lo, self.hi] if self.strategy == "dp" else [0, len(self.spec.prompts)]

    def reported_tokens(self) -> dict[int, list[int]]:
        """dp: this rank's requests; tp and cp: every request, from rank 0 only (all ranks agree)."""
        return self.tokens if self.strategy == "dp" or self.rank == 0 else {}


def _share(n: int, rank: int, world: int) -> tuple[int, int]:
    per = n // world
    return rank * per, (rank + 1) * per
