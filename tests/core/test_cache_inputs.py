"""A decoding graph's own KV cache bound empty at load, and onnxruntime's ``GroupQueryAttention``
written back as standard ONNX: the loaded graph computes what onnxruntime computes on the file with an
empty past (masks with padding too), is recognized as the decoder it is, and a past tessera cannot
bind is refused naming the node and the input."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cli_runner import run_cli
from gqa_decoder import KV_HEADS, LAYERS, MAX_POS, empty_cache, gqa_decoder, run_whole
from onnx import TensorProto, helper, numpy_helper

from tessera.core.cache_inputs import bind_empty_cache, cache_inputs
from tessera.core.errors import InputError
from tessera.core.graph import load_graph
from tessera.planners.cp.recognize import recognize_decoder

VARIANTS = {
    "plain": {},
    "window": {"window": 4},
    "softcap": {"softcap": 2.0},
    "interleaved": {"interleaved": True},
    "packed": {"packed": True},
    "partial": {"head": 32, "rotary_dim": 16},
}
IDS = np.array([[1, 5, 9, 33, 2, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], np.int64)


def _loaded_logits(path: str, mask: np.ndarray) -> tuple[onnx.ModelProto, np.ndarray]:
    shapes = {"input_ids": IDS.shape, "attention_mask": IDS.shape}
    model = load_graph(path, input_shapes=shapes).model
    run = ort.InferenceSession(model.SerializeToString())
    return model, run.run(["logits"], {"input_ids": IDS, "attention_mask": mask})[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_group_query_attention_graph_loads_as_what_onnxruntime_computes_with_an_empty_past(
    variant: str, tmp_path
) -> None:
    model = gqa_decoder(**VARIANTS[variant])
    path = str(tmp_path / "gqa.onnx")
    onnx.save(model, path)
    fused = ort.InferenceSession(model.SerializeToString())
    loaded, got = _loaded_logits(path, np.ones_like(IDS))
    assert not any(n.domain for n in loaded.graph.node)  # standard ONNX throughout
    assert [i.name for i in loaded.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in loaded.graph.output] == ["logits"]  # the present outputs are gone
    np.testing.assert_allclose(got, run_whole(fused, IDS), rtol=1e-4, atol=1e-4)
    # A padded request: keys past seqlens_k hidden; a query whose window holds no real key gets zeros.
    mask = np.ones_like(IDS)
    mask[1, 6:] = 0
    want = fused.run(["logits"], {"input_ids": IDS, "attention_mask": mask, **empty_cache(fused, 2)})[0]
    np.testing.assert_allclose(_loaded_logits(path, mask)[1], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_group_query_attention_graph_is_recognized_with_its_heads_rotary_window_and_cap(
    variant: str, tmp_path
) -> None:
    path = str(tmp_path / "gqa.onnx")
    onnx.save(gqa_decoder(**VARIANTS[variant]), path)
    decoder = recognize_decoder(load_graph(path))
    c = decoder.config
    head = VARIANTS[variant].get("head", 16)
    assert (c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim) == (LAYERS, 64, 4, KV_HEADS, head)
    assert decoder.rotary_dim == VARIANTS[variant].get("rotary_dim", head)
    found = decoder.to_json()
    assert found["window"] == VARIANTS[variant].get("window")
    assert (found["softcap"] is not None) == ("softcap" in VARIANTS[variant])


def test_a_past_of_fixed_length_is_refused_naming_the_node_and_the_input(tmp_path) -> None:
    model = gqa_decoder()
    for value in model.graph.input:
        if "past" in value.name:
            value.type.tensor_type.shape.dim[2].dim_value = 3
    path = tmp_path / "fixed-past.onnx"
    onnx.save(model, path)
    with pytest.raises(InputError) as caught:
        load_graph(str(path))
    assert "'/l0/GroupQueryAttention'" in str(caught.value)
    assert "'past_key_values.0.key'" in str(caught.value) and "free past length" in str(caught.value)


def _concat_cache_model() -> onnx.ModelProto:
    """A cache as optimum's exports read it: K = Concat(past, new) on the length axis, positions
    counted from the past's length (Shape), present = that Concat."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")
    emb = numpy_helper.from_array(np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32), "emb")
    two = numpy_helper.from_array(np.array(2, np.int64), "two")
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["x"]),
        helper.make_node("MatMul", ["x", "w"], ["k"]),
        helper.make_node("Unsqueeze", ["k", "one"], ["k4"]),
        helper.make_node("Concat", ["past_key", "k4"], ["present.0.key"], axis=-2),
        helper.make_node("Shape", ["past_key"], ["past_shape"]),
        helper.make_node("Gather", ["past_shape", "two"], ["past_len"], axis=0),
        helper.make_node("Cast", ["past_len"], ["past_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["present.0.key", "two_axes"], ["summed"], keepdims=0),
        helper.make_node("Add", ["summed", "past_f"], ["logits"]),
    ]
    inits = [w, emb, two, numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([2], np.int64), "two_axes")]  # fmt: skip
    graph = helper.make_graph(
        nodes, "concat-cache",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("past_key", TensorProto.FLOAT, ["batch", 1, "past", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1, 4]),
         helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, ["batch", 1, "total", 4])],
        inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_concatenated_cache_is_bound_empty_and_its_length_reads_zero() -> None:
    model = _concat_cache_model()
    assert cache_inputs(model) == {"past_key": (2, 4)}
    ids = np.array([[1, 2, 3], [4, 5, 6]], np.int64)
    empty = np.zeros((2, 1, 0, 4), np.float32)
    want = ort.InferenceSession(model.SerializeToString()).run(
        ["logits"], {"input_ids": ids, "past_key": empty}
    )
    bound = bind_empty_cache(model)
    assert [i.name for i in bound.graph.input] == ["input_ids"]
    assert [o.name for o in bound.graph.output] == ["logits"]
    concat = next(n for n in bound.graph.node if n.op_type == "Concat" and n.output[0] == "present.0.key")
    assert list(concat.input) == ["k4"]  # the empty past is no longer concatenated
    got = ort.InferenceSession(bound.SerializeToString()).run(["logits"], {"input_ids": ids})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def test_inputs_that_are_no_cache_are_left_alone() -> None:
    model = _concat_cache_model()
    model.graph.input[1].type.tensor_type.shape.dim[2].dim_value = 3  # no free past axis
    assert cache_inputs(model) == {}
    assert bind_empty_cache(model) is model
    model = _concat_cache_model()
    model.graph.input[1].name = "keys"  # not named as a cache
    assert cache_inputs(model) == {}


def test_a_rotary_cache_bounds_the_positions_a_plan_may_ask_for(tmp_path) -> None:
    """The cos/sin caches hold MAX_POS rows: a request needing one more is refused at plan time."""
    path = tmp_path / "gqa.onnx"
    onnx.save(gqa_decoder(), path)

    def plan(context: int) -> object:
        return run_cli("plan", str(path), "--kind", "cp", "--cluster", "local-cpu-split", "--batch", "1",
                       "--context", str(context), "--output-len", "8", "-o", str(tmp_path / "cp.json"))  # fmt: skip

    refused = plan(MAX_POS - 6)
    assert refused.code == 2 and f"needs {MAX_POS + 1} positions" in refused.err, refused.err
    assert f"model holds {MAX_POS} positions" in refused.err
    assert plan(MAX_POS - 7).code == 0
