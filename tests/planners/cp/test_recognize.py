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


def _attention_like(score_op: str) -> onnx.ModelProto:
    """x → {q, k, v} projections → q·kᵀ → ``score_op`` → Softmax → ·v: attention but for one op."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weights = [numpy_helper.from_array(np.ones((8, 8), np.float32), name) for name in ("wq", "wk", "wv")]
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="k_proj"),
        helper.make_node("MatMul", ["x", "wv"], ["v"], name="v_proj"),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="k_t"),
        helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
        helper.make_node(score_op, ["scores"], ["scored"], name="odd_op"),
        helper.make_node("Softmax", ["scored"], ["p"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["p", "v"], ["y"], name="pv"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])], weights,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_score_transform_it_cannot_reproduce_is_refused_naming_the_node() -> None:
    # A Relu on the scores is found by dataflow, evaluated, and matches no known score modification.
    with pytest.raises(
        InputError, match=r"at node odd_op: the scores are transformed by neither a scale nor a soft-cap"
    ):
        recognize_llm(load_graph(_attention_like("Relu")))


def test_attention_without_a_mask_is_not_causal() -> None:
    with pytest.raises(InputError, match=r"no causal self-attention found .* Softmax softmax"):
        recognize_llm(load_graph(_attention_like("Identity")))


def test_probabilities_that_weigh_two_products_are_refused_naming_the_second() -> None:
    """Differential attention (DiffLlama) weighs two halves of V by one Softmax: no one core a KV
    cache replaces (its decode step failed inside the mask's GatherND: exit 1)."""
    from onnx import helper

    model = _attention_like("Identity")
    model.graph.node.append(helper.make_node("MatMul", ["p", "v"], ["y2"], name="pv_second"))
    model.graph.node.append(helper.make_node("Sub", ["y", "y2"], ["diff"], name="sub"))
    model.graph.output[0].name = "diff"
    with pytest.raises(InputError, match=r"at node pv_second: the Softmax's probabilities weigh 2 products"):
        recognize_llm(load_graph(model))


def test_scores_read_besides_the_softmax_are_refused_naming_the_reader() -> None:
    """Granite's sliding-window variant scales attention by sigmoid(logsumexp(scores) - sink): the
    scores feed more than the Softmax a KV cache replaces (its decode step failed: exit 1)."""
    from onnx import TensorProto, helper

    model = _attention_like("Identity")
    model.graph.node.append(helper.make_node("ReduceLogSumExp", ["scored"], ["lse"], name="sink_lse"))
    model.graph.output.append(helper.make_tensor_value_info("lse", TensorProto.FLOAT, [1, 1, 1]))
    with pytest.raises(InputError, match=r"at node sink_lse: the scores are read by a ReduceLogSumExp"):
        recognize_llm(load_graph(model))


def test_scores_shifted_by_their_maximum_are_the_same_attention() -> None:
    """``s - max(s)`` before the Softmax (numerically careful attention, MiMo's) changes no
    probability: the zoo GPT so written is recognized as the plain one and decodes what its whole
    graph computes (the step check)."""
    from onnx import helper

    from tessera.executor.graph_decode_worker import graph_decoder

    plain = build("gpt", "tiny", seed=3, kv_heads=2, seq=96)
    model = onnx.ModelProto.FromString(plain.SerializeToString())
    for at in [i for i, node in enumerate(model.graph.node) if node.op_type == "Softmax"][::-1]:
        softmax = model.graph.node[at]
        scores, name = softmax.input[0], softmax.name
        model.graph.node.insert(
            at, helper.make_node("Sub", [scores, f"{name}/max"], [f"{name}/shifted"], name=f"{name}/sub")
        )
        model.graph.node.insert(
            at,
            helper.make_node(
                "ReduceMax", [scores], [f"{name}/max"], axes=[-1], keepdims=1, name=f"{name}/max"
            ),
        )
        softmax.input[0] = f"{name}/shifted"
    want = recognize_llm(load_graph(plain)).to_json()
    assert {k: v for k, v in recognize_llm(load_graph(model)).to_json().items() if k != "name"} == {
        k: v for k, v in want.items() if k != "name"
    }
    graph_decoder(model)  # NotStepwise, naming the node, were the step to part from the graph


def test_a_block_before_the_first_attention_is_refused_naming_its_projection() -> None:
    """A hybrid's first layer without attention (Qwen3.5's and OLMo-hybrid's linear attention: in and
    out projections, then an FFN) was recognized as a decoder of fewer layers; plan's step check
    refused it, but `inspect` reported the wrong count."""
    import numpy as np
    from onnx import helper, numpy_helper

    model = build("gpt", "tiny", seed=3, kv_heads=2, seq=96)
    graph, source, rng = model.graph, "embed/position/add", np.random.default_rng(0)
    for name, shape in (("mix/up_w", (32, 64)), ("mix/down_w", (64, 32))):
        graph.initializer.append(numpy_helper.from_array(rng.normal(0, 0.1, shape).astype(np.float32), name))
    nodes = [
        helper.make_node("MatMul", [source, "mix/up_w"], ["mix/up"], name="mix/up"),
        helper.make_node("Relu", ["mix/up"], ["mix/act"], name="mix/act"),
        helper.make_node("MatMul", ["mix/act", "mix/down_w"], ["mix/down"], name="mix/down"),
        helper.make_node("Add", [source, "mix/down"], ["mix/sum"], name="mix/add"),
    ]
    at = next(i for i, node in enumerate(graph.node) if node.name == source) + 1
    for node in graph.node[at:]:
        node.input[:] = ["mix/sum" if name == source else name for name in node.input]
    for offset, node in enumerate(nodes):
        graph.node.insert(at + offset, node)
    with pytest.raises(
        InputError, match=r"a feed-forward block \(its node mix/down\) comes before the first"
    ):
        recognize_llm(load_graph(model))
