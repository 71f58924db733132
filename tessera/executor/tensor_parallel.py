"""A tensor-parallel rank's process groups and its weights gathered whole. The rank's copy of a
stage is ``tessera.core.tp_program.local_model``; the split itself comes from
``tessera.core.tensor_parallel``. Narrative: docs/executor.md."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from tessera.backends.torch_ops import to_numpy
from tessera.backends.torch_ops.collectives import use_group
from tessera.core.tensor_parallel import TpSplit
from tessera.executor.routing import Routing

__all__ = ["tp_group", "whole_weights"]


def tp_group(routing: Routing, rank: int) -> Any:
    """Every stage replica's tensor-parallel group (its ``t`` consecutive ranks), made on every rank
    in one order (torch.distributed's rule); ``rank``'s, registered for the collectives' nodes."""
    t = routing.tensor_parallel
    mine = None
    for leader in sorted(routing.ranks.values()):
        group = dist.new_group([leader + i for i in range(t)])
        if leader == rank - rank % t:
            mine = group
    use_group("tp", mine)
    return mine


def whole_weights(named: list[tuple[str, Tensor]], split: TpSplit, group: Any) -> dict[str, np.ndarray]:
    """The stage's weights as one process holds them: the split ones gathered from the group's
    ranks (collective over ``group``)."""
    blocks = split.weights
    out = {}
    for name, p in named:
        value = p.detach().cpu()
        if name in blocks:
            gathered = [torch.empty_like(value) for _ in range(split.t)]
            dist.all_gather(gathered, value.contiguous(), group=group)
            axis, parts = blocks[name]
            pieces = [torch.tensor_split(g, parts, axis) for g in gathered]
            value = torch.cat([torch.cat([pr[k] for pr in pieces], axis) for k in range(parts)], axis)
        out[name] = to_numpy(value).copy()  # bf16 weights too
    return out
