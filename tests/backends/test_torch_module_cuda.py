"""The torch interpreter on a GPU: shapes and positions are computed on the CPU (Shape, Range), the
data on the GPU, and a data operator that meets both (a position embedding's Gather, a mask's Where)
runs on the GPU. Outputs equal the CPU's."""

from __future__ import annotations

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
