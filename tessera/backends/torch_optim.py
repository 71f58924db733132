"""The optimizers training uses and its gradient clipping, one way for the workers, the one-process
reference and the stage profiler (which times their step): torch.optim's SGD, AdamW and Adam with
their defaults, fused wherever torch has a fused kernel for the parameters (AdamW over 40 tensors of
166k parameters on a CPU: 2.3 ms in torch's default per-tensor loop, 0.37 ms fused; docs/executor.md,
"Training semantics")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported when an optimizer is made, not with the names
    import torch

__all__ = ["OPTIMIZERS", "fusable", "global_norm_clip", "torch_optimizer"]

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

    kwargs = {} if weight_decay is None else {"weight_decay": weight_decay}
    if fusable(params, name):
        kwargs["fused"] = True
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, **kwargs)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, **kwargs)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **kwargs)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


def fusable(params: Sequence[torch.Tensor], name: str) -> bool:
    """Whether optimizer ``name``'s fused kernel takes ``params`` and updates them as its loop does:
    floating-point tensors, all on one CPU or CUDA device. Not SGD over bf16 or fp16 tensors on a
    CPU: torch 2.13's fused CPU SGD updates only the last ``numel % 16`` elements of such a tensor
    and leaves the rest as they were (tests/executor/test_training_options.py)."""
    import torch

    devices = {p.device for p in params}
    if len(devices) != 1 or next(iter(devices)).type not in ("cpu", "cuda"):
        return False
    if not all(p.is_floating_point() for p in params):
        return False
    half = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    return not (name == "sgd" and half and next(iter(devices)).type == "cpu")


def global_norm_clip(
    counted: Sequence[torch.Tensor], params: Sequence[torch.Tensor], max_norm: float, group: Any = None
) -> float:
    """Scale the gradients of ``params`` so that the norm of every gradient of the model is at most
    ``max_norm``; return that norm (before clipping). ``counted``: the gradients this rank adds to
    the norm (its stage's, on one replica of the stage; a weight several stages hold, on one of
    them), summed as squares over ``group`` (None: every rank). ``clip_grad_norm_``'s rule: the
    factor is ``max_norm / (norm + 1e-6)``, applied only where it is below 1."""
    import torch
    import torch.distributed as dist

    device = next((p.device for p in params), torch.device("cpu"))
    if dist.is_initialized() and dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # NCCL reduces GPU tensors
    norms = [
        torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float64) for p in counted if p.grad is not None
    ]
    # Each gradient's norm in float64 (its float32 squares are exact there), the ranks' squares
    # summed: how the sum is grouped over ranks changes nothing a float32 weight can hold.
    squares = torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=torch.float64)
    squares = squares.to(device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    norm = float(total)
    if max_norm / (norm + 1e-6) < 1.0:  # clip_grad_norm_'s factor (in float64), its fused in-place scaling
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return norm
