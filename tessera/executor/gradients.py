"""The gradients of a stage replica: summed over its data-parallel group (and a shared weight's
holders) as one flat buffer, and clipped to a global norm over every stage and replica, as one
process would (``torch.nn.utils.clip_grad_norm_``). See docs/executor.md ("Training semantics").
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GradBucket", "global_norm_clip"]


class GradBucket:
    """The gradients ``params`` sum over ``group``, as views of one flat buffer (DDP's
    ``gradient_as_bucket_view``): the backward accumulates into it in place and one all-reduce sums
    it, with no copy in or out. A gradient nobody wrote stays 0."""

    def __init__(self, params: list[Tensor], group: Any, spins: bool = False) -> None:
        self.group, self.spins = group, spins
        self.flat = torch.zeros(
            sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        offset = 0
        for p in params:
            p.grad = self.flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def all_reduce(self) -> None:
        """Sum the buffer over the group. With ``spins``, the rank polls the all-reduce and yields
        its core between polls instead of sleeping until gloo's thread wakes it: a sleeping rank's
        all-reduce of BERT's 344 KB stalled 2-6 ms in one step of four here, a polling one in one of
        ten (mean step 5.9 -> 5.2 ms; docs/executor.md, "Fidelity")."""
        if not self.spins:
            dist.all_reduce(self.flat, group=self.group)
            return
        work = dist.all_reduce(self.flat, group=self.group, async_op=True)
        while not work.is_completed():  # done on gloo's thread (a receive's work only inside wait())
            os.sched_yield()
        work.wait()  # raises what the all-reduce raised


def global_norm_clip(
    counted: list[Tensor], params: list[Tensor], max_norm: float, group: Any = None
) -> float:
    """Scale the gradients of ``params`` so that the norm of every gradient of the model is at most
    ``max_norm``; return that norm (before clipping). ``counted``: the gradients this rank adds to
    the norm (its stage's, on one replica of the stage; a weight several stages hold, on one of
    them), summed as squares over ``group`` (None: every rank). ``clip_grad_norm_``'s rule: the
    factor is ``max_norm / (norm + 1e-6)``, applied only where it is below 1."""
    device = next((p.device for p in params), torch.device("cpu"))
    if dist.is_initialized() and dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # NCCL reduces GPU tensors
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for p in counted:
        if p.grad is not None:
            squares += p.grad.detach().double().square().sum()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    norm = float(squares.sqrt())
    factor = max_norm / (norm + 1e-6)
    if factor < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)
    return norm
