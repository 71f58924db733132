"""Tensor-parallel splits found by dataflow (tessera.core.tensor_parallel): products split by
columns then rows where the chain between them keeps the split, whole where it does not."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx_builders import mlp_pair

from tessera.backends.torch_module import to_torch
from tessera.backends.torch_ops.collectives import use_group
from tessera.core.graph import load_graph
from tessera.core.tensor_parallel import _regroup, shard, tensor_parallel
from tessera.core.tp_program import local_model


def test_a_product_pair_with_elementwise_ops_between_is_split_by_columns_then_rows() -> None:
    graph = load_graph(mlp_pair("relu"))
    (region,) = tensor_parallel(graph, 2).regions
    assert region.columns == {"up"} and region.rows == {"down"}
    assert region.weights == {"w1": (1, 1), "b1": (0, 1), "w2": (0, 1)}  # the bias split with its columns
    assert region.split == {"h0": 2, "h1": 2, "h2": 2}
    assert region.operands == {("up", 0): None}  # x read through the copy
    assert region.reduce_bytes(graph) == 2 * 4 * 8 * 4  # y all-reduced


def test_a_norm_over_the_split_axis_leaves_the_products_whole() -> None:
    assert tensor_parallel(load_graph(mlp_pair("norm")), 2).regions == ()


def test_a_weight_another_product_reads_is_not_split() -> None:
    assert tensor_parallel(load_graph(mlp_pair("relu", tied=True)), 2).regions == ()


def test_widths_that_t_does_not_divide_are_not_split() -> None:
    assert tensor_parallel(load_graph(mlp_pair("relu", hidden=12)), 8).regions == ()
    assert tensor_parallel(load_graph(mlp_pair("relu", hidden=12)), 1).regions == ()


def test_restrict_keeps_only_regions_wholly_inside_the_stage() -> None:
    graph = load_graph(mlp_pair("relu"))
    split = tensor_parallel(graph, 2)
    assert split.restrict(graph.order).regions == split.regions
    assert split.restrict(["up", "bias", "act"]).regions == ()


@pytest.mark.parametrize(
    ("shape_in", "shape_out", "axis", "pieces", "want"),
    [
        ((2, 8, 64), (2, 8, 4, 16), 2, 1, (2, 1)),  # into heads: the heads axis
        ((2, 4, 8, 16), (2, 8, 64), 1, 1, (1, 1)),  # heads outermost of the merged axis: contiguous
        ((2, 6), (3, 4), 1, 1, None),  # a row of the output straddles two ranks' blocks
        ((2, 8, 4, 16), (2, 8, 64), 2, 1, (2, 1)),  # heads back into the hidden axis
        ((2, 4, 8, 16), (8, 8, 16), 1, 1, (0, 2)),  # batch × heads: 2 parts of 4 heads
        ((8, 8, 16), (2, 4, 8, 16), 0, 2, (1, 1)),  # and back
        ((2, 8, 3), (2, 8, 3), 2, 1, None),  # 3 does not split in 2
    ],
)
def test_regroup_follows_the_blocks_through_a_reshape(shape_in, shape_out, axis, pieces, want) -> None:
    assert _regroup(shape_in, shape_out, axis, pieces, 2) == want


def test_shard_takes_each_parts_block() -> None:
    a = np.arange(12).reshape(1, 12)  # 3 parts (Q, K, V) of 4
    assert shard(a, 1, 2, 0, 3).tolist() == [[0, 1, 4, 5, 8, 9]]
    assert shard(a, 1, 2, 1, 3).tolist() == [[2, 3, 6, 7, 10, 11]]


def _bf16_mlp(width: int = 64, hidden: int = 128) -> onnx.ModelProto:
    """x → x·W1 → Relu → ·W2 → y, all bf16."""
    rng = np.random.default_rng(1)
    bf16 = TensorProto.BFLOAT16

    def weight(name: str, shape: tuple[int, int]) -> onnx.TensorProto:
        return helper.make_tensor(name, bf16, shape, rng.standard_normal(shape).astype(np.float32).ravel())

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h0"], name="up"),
            helper.make_node("Relu", ["h0"], ["h1"], name="act"),
            helper.make_node("MatMul", ["h1", "w2"], ["y"], name="down"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", bf16, [2, 4, width])],
        [helper.make_tensor_value_info("y", bf16, [2, 4, width])],
        initializer=[weight("w1", (width, hidden)), weight("w2", (hidden, width))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_bf16_row_products_partials_are_computed_and_summed_in_fp32_when_widened() -> None:
    """``local_model(widen=True)``: each rank's row product computes its partial in fp32 (its weight
    block held so); summed, then rounded once, they give one process's bf16 product where bf16
    partials summed do not."""
    model = _bf16_mlp()
    graph = load_graph(model)
    split = tensor_parallel(graph, 2)
    x = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    whole = to_torch(model).run({"x": x})["y"]
    use_group("own", lambda partial: partial)  # each rank's partial as it is; summed below
    sums = {}
    for widen, partial in ((True, "y__tp_fp32"), (False, "y")):
        parts = []
        for rank in range(2):
            local = local_model(graph, graph.order, split, rank, group="own", widen=widen)
            kinds = {init.name: init.data_type for init in local.graph.initializer}
            assert kinds["w2"] == (TensorProto.FLOAT if widen else TensorProto.BFLOAT16)
            assert kinds["w1"] == TensorProto.BFLOAT16  # columns compute as the model says
            parts.append(to_torch(local).run({"x": x}, tensors=[partial])[partial])
        assert parts[0].dtype == (torch.float32 if widen else torch.bfloat16)
        sums[widen] = (parts[0].float() + parts[1].float()).bfloat16()
    assert (sums[True] != whole).float().mean() < 0.01
    assert (sums[False] != whole).float().mean() > 0.05
