"""Split-KV decode attention for cache parallelism (thesis-jeon ch. 4): shard partials and their merge.

Each device of a cache-parallel group attends the new token's query to its local ``kv_shard`` and
returns ``(o, lse)`` — the shard-normalized output and the natural-log sum of exp of the scaled scores;
:func:`merge_partials` combines the shards exactly (FlashDecoding across devices).

Implementations of the shard step, same contract:

- ``"torch"``: :func:`decode_attention_partial` (always available; the reference).
- ``"triton"``: :func:`decode_attention_partial_triton` (CUDA, or CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tessera.kernels.reference import (
    KVShard,
    decode_attention_partial,
    full_decode_attention,
    merge_outputs,
    merge_partials,
    shard_sizes,
    split_kv,
)
from tessera.kernels.triton_decode import (
    KernelUnavailableError,
    decode_attention_partial_triton,
    triton_unavailable_reason,
)

__all__ = [
    "KVShard",
    "KernelUnavailableError",
    "available_implementations",
    "get_partial_attention",
    "decode_attention_partial",
    "decode_attention_partial_triton",
    "full_decode_attention",
    "merge_outputs",
    "merge_partials",
    "shard_sizes",
    "split_kv",
    "triton_unavailable_reason",
]


def available_implementations() -> dict[str, str | None]:
    """Every shard-attention implementation mapped to ``None`` if usable, else why not.

    ``"torch"`` is always usable; ``"triton"`` is usable when Triton imports (whether it can run on a
    given device is :func:`triton_unavailable_reason`). The usable names are
    ``[name for name, why in available_implementations().items() if why is None]``.
    """
    return {"torch": None, "triton": triton_unavailable_reason()}


def get_partial_attention(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The shard-attention function called ``name`` (``"torch"`` or ``"triton"``).

    Raises :class:`KernelUnavailableError` with the reason when it cannot be used here, and
    ``ValueError`` for an unknown name.
    """
    implementations = {"torch": decode_attention_partial, "triton": decode_attention_partial_triton}
    if name not in implementations:
        raise ValueError(
            f"unknown decode attention implementation {name!r}; known: {sorted(implementations)}"
        )
    reason = available_implementations()[name]
    if reason is not None:
        raise KernelUnavailableError(f"decode attention implementation {name!r} is unavailable: {reason}")
    return implementations[name]
