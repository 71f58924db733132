"""The torch interpreter on a GPU: shapes and positions are computed on the CPU (Shape, Range), the
data on the GPU, and a data operator that meets both (a position embedding's Gather, a mask's Where)
runs on the GPU. Outputs equal the CPU's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.backends.torch_module import to_torch
from tessera.backends.torch_ops import co_located
from tessera.models import build


def test_tensors_on_one_device_are_left_as_they_are() -> None:
    a, b = torch.ones(3), torch.zeros(3)
    moved = co_located(a, b)
    assert moved[0] is a and moved[1] is b


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_a_zoo_model_runs_on_cuda_as_on_the_cpu(name: str) -> None:
    model = build(name, "tiny", 0)
    cpu = to_torch(model, label=name)
    shapes = {i.name: [d.dim_value or 2 for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    feeds = {n: torch.randint(0, 2, shapes[n]) for n in cpu.input_names}  # ids valid in every table
    want = cpu.run(feeds)
    gpu = to_torch(model, label=name).to("cuda")
    got = gpu.run({k: v.cuda() for k, v in feeds.items()})
    for key, value in want.items():
        assert got[key].is_cuda
        torch.testing.assert_close(got[key].cpu(), value, rtol=1e-4, atol=1e-4)


def test_shape_arithmetic_meeting_constants_stays_on_the_cpu() -> None:
    # The CPU-side half of what a GPU run does: small integer tensors (a shape and a constant)
    # are shape arithmetic and go to the CPU; a float tensor takes the other device.
    shape, constant = torch.tensor([2, 16]), torch.tensor([-1])
    assert all(t.device.type == "cpu" for t in co_located(shape, constant))
    assert co_located(torch.ones(3), torch.zeros(3, dtype=torch.int64))[1].dtype == torch.int64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_concat_of_a_shape_and_a_gpu_constant_runs_and_data_concats_on_the_gpu() -> None:
    # The corpus's GPT-2 (TorchScript exporter) concatenates a Shape-derived size with a Constant,
    # its ViT (dynamo) a Shape with an int64 initializer: both failed on CUDA in torch.cat.
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["x"], ["s"], end=1),
            helper.make_node("Concat", ["s", "tail"], ["shape"], axis=0),
            helper.make_node("Reshape", ["x", "shape"], ["flat"]),
            helper.make_node("Concat", ["flat", "bias"], ["y"], axis=1),
        ],
        "concat",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 13])],
        [
            numpy_helper.from_array(np.array([-1], dtype=np.int64), "tail"),
            numpy_helper.from_array(np.ones((2, 1), dtype=np.float32), "bias"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = torch.randn(2, 3, 4)
    want = to_torch(model, label="concat").run({"x": x})["y"]
    got = to_torch(model, label="concat").to("cuda").run({"x": x.cuda()})["y"]
    assert got.is_cuda
    torch.testing.assert_close(got.cpu(), want)
