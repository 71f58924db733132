"""GPT-2 with its attention fused into onnxruntime's own operators, as onnxruntime's transformer
optimizer fuses it: ``com.microsoft`` ``MultiHeadAttention`` over the split Q, K, V, or ``Attention``
over the packed projection (``unidirectional``: the causal mask inside the operator). Loaded, each
computes what onnxruntime computes on the fused file, is recognized as the decoder it is, and
decodes with cp, tp and dp on 2 ranks exactly as onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from corpus.exports import Corpus
from corpus.test_decoders import NEW_TOKENS, PROMPTS
from decode_reference import assert_launches_decode, greedy_tokens
from onnx import helper

from tessera.core.graph import load_graph
from tessera.planners.cp.recognize import recognize_decoder

pytestmark = [pytest.mark.corpus]


def _fuse(model: onnx.ModelProto, packed: bool) -> onnx.ModelProto:
    """Each layer's attention core (from its Q/K/V ``Split`` to the merged heads) as one fused node."""
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    fused, done = [], set()
    for split in [n for n in nodes if n.op_type == "Split" and n.name.endswith("/attn/Split")]:
        prefix = split.name.removesuffix("Split")
        merged = producer[f"{prefix}Reshape_3_output_0"]
        attrs = {"num_heads": 4, "unidirectional": 1}
        if packed:
            add = producer[split.input[0]]
            matmul = producer[add.input[0]]
            node = helper.make_node(
                "Attention", [matmul.input[0], matmul.input[1], add.input[1]], list(merged.output),
                domain="com.microsoft", name=f"{prefix}Attention", **attrs,
            )  # fmt: skip
            done |= {add.name, matmul.name, split.name}
        else:
            node = helper.make_node(
                "MultiHeadAttention", list(split.output), list(merged.output),
                domain="com.microsoft", name=f"{prefix}MultiHeadAttention", **attrs,
            )  # fmt: skip
        fused.append((merged.name, node))
        done.add(merged.name)
    replace = dict(fused)
    kept = [replace.get(n.name, n) for n in nodes if n.name not in done or n.name in replace]
    graph = helper.make_graph(
        kept, model.graph.name, model.graph.input, model.graph.output, model.graph.initializer
    )
    out = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    return _pruned(out)


def _pruned(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the nodes no output depends on."""
    needed = {o.name for o in model.graph.output}
    keep = []
    for node in reversed(model.graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed |= set(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(keep))
    weights = [t for t in model.graph.initializer if t.name in needed]
    del model.graph.initializer[:]
    model.graph.initializer.extend(weights)
    return model


@pytest.fixture(scope="module", params=["MultiHeadAttention", "Attention"])
def fused(request, corpus: Corpus, tmp_path_factory) -> tuple[str, Path]:
    made = corpus.entries[("gpt2", "ort", "dynamic")]
    model = _fuse(onnx.load(made.path), packed=request.param == "Attention")
    assert [n.op_type for n in model.graph.node if n.op_type == request.param] == [request.param] * 2
    path = tmp_path_factory.mktemp("fused") / f"gpt2-{request.param}.onnx"
    onnx.save(model, path)
    return request.param, path, made


def test_a_fused_attention_loads_and_computes_onnxruntimes_outputs(fused) -> None:
    op, path, made = fused
    ids = np.arange(1, 1 + 2 * 9, dtype=np.int64).reshape(2, 9) % 100
    want = ort.InferenceSession(str(made.path)).run(None, {"input_ids": ids})[0]
    got_fused = ort.InferenceSession(str(path)).run(None, {"input_ids": ids})[0]
    np.testing.assert_allclose(got_fused, want, rtol=1e-4, atol=1e-4)  # the fusion is the same model
    graph = load_graph(str(path), input_shapes={"input_ids": (2, 9)})
    assert not any(n.domain for n in graph.model.graph.node)
    lowered = ort.InferenceSession(graph.model.SerializeToString()).run(None, {"input_ids": ids})[0]
    np.testing.assert_allclose(lowered, got_fused, rtol=1e-4, atol=1e-4)
    config = recognize_decoder(load_graph(str(path))).config
    assert (config.layers, config.hidden, config.heads, config.kv_heads, config.head_dim) == (
        2,
        64,
        4,
        4,
        16,
    ), op


@pytest.mark.slow
def test_a_fused_attention_decodes_with_cp_tp_and_dp(fused, tmp_path) -> None:
    _, path, _ = fused
    want = greedy_tokens(str(path), PROMPTS, NEW_TOKENS)
    assert len({t for tokens in want for t in tokens}) > 3
    assert_launches_decode(str(path), PROMPTS, want, ("cp", "tp", "dp"), tmp_path)
