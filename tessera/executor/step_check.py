"""Decoding with a KV cache must compute what the whole graph computes: a check by evaluation.

Only attention may carry information from earlier positions into a step (its keys and values are
cached). A convolution over the sequence, a recurrence or a scan also do, and a step fed one token
would silently lose what they read from the past. So a short prompt is decoded one step with the
cache, and every value the step computes is compared with the same node's value at that position
when the whole sequence runs through the graph as written."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from tessera.backends.torch_module import NodeHook
from tessera.core.errors import InputError
from tessera.executor.graph_decoder import GraphDecoder
from tessera.executor.kv_cache import GroupCache, attention_partial
from tessera.planners.cp.scores import ScoreMod

_PROMPT = 6  # positions before the checked step
_TOLERANCE = 1e-3  # of a value's largest magnitude at the position
# where any value is bf16 or fp16: rounding differs between a step and the whole run, and carries on;
# a saturating function (tanh, GELU's tanh form) of large values turns it into a large difference in a
# few elements, so a node is refused only where the difference over all of them (their root mean
# square, relative) is large too. What carries the past moves every element: 0.8-1.2 by both measures.
_LOW_PRECISION_TOLERANCE = 0.1


class NotStepwise(InputError):
    """Something besides attention carries the past into a step: the graph cannot decode with a cache."""


@torch.no_grad()
def check_stepwise(decoder: GraphDecoder) -> None:
    """Raise :class:`NotStepwise` naming the first node whose value at a decoded position differs
    from the whole graph's there; the step's inputs are ``_PROMPT`` cached tokens and one new one."""
    batch = decoder.fixed_batch or 1
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(rng.integers(1, max(2, decoder.vocab), (batch, _PROMPT + 1))).long()
    cache = GroupCache(np.zeros(_PROMPT + 1, dtype=np.int64), 0, torch.device("cpu"))

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor, scores: ScoreMod, past: int) -> Tensor:
        keys, values, positions = cache.read(layer, cache.write(layer, k, v, past))
        return attention_partial(q, keys, values, torch.arange(past, past + q.shape[2]), positions, scores)[0]

    step: dict[str, Tensor] = {}
    order: list[str] = []

    # A core whose sink the graph applies after it (o·sigmoid(lse − sink)) hands on what the graph's
    # scaling Mul computes: compared there, not at the core.
    scaled = {core.av for core in decoder.cores if core.sink_scale is not None}

    def keep(node: str, outs: Sequence[Tensor]) -> None:
        if outs and outs[0] is not None and outs[0].is_floating_point() and node not in scaled:
            step[node] = outs[0]
            order.append(node)

    try:
        decoder.interpret(tokens[:, :_PROMPT], 0, attend)
        decoder.interpret(tokens[:, _PROMPT:], _PROMPT, attend, observe=keep)
    except RuntimeError as exc:  # the interpreter names the node that failed
        why = " ".join(str(exc).removeprefix(f"{decoder.label}: ").split())[:200]
        raise NotStepwise(
            f"decoding with a KV cache fails ({why}): the graph reads more of the sequence than the "
            "attention tessera replaces, so tessera cannot decode this model exactly",
            source=decoder.label,
        ) from None
    errors: dict[str, tuple[float, float]] = {}

    def compare(node: str) -> NodeHook:
        def hook(args: Sequence[Tensor | None], outs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            if node in step and outs:
                error = _error(outs[0], step[node])
                if error is not None:
                    errors[node] = error
            return outs

        return hook

    decoder.module.run(decoder.feeds(tokens, 0), after={node: compare(node) for node in step})
    types = decoder.module.node_types()
    low = any(t.dtype in (torch.bfloat16, torch.float16) for t in step.values())
    tolerance = _LOW_PRECISION_TOLERANCE if low else _TOLERANCE
    for node in order:
        largest, overall = errors.get(node, (0.0, 0.0))
        if largest > tolerance and (not low or overall > tolerance):
            raise NotStepwise(
                f"node {node!r} ({types.get(node, '?')}), decoding one token with a KV cache, computes a value "
                f"{largest:.2g} of its magnitude away from the whole graph's at that position: it or a node "
                "before it carries earlier positions into the step besides attention (a convolution over the "
                "sequence, a recurrence, a scan), so tessera cannot decode this model exactly",
                source=decoder.label,
            )


def _error(whole: Tensor, step: Tensor) -> tuple[float, float] | None:
    """``step``'s largest difference from ``whole`` at the last position, relative to ``whole``'s
    largest magnitude there, and the root mean square of the differences relative to ``whole``'s
    there; None where the shapes do not differ in exactly one axis, the sequence (``_PROMPT`` + 1
    against 1)."""
    if whole.dim() != step.dim() or not whole.is_floating_point():
        return None
    axes = [a for a in range(whole.dim()) if whole.shape[a] != step.shape[a]]
    if len(axes) != 1 or whole.shape[axes[0]] != _PROMPT + 1 or step.shape[axes[0]] != 1:
        return None
    last = whole.narrow(axes[0], _PROMPT, 1).double()
    diff = (last - step.double()).abs()
    finite = torch.isfinite(diff)
    if not bool(finite.any()):
        return None
    scale = float(last.abs()[finite].max())
    overall = float(diff[finite].norm()) / (float(last[finite].norm()) + 1e-12)
    return float(diff[finite].max()) / (scale + 1e-12), overall
