"""The CP decode worker: one rank's share of a cache-parallel (or TP / DP) greedy decode.

:func:`cp_worker` is every rank's entry point: it prefills the requests it keeps KV for, then runs
``new_tokens - 1`` decode steps. Per layer and step a ``cp`` rank all-gathers Q/K/V, attends all
queries to its KV shard (``(o, lse)`` partials), exchanges the partials all-to-all and merges them
exactly (log-sum-exp); ``tp`` ranks all-reduce their partial sums; ``dp`` ranks do not talk.
See docs/executor.md ("CP decode workers").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from tessera.executor.decoder import (
    attention_out,
    embed,
    feed_forward,
    lm_logits,
    onnx_decoder_weights,
    prefill,
    qkv,
    random_decoder_weights,
    to_device,
    tp_shard,
)
from tessera.executor.graph_decode_worker import GraphDecodeWorker
from tessera.executor.kv_layout import KvLayout, request_slices
from tessera.executor.launcher import (
    WATCHDOG_FACTOR,
    Watchdog,
    inject_test_fault,
    memory_status,
    worker_setup,
)


@dataclass(frozen=True)
class DecodeOptions:
    """One decode run: ``new_tokens`` generated per request; ``prompt_lens`` per request (None:
    every request has the plan's context; fewer than the batch are repeated cyclically); the
    ``seed`` of the prompts' token ids (and of the weights of an ``--llm`` plan); the shard
    attention implementation (``torch`` reference or ``triton``)."""

    new_tokens: int = 8
    prompt_lens: tuple[int, ...] | None = None
    prompts: tuple[tuple[int, ...], ...] | None = None  # the requests' token ids (--prompts), in order
    seed: int = 0
    attention: str = "torch"


@dataclass(frozen=True)
class CpWorkerSpec:
    """What every rank gets (picklable)."""

    strategy: str
    world_size: int
    devices: list[str]
    llm: dict[str, Any]
    model_path: str | None
    prompts: list[list[int]]
    options: DecodeOptions
    kv_shards: list[tuple[int, int]]
    kv_block: int
    timeout_s: float
    backend: str
    graph: bool = False  # decode from the model's own graph (GraphDecodeWorker), else the GPT decoder


class DecodeWorker:
    """One rank's share of the decode (docs/executor.md says what each strategy holds)."""

    def __init__(self, spec: CpWorkerSpec, rank: int, device: torch.device) -> None:
        from tessera.kernels import get_partial_attention

        self.spec, self.rank, self.device = spec, rank, device
        self.world = spec.world_size
        self.strategy = spec.strategy
        self.attend = get_partial_attention(spec.options.attention)
        full = (
            onnx_decoder_weights(spec.model_path, spec.llm)
            if spec.model_path is not None
            else random_decoder_weights(spec.llm, spec.options.seed)
        )
        self.w = tp_shard(full, rank, self.world) if self.strategy == "tp" else full
        self.w = to_device(self.w, device)
        self.weight_bytes = self.w.nbytes()
        batch = len(spec.prompts)
        self.slices = request_slices(batch, self.world)
        self.lo, self.hi = self.slices[rank]
        self.prompt_lens = [len(p) for p in spec.prompts]
        # Requests whose dense part (projections, FFN, LM head) this rank computes, and whose KV it holds.
        if self.strategy == "tp":
            self.dense = list(range(batch))
        else:
            self.dense = list(range(self.lo, self.hi))
        self.cached = self.dense if self.strategy != "cp" else list(range(batch))
        # Positions fed to the model: prompt, then new_tokens - 1 decode steps.
        total = [n + spec.options.new_tokens - 1 for n in self.prompt_lens]
        if self.strategy == "cp":
            layout = KvLayout(spec.kv_shards, spec.kv_block)
            self.owner = [layout.owners(t) for t in total]
        else:
            self.owner = [np.full(t, rank, dtype=np.int64) for t in total]
        cap = max((int((self.owner[b] == rank).sum()) for b in self.cached), default=0)
        hkv, d = self.w.kv_heads, self.w.head_dim
        shape = (len(self.cached), hkv, max(cap, 1), d)
        self.k = [torch.zeros(shape, device=device) for _ in self.w.layers]
        self.v = [torch.zeros(shape, device=device) for _ in self.w.layers]
        self.kv_len = torch.zeros(len(self.cached), dtype=torch.int64, device=device)
        self.kv_cache_bytes = 2 * len(self.w.layers) * len(self.cached) * hkv * cap * d * 4
        self.tokens: dict[int, list[int]] = {b: [] for b in self.dense}
        self.comm_s = 0.0

    @property
    def kv_positions(self) -> int:
        return int(self.kv_len.sum())

    def kv_positions_by_request(self) -> dict[int, int]:
        return dict(zip(self.cached, self.kv_len.tolist(), strict=True))

    def request_range(self) -> list[int]:
        """``[first, end)`` of the requests whose tokens this rank computes."""
        return [self.lo, self.hi] if self.strategy != "tp" else [0, len(self.spec.prompts)]

    def reported_tokens(self) -> dict[int, list[int]]:
        """dp, cp: this rank's requests; tp: every request, from rank 0 only."""
        return self.tokens if self.strategy != "tp" or self.rank == 0 else {}

    # -- communication --

    def _timed(self, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.comm_s += time.perf_counter() - t0
        return out

    def _all_reduce(self, t: Tensor) -> Tensor:
        if self.world > 1:
            self._timed(lambda: dist.all_reduce(t))
        return t

    def _all_gather_requests(self, mine: Tensor) -> Tensor:
        """``[hi - lo, W]`` rows of this rank's requests -> ``[B, W]`` of all requests (padded gather)."""
        width = mine.shape[1]
        most = max(hi - lo for lo, hi in self.slices)
        padded = torch.zeros(most, width, device=self.device)
        padded[: mine.shape[0]] = mine
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        self._timed(lambda: dist.all_gather(parts, padded))
        return torch.cat([p[: hi - lo] for p, (lo, hi) in zip(parts, self.slices, strict=True)])

    def _all_to_all_requests(self, rows: Tensor) -> Tensor:
        """``[B, W]`` rows for every request -> ``[N, hi - lo, W]``: each rank's rows of my requests."""
        counts = [hi - lo for lo, hi in self.slices]
        mine = self.hi - self.lo
        out = torch.empty(self.world * mine, rows.shape[1], device=self.device)
        self._timed(
            lambda: dist.all_to_all_single(
                out, rows.contiguous(), output_split_sizes=[mine] * self.world, input_split_sizes=counts
            )
        )
        return out.reshape(self.world, mine, rows.shape[1])

    # -- prefill --

    @torch.no_grad()
    def prefill(self) -> None:
        """Every cached request's prompt (replicated compute); keep this rank's positions / heads."""
        reduce = self._all_reduce if self.strategy == "tp" else (lambda t: t)
        for i, b in enumerate(self.cached):
            prompt = torch.tensor(self.spec.prompts[b], dtype=torch.long, device=self.device)
            logits, cache = prefill(self.w, prompt, reduce)
            keep = torch.from_numpy(np.flatnonzero(self.owner[b][: len(prompt)] == self.rank)).to(self.device)
            n = keep.numel()
            for layer, (k, v) in enumerate(cache):
                self.k[layer][i, :, :n] = k[:, keep]
                self.v[layer][i, :, :n] = v[:, keep]
            self.kv_len[i] = n
            if b in self.tokens:
                self.tokens[b].append(int(torch.argmax(logits)))

    # -- one decode step --

    @torch.no_grad()
    def step(self, step: int) -> None:
        """Feed each request's last token (position ``prompt_len + step``), append one token."""
        w, d = self.w, self.w.head_dim
        tokens = torch.tensor([self.tokens[b][-1] for b in self.dense], dtype=torch.long, device=self.device)
        positions = torch.tensor([self.prompt_lens[b] + step for b in self.dense], device=self.device)
        own = torch.tensor(
            [bool(self.owner[b][self.prompt_lens[b] + step] == self.rank) for b in self.cached],
            device=self.device,
        )
        rows = own.nonzero().flatten()
        x = embed(w, tokens, positions)
        for layer_index, layer in enumerate(w.layers):
            q, k, v = qkv(w, layer, x)
            if self.strategy == "cp":
                hq, hkv = q.shape[1], k.shape[1]
                packed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
                gathered = self._all_gather_requests(packed) if self.world > 1 else packed
                q = gathered[:, : hq * d].reshape(gathered.shape[0], hq, d)
                k = gathered[:, hq * d : (hq + hkv) * d].reshape(gathered.shape[0], hkv, d)
                v = gathered[:, (hq + hkv) * d :].reshape(gathered.shape[0], hkv, d)
            kc, vc = self.k[layer_index], self.v[layer_index]
            if rows.numel():
                slots = self.kv_len[rows]
                kc[rows, :, slots] = k[rows]
                vc[rows, :, slots] = v[rows]
            kv_len = self.kv_len + own.to(torch.int64)
            o, lse = self.attend(q, kc, vc, kv_len=kv_len, scale=w.scale)
            if self.strategy == "cp" and self.world > 1:
                hq = q.shape[1]
                parts = self._all_to_all_requests(torch.cat([o.flatten(1), lse], dim=1))
                o, _ = _merge(parts, hq, d)
            attn = o.flatten(1)
            x = x + self._reduce_tp(attention_out(layer, attn))
            x = x + self._reduce_tp(feed_forward(w, layer, x))
        self.kv_len += own.to(torch.int64)
        nxt = torch.argmax(lm_logits(w, x), dim=-1).tolist()
        for b, t in zip(self.dense, nxt, strict=True):
            self.tokens[b].append(int(t))

    def _reduce_tp(self, t: Tensor) -> Tensor:
        return self._all_reduce(t) if self.strategy == "tp" else t


def _merge(parts: Tensor, hq: int, d: int) -> tuple[Tensor, Tensor]:
    """``[N, b, Hq·D + Hq]`` partials (o, lse) of ``b`` requests from N shards -> merged (o, lse)."""
    from tessera.kernels import merge_partials

    n, b = parts.shape[0], parts.shape[1]
    os = parts[..., : hq * d].reshape(n, b, hq, d)
    lses = parts[..., hq * d :]
    return merge_partials(os, lses)


def cp_worker(spec: CpWorkerSpec) -> dict[str, Any]:
    """The entry point of every rank (started by :func:`tessera.executor.launcher.launch_workers`):
    join the process group, prefill, run ``new_tokens - 1`` decode steps; rank 0 returns every
    rank's report (gathered)."""
    rank, device = worker_setup(spec.world_size, spec.backend)
    watchdog = Watchdog(WATCHDOG_FACTOR * spec.timeout_s, rank)
    try:
        watchdog.arm("start-up")
        dist.init_process_group(spec.backend, timeout=timedelta(seconds=spec.timeout_s))
        worker: DecodeWorker | GraphDecodeWorker = (
            GraphDecodeWorker(spec, rank, device) if spec.graph else DecodeWorker(spec, rank, device)
        )
        watchdog.arm("prefill")
        dist.barrier()
        t0 = time.perf_counter()
        worker.prefill()
        _sync(device)
        prefill_s = time.perf_counter() - t0
        dist.barrier()  # decode steps start together
        steps = []
        for k in range(spec.options.new_tokens - 1):
            inject_test_fault(rank, k)
            watchdog.arm(f"decode step {k}")
            comm0 = worker.comm_s
            t0 = time.perf_counter()
            worker.step(k)
            _sync(device)
            steps.append({"step": k, "step_s": time.perf_counter() - t0, "comm_s": worker.comm_s - comm0})
        watchdog.disarm()
        result: dict[str, Any] = {
            "rank": rank,
            "device": spec.devices[rank],
            "requests": worker.request_range(),
            "prefill_s": prefill_s,
            "steps": steps,
            "tokens": worker.reported_tokens(),
            "kv_positions": worker.kv_positions,
            "kv_positions_by_request": {str(b): n for b, n in worker.kv_positions_by_request().items()},
            "kv_cache_bytes": worker.kv_cache_bytes,
            "weight_bytes": worker.weight_bytes,
            "peak_rss_bytes": memory_status("VmHWM"),
        }
        gathered: list[Any] | None = [None] * spec.world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if gathered is not None:
            result["all"] = gathered
    except BaseException:
        # Leave the process group up: the error is recorded and the process exits before the peers
        # see their links drop, so the launcher names this rank, not a peer that lost it.
        watchdog.disarm()
        raise
    watchdog.disarm()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
