"""The gradients of a stage replica, summed over its data-parallel group (and a shared weight's
holders) as one flat buffer (their clipping: ``tessera.backends.torch_optim.global_norm_clip``).
See docs/executor.md ("Training semantics").
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GradBucket", "by_dtype"]


class GradBucket:
    """The gradients ``params`` sum over ``group``, as views of one flat buffer per dtype (DDP's
    ``gradient_as_bucket_view``; bf16 weights beside fp32 norms take two): the backward accumulates
    into it in place and one all-reduce a buffer sums it, with no copy in or out. A gradient nobody
    wrote stays 0."""

    def __init__(self, params: list[Tensor], group: Any, spins: bool = False) -> None:
        self.group, self.spins = group, spins
        self.flats = []
        for dtype, same in by_dtype(params).items():
            flat = torch.zeros(sum(p.numel() for p in same), dtype=dtype, device=same[0].device)
            offset = 0
            for p in same:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self.flats.append(flat)

    def all_reduce(self) -> None:
        """Sum the buffer over the group. With ``spins``, the rank polls the all-reduce and yields
        its core between polls instead of sleeping until gloo's thread wakes it: a sleeping rank's
        all-reduce of BERT's 344 KB stalled 2-6 ms in one step of four here, a polling one in one of
        ten (mean step 5.9 -> 5.2 ms; docs/executor.md, "Fidelity")."""
        for flat in self.flats:
            if not self.spins:
                dist.all_reduce(flat, group=self.group)
                continue
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            while not work.is_completed():  # done on gloo's thread (a receive's work only inside wait())
                os.sched_yield()
            work.wait()  # raises what the all-reduce raised


def by_dtype(params: list[Tensor]) -> dict[torch.dtype, list[Tensor]]:
    """``params`` by dtype, each list and the dtypes in the order they first come (one flat buffer
    holds one dtype)."""
    out: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        out.setdefault(p.dtype, []).append(p)
    return out
