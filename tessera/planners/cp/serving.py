"""The serving configuration equivalent to a decode plan, per engine (vLLM, SGLang, TensorRT-LLM):
its launch arguments, or why the engine cannot run it (each engine's own constraints on sharding
the KV cache along the sequence). Details: docs/cp.md ("Serving")."""

from __future__ import annotations

from typing import Any

__all__ = ["ENGINES", "serving_configs", "sglang_config", "trtllm_config", "vllm_config"]


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


def sglang_config(strategy: str, degree: int, heads: int, kv_heads: int) -> dict[str, Any]:
    """``python -m sglang.launch_server`` arguments of the same parallelization. SGLang's
    ``--dcp-size`` shards only multi-head latent attention's KV cache (DeepSeek's MLA) inside the
    tensor-parallel group (``tp % dcp == 0``), so a grouped-query cp plan has no SGLang form."""
    if degree == 1:
        return _config([], "one device: no parallelism to configure")
    if strategy == "dp":
        return _config(["--dp-size", str(degree)], "each replica decodes its share of the requests")
    if heads % degree:
        return _refused(f"SGLang splits the {heads} attention heads over --tp-size {degree}: not divisible")
    if strategy == "tp":
        return _config(["--tp-size", str(degree)], "the heads split over the devices")
    return _refused(
        f"SGLang's --dcp-size shards the KV cache along the sequence only for multi-head latent attention "
        f"(MLA); this model's attention has {kv_heads} KV head(s) of its own"
    )


def trtllm_config(strategy: str, degree: int, heads: int, kv_heads: int) -> dict[str, Any]:
    """``trtllm-serve`` arguments of the same parallelization. TensorRT-LLM's decode context
    parallelism (Helix: ``context_parallel_size`` with ``cp_config: {cp_type: HELIX}``) runs on
    generation servers of a disaggregated deployment, for MLA models; plain data parallelism is
    one server per device."""
    if degree == 1:
        return _config([], "one device: no parallelism to configure")
    if strategy == "dp":
        return _refused(
            f"trtllm-serve has no data-parallel size: run {degree} servers of one device each behind a "
            "load balancer"
        )
    if heads % degree:
        return _refused(
            f"TensorRT-LLM splits the {heads} attention heads over --tp_size {degree}: not divisible"
        )
    if strategy == "tp":
        return _config(["--tp_size", str(degree)], "the heads split over the devices")
    return _refused(
        "TensorRT-LLM shards the KV cache along the sequence (Helix: --cp_size with cp_config.cp_type HELIX) "
        f"only for multi-head latent attention (MLA) on disaggregated generation servers; this model's "
        f"attention has {kv_heads} KV head(s) of its own"
    )


ENGINES = {"vllm": vllm_config, "sglang": sglang_config, "trtllm": trtllm_config}


def serving_configs(strategy: str, degree: int, heads: int, kv_heads: int) -> dict[str, dict[str, Any]]:
    """Every engine's form of the plan (:data:`ENGINES`), as a cp plan's ``serving`` block holds them."""
    return {name: config(strategy, degree, heads, kv_heads) for name, config in ENGINES.items()}


def _config(args: list[str], why: str) -> dict[str, Any]:
    return {"expressible": True, "args": args, "why": why}


def _refused(why: str) -> dict[str, Any]:
    return {"expressible": False, "args": [], "why": why}
