"""A decode step in fixed shapes, captured as a CUDA graph: one replay per token, no host work
between its kernels.

The step's traced program (:mod:`decode_program`) runs with the new token and its position in
preallocated device buffers; each attention core writes its K and V into the rank's static cache
at that position (``index_copy_`` by a device index) and attends over every slot of the cache,
the slots after the position masked. Nothing in the step depends on a host value, so on CUDA it is
captured once (``torch.cuda.graph``) and replayed for every later token. Where capture fails, the
same step runs uncaptured and the reason is kept. It applies where a rank holds every position of
its requests (dp, or one rank). See docs/executor.md ("Compiled decode steps").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tessera.executor.kv_cache import GroupCache, attention_partial
from tessera.planners.cp.scores import ScoreMod

if TYPE_CHECKING:
    from tessera.executor.decode_program import StepProgram
    from tessera.executor.graph_decoder import GraphDecoder

__all__ = ["GraphedStep"]

WARMUP_RUNS = 2  # uncaptured runs on a side stream before capture (cuBLAS and allocator warm-up)


class GraphedStep:
    """One group's decode step (``batch`` requests, one new token each) over ``cache``, which holds
    every position of the group and was filled by the prefill: :meth:`run` gives the next tokens.
    ``capture``: record a CUDA graph at the first run (the cache's device must be CUDA)."""

    def __init__(self, decoder: GraphDecoder, cache: GroupCache, batch: int, *, capture: bool) -> None:
        program = decoder.programs.get((batch, 1))
        if program is None:
            raise ValueError("the decode step has no traced program to capture")
        if cache.slots != len(cache.owner) or not cache.layers:
            raise ValueError("the rank does not hold every position of its requests")
        self.program: StepProgram = program
        self.cache, self.capture = cache, capture
        device = cache.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.past = torch.zeros((), dtype=torch.long, device=device)
        self.slots = torch.arange(cache.slots, device=device)
        self.next: Tensor | None = None  # [batch] the step's greedy tokens (the graph's output)
        self.finite: Tensor | None = None  # [batch] whether each row's logits were all finite
        self.graph: torch.cuda.CUDAGraph | None = None
        self.why_not: str | None = None if capture else "not captured"

    def prepare(self, tokens: list[int], past: int) -> None:
        """Capture the step (where ``capture``) with the first step's own inputs, so that no decode
        step pays for it: the runs it makes write what that step will write."""
        self._feed(tokens, past)
        if self.graph is None and self.capture and self.why_not is None:
            self._record(past)

    def run(self, tokens: list[int], past: int) -> list[int]:
        """The greedy next token of each request, after ``tokens`` (one each) at position ``past``."""
        self.prepare(tokens, past)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body(past)
        for layer in self.cache.layers:
            self.cache.held[layer] = past + 1
        assert self.next is not None and self.finite is not None
        check_finite(self.finite.tolist(), past)
        return self.next.tolist()

    def _feed(self, tokens: list[int], past: int) -> None:
        self.tokens.copy_(torch.tensor(tokens, dtype=torch.long).view(-1, 1))
        self.past.fill_(past)

    def _body(self, past: int) -> None:
        logits = self.program.run_at(self.tokens, self.past, past, self._attend)
        self.next = torch.argmax(logits[:, -1], dim=-1)
        self.finite = torch.isfinite(logits[:, -1]).all(dim=-1)

    def _record(self, past: int) -> None:
        """Warm up on a side stream, then capture :meth:`_body`; a failure leaves it uncaptured.
        Every run writes the same cache slot with the same values, so the warm-up changes nothing."""
        try:
            side = torch.cuda.Stream(self.cache.device)
            side.wait_stream(torch.cuda.current_stream(self.cache.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._body(past)
            torch.cuda.current_stream(self.cache.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._body(past)
        except RuntimeError as exc:
            self.why_not = f"capturing the step failed: {' '.join(str(exc).split())[:200]}"
            torch.cuda.synchronize(self.cache.device)
            return
        self.graph = graph

    def _attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scores: ScoreMod, _past: int) -> Tensor:
        """Write this token's K and V at the device position, attend over every slot (later ones
        masked): no shape or value read on the host."""
        keys, values = self.cache.layers[layer]
        fold = self.cache.folds[layer]
        at = self.past.view(1)
        keys.index_copy_(2, at, k[:, ::fold].to(keys.dtype))
        values.index_copy_(2, at, v[:, ::fold].to(values.dtype))
        if scores.plain:
            return torch.nn.functional.scaled_dot_product_attention(
                q, keys.to(q.dtype), values.to(q.dtype), attn_mask=(self.slots <= self.past)[None],
                scale=scores.scale, enable_gqa=keys.shape[1] != q.shape[1],
            )  # fmt: skip
        return attention_partial(q, keys, values, at, self.slots, scores)[0]


class NonFiniteLogits(RuntimeError):
    """The model's logits hold NaN or inf: the argmax of them is no token of the model's."""


def check_finite(finite: list[bool], position: int, requests: list[int] | None = None) -> None:
    """Fail the launch where a request's logits at ``position`` are not all finite (their argmax
    would be reported as the model's next token)."""
    if not all(finite):
        row = finite.index(False)
        who = f"request {requests[row]}" if requests is not None else f"row {row} of a decode group"
        raise NonFiniteLogits(
            f"the model's logits for {who} at position {position} are NaN or inf: the graph computes them "
            "so (run it in onnxruntime to see), and no token is made from them"
        )


def greedy(logits: torch.Tensor, position: int, requests: list[int] | None = None) -> list[int]:
    """The greedy next token of each row of ``logits`` ([rows, length, vocab]), from its last position."""
    last = logits[:, -1]
    check_finite(torch.isfinite(last).all(dim=-1).tolist(), position, requests)
    return torch.argmax(last, dim=-1).tolist()
