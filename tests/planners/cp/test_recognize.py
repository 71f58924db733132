"""Recognizing a decoder-only transformer in ONNX by structure, with and without metadata."""

from __future__ import annotations

import onnx
import pytest

from tessera.core.errors import InputError
from tessera.core.graph import load_graph
from tessera.models import build
from tessera.planners.cp.recognize import recognize_llm


def _strip(model: onnx.ModelProto) -> onnx.ModelProto:
    """No metadata, no node names (the loader names them), no graph name: structure only."""
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    del stripped.metadata_props[:]
    for node in stripped.graph.node:
        node.name = ""
    stripped.graph.name = "g"
    return stripped


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_gpt_tiny_with_and_without_metadata(kv_heads: int) -> None:
    model = build("gpt", "tiny", seed=0, kv_heads=kv_heads)
    config = recognize_llm(load_graph(model))
    assert (config.layers, config.hidden, config.heads, config.kv_heads, config.head_dim) == (
        2,
        32,
        4,
        kv_heads,
        8,
    )
    assert (config.ffn, config.vocab, config.dtype, config.gated_ffn) == (128, 128, "fp32", False)
    assert config.name == "gpt"
    bare = recognize_llm(load_graph(_strip(model)))
    assert bare.model_dump(exclude={"name"}) == config.model_dump(exclude={"name"})


def test_gpt_paper_sizes_from_weight_shapes() -> None:
    config = recognize_llm(load_graph(_strip(build("gpt", "paper", seed=0))))
    assert (config.layers, config.hidden, config.heads, config.kv_heads) == (12, 768, 12, 12)
    assert (config.head_dim, config.ffn, config.vocab) == (64, 3072, 50257)


@pytest.mark.parametrize("name", ["bert", "mmt"])
def test_encoders_are_not_decoders(name: str) -> None:
    with pytest.raises(InputError, match="no causal self-attention found"):
        recognize_llm(load_graph(build(name, "tiny", seed=0)))


@pytest.mark.parametrize("name", ["dlrm", "resnext"])
def test_models_without_attention(name: str) -> None:
    with pytest.raises(InputError, match="no self-attention found"):
        recognize_llm(load_graph(build(name, "tiny", seed=0)))


def test_metadata_that_contradicts_the_structure() -> None:
    model = build("gpt", "tiny", seed=0)
    for prop in model.metadata_props:
        if prop.key == "tessera.heads":
            prop.value = "8"
    with pytest.raises(InputError, match=r"tessera.heads=8 disagrees .* gives 4"):
        recognize_llm(load_graph(model))
