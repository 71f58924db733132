"""The decode step in fixed shapes (executor/graphed_step.py) on the zoo's GPT with grouped KV
heads: uncaptured on the CPU, and captured as a CUDA graph on a GPU, it decodes the tokens of
onnxruntime running the whole graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from decode_reference import greedy_tokens, group_tokens

from tessera.executor.graph_decode_worker import graph_decoder
from tessera.models import build

PROMPTS = [[5, 17, 3, 99, 42, 7], [33, 2, 120, 8, 8, 51]]
NEW_TOKENS = 10


@pytest.fixture
def gpt(tmp_path: Path) -> Path:
    path = tmp_path / "gpt.onnx"
    path.write_bytes(build("gpt", "tiny", seed=3, kv_heads=2, seq=96).SerializeToString())
    return path


def test_the_fixed_shape_step_decodes_the_reference_tokens_on_the_cpu(gpt: Path) -> None:
    want = greedy_tokens(gpt, PROMPTS, NEW_TOKENS)
    assert len({t for tokens in want for t in tokens}) > 3  # varied tokens: a wrong decode shows
    assert group_tokens(graph_decoder(str(gpt)), PROMPTS, NEW_TOKENS, fixed=True) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_step_captured_as_a_cuda_graph_decodes_the_reference_tokens(gpt: Path) -> None:
    want = greedy_tokens(gpt, PROMPTS, NEW_TOKENS)
    assert group_tokens(graph_decoder(str(gpt)), PROMPTS, NEW_TOKENS, fixed=False, device="cuda") == want
    assert group_tokens(graph_decoder(str(gpt)), PROMPTS, NEW_TOKENS, fixed=True, device="cuda") == want
