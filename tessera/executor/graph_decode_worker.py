"""One rank's share of a greedy decode run from the model's own ONNX graph (:mod:`graph_decoder`).

The graph's dense part runs as exported; each attention core attends over this rank's KV cache:
``dp`` ranks decode their own requests whole; ``tp`` ranks decode every request with their shard of
the projections the model's split reaches (GraphDecoder.shard: partial sums all-reduced, their own
heads; other cores attend with their share of every head, outputs all-gathered); ``cp`` ranks decode
every request and attend over the positions their KV shard holds, the partials merged exactly
(log-sum-exp) after an all-gather.
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
from tessera.executor.decode_program import compile_step
from tessera.executor.graph_decoder import GraphDecoder, Reduce
from tessera.executor.graphed_step import GraphedStep, greedy
from tessera.executor.kv_cache import (
    GroupCache,
    attention_partial,
    decode_partial,
    decode_scored,
    whole_decode,
)
from tessera.executor.kv_layout import KvLayout, request_slices
from tessera.executor.shm_gather import ShmGather, usable
from tessera.executor.step_check import check_stepwise
from tessera.kernels import merge_outputs
from tessera.models.gpt import llm_gpt
from tessera.planners.cp.recognize import recognize_decoder
from tessera.planners.cp.scores import ScoreMod

__all__ = ["DecodeWorker", "graph_decoder", "time_decode_step"]

MAX_SHM_BYTES = 64 * 2**20  # per rank and buffer; larger exchanges (long prefills) go through gloo


def graph_decoder(
    model: str | onnx.ModelProto,
    *,
    label: str | None = None,
    check: bool = True,
    shard: tuple[int, int, Reduce] | None = None,
) -> GraphDecoder:
    """The decode step of the decoder ``model`` (a path or a model; InputError when it is none),
    recognized as loaded (symbolic dimensions bound to 1, as ``plan`` recognizes it); ``shard``:
    (t, index, reduce) of a tensor-parallel rank (:meth:`GraphDecoder.shard`); ``check``: and
    checked to decode with a KV cache what the whole graph computes
    (:func:`~tessera.executor.step_check.check_stepwise`)."""
    graph = load_graph(model, label=label)
    recognized = recognize_decoder(graph)
    decoder = GraphDecoder(graph, recognized)
    if shard is not None:
        decoder.shard(graph, recognized, *shard)
    if check:
        check_stepwise(decoder)
    return decoder


class DecodeWorker:
    """One rank: its decoder, its requests and its KV cache (``tokens`` after :meth:`prefill`/:meth:`step`)."""

    def __init__(self, spec: Any, rank: int, device: torch.device) -> None:
        from tessera.kernels import get_partial_attention

        self.spec, self.rank, self.world, self.strategy = spec, rank, spec.world_size, spec.strategy
        self.device = device  # the model, its inputs and the KV cache live there (a GPU under NCCL)
        self.kernel = get_partial_attention(spec.options.attention)  # a decode step's shard attention
        self.fused = spec.options.attention == "torch"  # torch's fused CPU kernel where it applies
        # Not checked again: the launcher checked the model file; an --llm plan's GPT is tessera's own.
        # A tp rank holds its block of every product the dataflow split finds (GraphDecoder.shard).
        shard = (self.world, rank, self._all_reduce) if self.strategy == "tp" and self.world > 1 else None
        if spec.model_path is not None:
            self.decoder = graph_decoder(spec.model_path, check=False, shard=shard)
        else:  # an --llm plan: the GPT of its config, seeded random weights
            model = materialize(llm_gpt(spec.llm, spec.options.seed))
            label = f"--llm {spec.llm.get('name', 'config')}"
            self.decoder = graph_decoder(model, label=label, check=False, shard=shard)
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
        # Each group's static KV cache, sized for every position its requests will hold here.
        self.caches = [GroupCache(self.owner[group[0]], rank, device) for group in self.groups]
        self.tokens: dict[int, list[int]] = {b: [] for b in self.requests}
        self.comm_s = 0.0
        self.shm: ShmGather | None = None  # see connect()
        self.compiled: dict[str, str | None] = {}  # "batch×length" -> None (compiled) or why not
        self.graphed: dict[int, GraphedStep | None] = {}  # group -> its decode step in fixed shapes
        self.capture = False  # see compile()

    def compile(self, mode: str) -> None:
        """Build each group's decode-step program (``mode``: ``fx``, ``inductor``, or ``interpret``
        for none); a step that cannot be compiled stays interpreted (``compiled`` says why).

        A group's prefill runs once: it is interpreted. Tracing it would cost more than it saves (the
        trace's check alone interprets the same shapes twice)."""
        if mode == "interpret":
            return
        for size in sorted({len(group) for group in self.groups}):
            if f"{size}x1" not in self.compiled:
                self.compiled[f"{size}x1"] = compile_step(self.decoder, size, 1, inductor=mode == "inductor")
        # On a GPU each traced decode step is captured as a CUDA graph (graphed_step), where this
        # rank holds every position of its requests and attends without collectives.
        self.capture = (
            mode != "interpret" and self.device.type == "cuda" and (self.strategy == "dp" or self.world == 1)
        )

    # -- the decode --

    def prefill(self) -> None:
        """Each group's prompts in one pass; the first generated token of each."""
        for i, group in enumerate(self.groups):
            prompts = torch.tensor(
                [self.spec.prompts[b] for b in group], dtype=torch.long, device=self.device
            )
            self._next(i, prompts, 0)

    def prepare_steps(self) -> None:
        """After the prefill: each group's decode step captured (on a GPU), before the clock starts."""
        for i, group in enumerate(self.groups):
            graphed = self._graphed(i) if self.capture else None
            if graphed is not None:
                graphed.prepare([self.tokens[b][-1] for b in group], self.prompt_lens[group[0]])
                self.compiled[f"cuda graph {len(group)}x1"] = graphed.why_not  # None: captured

    def step(self, step: int) -> None:
        """Feed each request's last token (position ``prompt_len + step``), append one token."""
        for i, group in enumerate(self.groups):
            graphed = self._graphed(i) if self.capture else None
            if graphed is not None:
                past = self.prompt_lens[group[0]] + step
                nexts = graphed.run([self.tokens[b][-1] for b in group], past)
                self.compiled[f"cuda graph {len(group)}x1"] = graphed.why_not  # None: captured
                for b, t in zip(group, nexts, strict=True):
                    self.tokens[b].append(int(t))
                continue
            last = torch.tensor([[self.tokens[b][-1]] for b in group], dtype=torch.long, device=self.device)
            self._next(i, last, self.prompt_lens[group[0]] + step)

    def _graphed(self, i: int) -> GraphedStep | None:
        """Group ``i``'s step in fixed shapes, made at its first decode step (the prefill has sized
        its cache); None, with the reason in ``compiled``, where it cannot be made."""
        if i not in self.graphed:
            try:
                self.graphed[i] = GraphedStep(self.decoder, self.caches[i], len(self.groups[i]), capture=True)
            except ValueError as exc:
                self.graphed[i] = None
                self.compiled[f"cuda graph {len(self.groups[i])}x1"] = str(exc)
        return self.graphed[i]

    def _next(self, i: int, tokens: Tensor, past: int) -> None:
        logits = self.decoder.logits(tokens, past, self._attend(self.caches[i]))
        for b, t in zip(
            self.groups[i], greedy(logits, past + tokens.shape[1] - 1, self.groups[i]), strict=True
        ):
            self.tokens[b].append(int(t))

    def _attend(self, cache: GroupCache) -> Callable[[int, Tensor, Tensor, Tensor, ScoreMod, int], Tensor]:
        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor, scores: ScoreMod, past: int) -> Tensor:
            heads = slice(None)  # a sharded core's heads and scores are this rank's alone (shard())
            gather = self.strategy == "tp" and self.world > 1 and layer not in self.decoder.sharded
            if gather:  # every head: this rank attends with its share, then gathers
                heads = slice(*_share(q.shape[1], self.rank, self.world))
                q = q[:, heads]
                if k.shape[1] > 1:  # one K/V head (multi-query) is broadcast to every rank's heads
                    k, v = k[:, heads], v[:, heads]
            held = cache.write(layer, k, v, past)
            keys, values, positions = cache.read(layer, held)
            if self.strategy != "cp" or self.world == 1:  # every key of the request is here
                o = _attention(q, keys, values, positions, past, scores, heads)
                return torch.cat(tuple(self._gather_stacked(o)), dim=1) if gather else o
            if q.shape[2] == 1 and scores.plain:  # every key held is at or before the query (--attention)
                fused = decode_partial(q[:, :, 0], keys, values, scores.scale) if self.fused else None
                o, lse = fused or self.kernel(q[:, :, 0], keys, values, scale=scores.scale)
                o, lse = o[:, :, None], lse[:, :, None]
            else:
                sink = self.rank == 0  # one rank's partial holds the sink (scores.sinks), once
                one = (
                    decode_scored(q, keys, values, positions, past, scores, heads, sink=sink)
                    if q.shape[2] == 1
                    else None
                )
                if one is None:
                    q_pos = torch.arange(past, past + q.shape[2], device=q.device)
                    one = attention_partial(
                        q, keys, values, q_pos, positions, scores, heads, sink=sink, fused=True
                    )
                o, lse = one
            # one exchange a layer: each rank's partial with its log-sum-exp as one more column
            parts = self._gather_stacked(torch.cat([o.float(), lse.float()[..., None]], dim=-1))
            return merge_outputs(parts[..., :-1], parts[..., -1]).to(o.dtype)

        return attend

    def connect(self) -> None:
        """After the process group is up: gather through shared memory where the ranks share a host
        (:mod:`~tessera.executor.shm_gather`), sized for the largest exchange of the run."""
        if self.strategy == "dp" or not usable(self.world) or self.device.type != "cpu":
            return
        heads, head_dim = int(self.spec.llm["heads"]), int(self.spec.llm["head_dim"])
        width = max(heads * (head_dim + 1), int(self.spec.llm["hidden"]))  # a core's output, a tp partial
        largest = max(len(g) * max(self.prompt_lens[g[0]], 1) * width * 4 for g in self.groups)
        self.shm = ShmGather(self.rank, self.world, min(largest, MAX_SHM_BYTES), self.spec.timeout_s)

    def _all_reduce(self, t: Tensor) -> Tensor:
        """Every tp rank's partial sums ``t`` summed, in rank order (the same sum on every rank),
        in fp32 at least."""
        parts = self._gather_stacked(t)
        return parts.sum(0, dtype=torch.promote_types(t.dtype, torch.float32)).to(t.dtype)

    def _gather_stacked(self, t: Tensor) -> Tensor:
        """Every rank's ``t`` as ``[world, *t.shape]``: through shared memory where it fits, else gloo."""
        t0 = time.perf_counter()
        if self.shm is not None and self.shm.fits(t):
            parts = self.shm.stacked(t)
        else:
            gathered = [torch.empty_like(t) for _ in range(self.world)]
            dist.all_gather(gathered, t.contiguous())
            parts = torch.stack(gathered)
        self.comm_s += time.perf_counter() - t0
        return parts

    # -- what the report reads --

    @property
    def kv_positions(self) -> int:
        return sum(self.kv_positions_by_request().values())

    def kv_positions_by_request(self) -> dict[int, int]:
        return {
            b: cache.positions_held
            for group, cache in zip(self.groups, self.caches, strict=True)
            for b in group
        }

    @property
    def kv_cache_bytes(self) -> int:
        return sum(cache.nbytes for cache in self.caches)

    def request_range(self) -> list[int]:
        """``[first, end)`` of the requests this rank decodes (dp: its own; tp, cp: all)."""
        return [self.lo, self.hi] if self.strategy == "dp" else [0, len(self.spec.prompts)]

    def reported_tokens(self) -> dict[int, list[int]]:
        """dp: this rank's requests; tp and cp: every request, from rank 0 only (all ranks agree)."""
        return self.tokens if self.strategy == "dp" or self.rank == 0 else {}


def _share(n: int, rank: int, world: int) -> tuple[int, int]:
    per = n // world
    return rank * per, (rank + 1) * per


def _attention(
    q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, past: int, scores: ScoreMod, heads: slice
) -> Tensor:
    """Attention over every key of the requests (dp, tp, one rank; the cache whole, in position
    order): one fused call where the scores are plain and every key is visible (a decode step, or a
    prefill with nothing cached), or a decode step's scores are a window or a bias."""
    s_len, t_len = q.shape[2], keys.shape[2]
    if scores.plain and (s_len == 1 or (past == 0 and s_len == t_len)):
        return torch.nn.functional.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), is_causal=s_len > 1, scale=scores.scale,
            enable_gqa=keys.shape[1] != q.shape[1],
        )  # fmt: skip
    fused = whole_decode(q, keys, values, positions, scores, heads)
    if fused is not None:
        return fused
    q_pos = torch.arange(past, past + s_len, device=q.device)
    return attention_partial(q, keys, values, q_pos, positions, scores, heads, fused=True)[0]


def time_decode_step(
    decoder: GraphDecoder,
    steps: int,
    context: int = 64,
    exchange: Callable[[Tensor], Tensor] | None = None,
    *,
    mean: bool = False,
) -> float:
    """Median seconds of one batch-1 decode step of ``decoder`` as a dp rank runs it (its traced
    program, a static cache, the fused attention), after a ``context``-token prefill: what
    ``calibrate`` divides by the step's operations. ``exchange``: each core's output goes through it
    (a gather between ranks, as a tp or cp step exchanges once a layer). ``mean``: the mean step
    (what ``launch`` reports per token), not the median."""
    cache = GroupCache(np.zeros(context + steps + 1, dtype=np.int64), 0, torch.device("cpu"))
    if (1, 1) not in decoder.programs:
        compile_step(decoder, 1, 1)

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor, scores: ScoreMod, past: int) -> Tensor:
        keys, values, positions = cache.read(layer, cache.write(layer, k, v, past))
        o = _attention(q, keys, values, positions, past, scores, slice(None))
        return o if exchange is None else exchange(o)

    tokens = torch.arange(context)[None] % decoder.vocab
    last = int(torch.argmax(decoder.logits(tokens, 0, attend)[0, -1]))
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        logits = decoder.logits(torch.tensor([[last]]), context + k, attend)
        (last,) = greedy(logits, context + k)  # as a rank picks it: the logits checked finite
        times.append(time.perf_counter() - t0)
    return float(np.mean(times) if mean else np.median(times))
