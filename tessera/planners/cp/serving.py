"""The serving configuration equivalent to a decode plan: vLLM's engine arguments, or why vLLM
cannot run it (its decode context parallelism shards the KV cache inside a tensor-parallel group,
at most ``tp / kv_heads`` ways). Details: docs/cp.md ("Serving")."""

from __future__ import annotations

from typing import Any

__all__ = ["vllm_config"]


def vllm_config(strategy: str, degree: int, heads: int, kv_heads: int) -> dict[str, Any]:
    """``{"expressible", "args", "why"}``: the ``vllm serve`` arguments of the same parallelization."""
    if degree == 1:
        return _config([], "one device: no parallelism to configure")
    if strategy == "dp":
        return _config(
            ["--data-parallel-size", str(degree)], "each replica decodes its share of the requests"
        )
    if heads % degree:
        return _refused(
            f"vLLM splits the {heads} attention heads over --tensor-parallel-size {degree}: not divisible"
        )
    tp = ["--tensor-parallel-size", str(degree)]
    if strategy == "tp":
        copies = (
            f"; each of the {kv_heads} KV heads is held by {degree // kv_heads} devices"
            if degree > kv_heads
            else ""
        )
        return _config(tp, f"the heads split over the devices{copies}")
    # cp (and cp+tp): the KV cache sharded along the sequence over all `degree` devices.
    if kv_heads == 1:  # tp / kv_heads = degree: the one KV head is sharded over every device
        return _config(
            [*tp, "--decode-context-parallel-size", str(degree)],
            "vLLM splits the projections by heads where this plan splits the requests; the KV cache is "
            "sharded along the sequence the same way",
        )
    return _refused(
        f"vLLM's --decode-context-parallel-size shards the KV cache inside a tensor-parallel group at most "
        f"tp / kv_heads ways; sharding it {degree} ways with {kv_heads} KV heads needs --tensor-parallel-size "
        f"{degree * kv_heads} (that many devices), the plan has {degree}"
    )


def _config(args: list[str], why: str) -> dict[str, Any]:
    return {"expressible": True, "args": args, "why": why}


def _refused(why: str) -> dict[str, Any]:
    return {"expressible": False, "args": [], "why": why}
