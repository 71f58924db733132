"""A decode plan's vLLM equivalent (issue #27): the engine arguments of the same parallelization, or
why vLLM cannot express it (decode context parallelism at most tp / kv_heads ways)."""

from __future__ import annotations

import pytest

from tessera.planners.cp.serving import vllm_config


@pytest.mark.parametrize(
    ("strategy", "degree", "heads", "kv_heads", "args"),
    [
        ("dp", 4, 32, 8, ["--data-parallel-size", "4"]),
        ("tp", 4, 32, 8, ["--tensor-parallel-size", "4"]),
        ("tp", 8, 32, 4, ["--tensor-parallel-size", "8"]),  # KV heads duplicated twice
        ("cp", 4, 32, 1, ["--tensor-parallel-size", "4", "--decode-context-parallel-size", "4"]),
        ("cp", 1, 32, 8, []),
    ],
)
def test_expressible_plans_give_vllm_arguments(strategy, degree, heads, kv_heads, args) -> None:
    config = vllm_config(strategy, degree, heads, kv_heads)
    assert config["expressible"] and config["args"] == args


def test_cp_beyond_tp_over_kv_heads_is_not_expressible_and_says_why() -> None:
    config = vllm_config("cp", 4, 32, 8)
    assert not config["expressible"] and config["args"] == []
    assert "at most tp / kv_heads ways" in config["why"] and "--tensor-parallel-size 32" in config["why"]


def test_heads_not_divisible_by_the_degree_are_not_expressible() -> None:
    config = vllm_config("tp", 3, 32, 8)
    assert not config["expressible"] and "32 attention heads" in config["why"]
