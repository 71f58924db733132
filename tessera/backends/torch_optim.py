"""The optimizers training uses, built one way for the workers, the one-process reference and the
stage profiler (which times their step): torch.optim's SGD, AdamW and Adam with their defaults."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when an optimizer is made, not with the names
    import torch

__all__ = ["OPTIMIZERS", "torch_optimizer"]

OPTIMIZERS = ("sgd", "adamw", "adam")


def torch_optimizer(
    name: str,
    params: Sequence[torch.Tensor],
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float | None = None,
) -> torch.optim.Optimizer:
    """``name``'s torch.optim optimizer over ``params`` (``weight_decay`` None: its default)."""
    import torch

    decay = {} if weight_decay is None else {"weight_decay": weight_decay}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, **decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, **decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **decay)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")
