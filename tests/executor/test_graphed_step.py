"""The decode step in fixed shapes (executor/graphed_step.py) on the zoo's GPT with grouped KV
heads: uncaptured on the CPU, and captured as a CUDA graph on a GPU, it decodes the tokens of
onnxruntime running the whole graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from decode_reference import greedy_tokens, group_tokens
from onnx import helper, numpy_helper

from tessera.core.graph import load_graph
from tessera.executor.graph_decode_worker import graph_decoder
from tessera.models import build
from tessera.planners.cp.recognize import recognize_llm

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


def _clamped(model: onnx.ModelProto, bound: float) -> onnx.ModelProto:
    """``model`` with each Q, K and V projection's output clamped to ±``bound`` (OLMo's clip_qkv)."""
    graph = model.graph
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.float32(-bound), "clip_min"),
            numpy_helper.from_array(np.float32(bound), "clip_max"),
        ]
    )
    nodes = []
    for node in graph.node:
        nodes.append(node)
        if node.op_type == "Add" and node.name.split("/")[-2:-1] in (["q"], ["k"], ["v"]):
            clamped = node.output[0] + "/clip"
            nodes.append(helper.make_node("Clip", [clamped, "clip_min", "clip_max"], [node.output[0]]))
            node.output[0] = clamped
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def test_a_clamped_projection_is_recognized_and_decoded_as_the_graph_computes_it(tmp_path: Path) -> None:
    plain = build("gpt", "tiny", seed=3, kv_heads=2, seq=96)
    path = tmp_path / "clamped.onnx"
    path.write_bytes(_clamped(build("gpt", "tiny", seed=3, kv_heads=2, seq=96), 0.02).SerializeToString())
    want = greedy_tokens(path, PROMPTS, NEW_TOKENS)
    assert want != greedy_tokens(plain, PROMPTS, NEW_TOKENS)  # the clamp changes the tokens
    config = recognize_llm(load_graph(str(path)))
    assert (config.layers, config.heads, config.kv_heads, config.head_dim) == (2, 4, 2, 8)
    assert group_tokens(graph_decoder(str(path)), PROMPTS, NEW_TOKENS, fixed=True) == want
