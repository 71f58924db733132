"""FLOP and byte counts against hand computations, one op family at a time."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_builders import single_op_model

from tessera.core.graph import load_graph

rng = np.random.default_rng(0)


def only_op(model):
    graph = load_graph(model)
    (op,) = graph.ops()
    return graph, op


def test_conv_counts_macs_twice_plus_bias():
    # x [2,3,8,8], w [4,3,3,3], pads 1 → y [2,4,8,8]; per output 3*3*3 MACs.
    w, b = rng.normal(size=(4, 3, 3, 3)), rng.normal(size=(4,))
    _, op = only_op(
        single_op_model("Conv", [("x", (2, 3, 8, 8))], initializers={"w": w, "b": b}, pads=[1, 1, 1, 1])
    )
    outputs = 2 * 4 * 8 * 8
    assert op.flops == outputs * 2 * 27 + outputs
    assert op.params == 4 * 3 * 3 * 3 + 4
    assert op.bytes_moved == 4 * (2 * 3 * 8 * 8 + 108 + 4 + outputs)


def test_grouped_conv_divides_input_channels_by_group():
    # group 2: w [6, 4/2, 1, 1]; y [1,6,5,5]; per output 2 MACs.
    w = rng.normal(size=(6, 2, 1, 1))
    _, op = only_op(single_op_model("Conv", [("x", (1, 4, 5, 5))], initializers={"w": w}, group=2))
    assert op.flops == 2 * (1 * 6 * 5 * 5) * 2


def test_strided_conv_uses_output_spatial_size():
    w = rng.normal(size=(8, 3, 7, 7))
    graph, op = only_op(
        single_op_model(
            "Conv", [("x", (1, 3, 224, 224))], initializers={"w": w}, strides=[2, 2], pads=[3, 3, 3, 3]
        )
    )
    assert graph.tensors["y"].shape == (1, 8, 112, 112)
    assert op.flops == 2 * 8 * 112 * 112 * 3 * 49


def test_conv_transpose():
    # x [1,4,5,5], w [4, 6, 3, 3] (C_in, C_out/group, k, k) → every input pixel scatters 6*9 MACs.
    w = rng.normal(size=(4, 6, 3, 3))
    _, op = only_op(single_op_model("ConvTranspose", [("x", (1, 4, 5, 5))], initializers={"w": w}))
    assert op.flops == 2 * 4 * 25 * 6 * 9


def test_matmul_batched_and_broadcast():
    _, op = only_op(single_op_model("MatMul", [("a", (2, 3, 5, 7)), ("b", (7, 11))]))
    assert op.flops == 2 * (2 * 3) * 5 * 7 * 11
    assert op.bytes_moved == 4 * (2 * 3 * 5 * 7 + 7 * 11 + 2 * 3 * 5 * 11)


def test_matmul_with_vector_operand():
    _, op = only_op(single_op_model("MatMul", [("a", (4, 6)), ("b", (6,))]))
    assert op.flops == 2 * 4 * 6


def test_gemm_hand_count():
    w, c = rng.normal(size=(16, 8)), rng.normal(size=(16,))
    _, op = only_op(single_op_model("Gemm", [("a", (3, 8))], initializers={"w": w, "c": c}, transB=1))
    assert op.flops == 2 * 3 * 8 * 16 + 3 * 16
    assert op.params == 16 * 8 + 16


def test_attention_pieces_qk_softmax_av():
    # Q [1,4,16,8] @ K^T [1,4,8,16] → scores [1,4,16,16]; softmax 5/elem; @ V [1,4,16,8].
    _, qk = only_op(single_op_model("MatMul", [("q", (1, 4, 16, 8)), ("kt", (1, 4, 8, 16))]))
    _, sm = only_op(single_op_model("Softmax", [("s", (1, 4, 16, 16))], axis=-1))
    _, av = only_op(single_op_model("MatMul", [("p", (1, 4, 16, 16)), ("v", (1, 4, 16, 8))]))
    assert qk.flops == 2 * 4 * 16 * 16 * 8
    assert sm.flops == 5 * 4 * 16 * 16
    assert av.flops == 2 * 4 * 16 * 16 * 8


def test_fused_attention_op_opset23():
    model = single_op_model(
        "Attention", [("q", (1, 4, 16, 8)), ("k", (1, 4, 32, 8)), ("v", (1, 4, 32, 8))], opset=23
    )
    model.ir_version = 10
    _, op = only_op(model)
    scores = 4 * 16 * 32
    assert op.flops == 2 * scores * 8 + 2 * scores * 8 + 5 * scores


@pytest.mark.parametrize("op_type", ["Relu", "Sigmoid", "Erf", "Tanh", "Exp"])
def test_unary_elementwise_is_one_flop_per_element(op_type):
    _, op = only_op(single_op_model(op_type, [("x", (2, 3, 4))]))
    assert op.flops == 24
    assert op.bytes_moved == 2 * 24 * 4


def test_binary_elementwise_counts_broadcast_output():
    _, op = only_op(single_op_model("Add", [("a", (2, 3, 4)), ("b", (4,))]))
    assert op.flops == 24
    assert op.bytes_moved == 4 * (24 + 4 + 24)


def test_layer_norm_and_batch_norm():
    s, b = rng.normal(size=(8,)), rng.normal(size=(8,))
    _, ln = only_op(
        single_op_model("LayerNormalization", [("x", (2, 5, 8))], initializers={"s": s, "b": b}, axis=-1)
    )
    assert ln.flops == 8 * 80
    assert ln.params == 16
    bn_w = {k: rng.normal(size=(3,)) for k in ("scale", "bias", "mean")}
    bn_w["var"] = np.abs(rng.normal(size=(3,))) + 1
    _, bn = only_op(single_op_model("BatchNormalization", [("x", (2, 3, 4, 4))], initializers=bn_w))
    assert bn.flops == 2 * 96


def test_reductions_read_every_input_element():
    _, op = only_op(single_op_model("ReduceMean", [("x", (2, 3, 10))], keepdims=0, opset=17))
    assert op.flops == 60
    _, gap = only_op(single_op_model("GlobalAveragePool", [("x", (1, 8, 7, 7))]))
    assert gap.flops == 8 * 49


def test_pooling_counts_window_elements_per_output():
    _, op = only_op(single_op_model("MaxPool", [("x", (1, 2, 8, 8))], kernel_shape=[2, 2], strides=[2, 2]))
    assert op.flops == (2 * 4 * 4) * 4


def test_a_pooling_window_larger_than_the_padded_input_counts_only_what_it_overlaps():
    # kernel 5x5 over a 2x2 input, ceil_mode: one output whose window overlaps 2x2 input cells.
    _, op = only_op(
        single_op_model(
            "AveragePool", [("x", (1, 3, 2, 2))], kernel_shape=[5, 5], strides=[5, 5], ceil_mode=1
        )
    )
    assert op.flops == 3 * 4
    # padding counts: pads 1 make the padded input 4x4, the window still overhangs it.
    _, op = only_op(
        single_op_model(
            "AveragePool",
            [("x", (1, 3, 2, 2))],
            kernel_shape=[5, 5],
            strides=[5, 5],
            pads=[1, 1, 1, 1],
            ceil_mode=1,
        )
    )
    assert op.flops == 3 * 16


def test_a_conv_kernel_overhanging_the_padded_input_counts_the_overlap():
    # w 3x3, pads 1 on a 1x1 input: one output, 1 tap of the real cell plus 8 of padding, all in range.
    w = rng.normal(size=(2, 1, 3, 3))
    _, op = only_op(single_op_model("Conv", [("x", (1, 1, 1, 1))], initializers={"w": w}, pads=[1, 1, 1, 1]))
    assert op.flops == 2 * 2 * 1 * 9  # C_out · 2 FLOPs a MAC · C_in · taps
    # strides 2 with a 2x2 kernel on a 3x3 input (ceil_mode pooling): the last window half outside.
    _, op = only_op(
        single_op_model("MaxPool", [("x", (1, 1, 3, 3))], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)
    )
    assert op.flops == (2 + 1) * (2 + 1)


def test_gather_moves_gathered_rows_and_indices_only():
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(rng.normal(size=(1000, 16)).astype(np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"], name="op")],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 16])],
        initializer=[table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    _, op = only_op(model)
    assert op.flops == 0
    assert op.params == 16000  # an embedding table is a parameter
    assert op.bytes_moved == 2 * (2 * 5 * 16 * 4) + 2 * 5 * 8


@pytest.mark.parametrize("op_type", ["Reshape", "Flatten", "Identity"])
def test_views_move_nothing(op_type):
    if op_type == "Reshape":
        model = single_op_model("Reshape", [("x", (2, 12)), ("shape", (2,))], output_shape=(4, 6))
        model.graph.input[1].type.tensor_type.elem_type = 7  # int64 shape operand
    else:
        model = single_op_model(op_type, [("x", (2, 12))])
    _, op = only_op(model)
    assert op.flops == 0 and op.bytes_moved == 0 and op.params == 0


def test_transpose_moves_but_computes_nothing():
    _, op = only_op(single_op_model("Transpose", [("x", (2, 3, 4))], perm=[2, 0, 1]))
    assert op.flops == 0
    assert op.bytes_moved == 2 * 24 * 4


def test_gemm_with_transposed_a():
    # A is [K, M] = [8, 3] with transA: M=3, K=8; B [8, 16].
    w = rng.normal(size=(8, 16))
    _, op = only_op(single_op_model("Gemm", [("a", (8, 3))], initializers={"w": w}, transA=1))
    assert op.flops == 2 * 3 * 8 * 16
