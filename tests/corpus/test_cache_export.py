"""A transformers decoder exported with its KV cache as graph inputs and outputs, as optimum exports
one for onnxruntime's decoding loop (``past_key_values.N.key`` in, ``present.N.key`` out; torch.onnx's
dynamo exporter): loaded with the cache bound empty, it is recognized and decodes with cp, tp and dp
on 2 ranks the tokens of the torch model and of onnxruntime running the file with its own cache."""

from __future__ import annotations

import inspect
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from corpus.exports import cache_dir
from corpus.test_decoders import NEW_TOKENS, PROMPTS
from decode_reference import assert_launches_decode

from tessera.core.graph import load_graph
from tessera.planners.cp.recognize import recognize_decoder

pytestmark = [pytest.mark.corpus]
LAYERS, KV_HEADS, HEAD = 2, 2, 16


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=KV_HEADS, intermediate_size=96, max_position_embeddings=256,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # greedy continuations that vary
    return model


class _WithCache(torch.nn.Module):
    """``(input_ids, attention_mask, k0, v0, k1, v1)`` → ``(logits, k0', v0', k1', v1')``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, *past):
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(LAYERS)])
        # transformers 5.24 names the argument ``cache`` (``past_key_values`` before, deprecated since)
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **{name: cache})
        held = getattr(out, name)
        return (out.logits, *[t for layer in held.layers for t in (layer.keys, layer.values)])


def _past_names() -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]


@pytest.fixture(scope="module")
def cache_export() -> tuple[str, torch.nn.Module]:
    model = _llama()
    path = cache_dir() / "llama-cache-inputs.onnx"
    if not path.is_file():
        batch, seq, past, total = (torch.export.Dim(n) for n in ("batch", "seq", "past", "total"))
        args = (torch.randint(0, 128, (2, 3)), torch.ones(2, 8, dtype=torch.int64),
                *[torch.randn(2, KV_HEADS, 5, HEAD) for _ in range(2 * LAYERS)])  # fmt: skip
        shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total},
                  "past": tuple({0: batch, 2: past} for _ in range(2 * LAYERS))}  # fmt: skip
        outputs = ["logits", *(n.replace("past_key_values", "present") for n in _past_names())]
        tmp = path.with_suffix(f".tmp{os.getpid()}.onnx")  # one per test process (pytest -n)
        torch.onnx.export(_WithCache(model), args, str(tmp), dynamo=True, dynamic_shapes=shapes,
                          input_names=["input_ids", "attention_mask", *_past_names()], output_names=outputs,
                          opset_version=18, external_data=False)  # fmt: skip
        tmp.replace(path)
    return str(path), model


def _own_cache_tokens(path: str, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens onnxruntime decodes from the file with its own cache, a token per pass."""
    session = ort.InferenceSession(path)
    past = {name: np.zeros((1, KV_HEADS, 0, HEAD), np.float32) for name in _past_names()}
    ids, tokens = np.array([prompt], np.int64), []
    for _ in range(n):
        total = ids.shape[1] + next(iter(past.values())).shape[2]
        logits, *present = session.run(
            None, {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64), **past}
        )
        tokens.append(int(logits[0, -1].argmax()))
        past = dict(zip(_past_names(), present, strict=True))
        ids = np.array([[tokens[-1]]], np.int64)
    return tokens


@torch.no_grad()
def _torch_tokens(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([sequence]), use_cache=False).logits
        sequence.append(int(logits[0, -1].argmax()))
    return sequence[len(prompt) :]


def test_an_export_with_its_own_cache_loads_without_it_and_is_recognized(cache_export) -> None:
    path, _ = cache_export
    assert [i.name for i in onnx.load(path).graph.input][2:] == _past_names()
    graph = load_graph(path)
    assert list(graph.inputs) == ["input_ids", "attention_mask"] and list(graph.outputs) == ["logits"]
    decoder = recognize_decoder(graph)
    c = decoder.config
    assert (c.layers, c.heads, c.kv_heads, c.head_dim, decoder.rotary_dim) == (
        LAYERS,
        4,
        KV_HEADS,
        HEAD,
        HEAD,
    )


@pytest.mark.slow
def test_an_export_with_its_own_cache_decodes_the_models_tokens(cache_export, tmp_path) -> None:
    path, model = cache_export
    want = [_torch_tokens(model, p, NEW_TOKENS) for p in PROMPTS]
    assert want == [_own_cache_tokens(path, p, NEW_TOKENS) for p in PROMPTS]
    assert len({t for tokens in want for t in tokens}) > 3
    assert_launches_decode(path, PROMPTS, want, ("cp", "tp", "dp"), tmp_path)
