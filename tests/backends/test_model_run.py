"""The recognizer's probe runner: onnxruntime, or tessera's torch executor where onnxruntime has no CPU
kernel (bf16); bf16 arrays cross numpy and torch bit for bit."""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto, helper

from tessera.backends.model_run import ModelRun
from tessera.backends.torch_ops import from_numpy, to_numpy
from tessera.core.graph import is_floating


def _where(elem: int) -> helper.ModelProto:
    node = helper.make_node("Where", ["c", "a", "b"], ["y"])
    graph = helper.make_graph(
        [node], "w",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, [3]),
         helper.make_tensor_value_info("a", elem, [3]), helper.make_tensor_value_info("b", elem, [3])],
        [helper.make_tensor_value_info("y", elem, [3])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_bf16_crosses_numpy_and_torch_bit_for_bit() -> None:
    values = torch.tensor([1.0, -2.5, 3.140625, 1e-3, 65280.0]).to(torch.bfloat16)
    array = to_numpy(values)
    assert array.dtype.name == "bfloat16" and is_floating(array.dtype) and is_floating("bfloat16")
    assert torch.equal(from_numpy(array).view(torch.int16), values.view(torch.int16))
    assert not is_floating("int64") and is_floating("float16")


def test_a_graph_onnxruntime_cannot_run_runs_in_torch() -> None:
    cond = np.array([True, False, True])
    a, b = (np.array(v, np.float32) for v in ([1, 2, 3], [4, 5, 6]))
    fp32 = ModelRun(_where(TensorProto.FLOAT))
    assert fp32.runtime == "onnxruntime"
    assert fp32.run(["y"], {"c": cond, "a": a, "b": b})[0].tolist() == [1, 5, 3]
    bf16 = ModelRun(_where(TensorProto.BFLOAT16))  # onnxruntime 1.32 has no CPU Where for bf16
    assert bf16.runtime == "torch"
    bf = np.dtype("bfloat16")
    (y,) = bf16.run(["y"], {"c": cond, "a": a.astype(bf), "b": b.astype(bf)})
    assert y.dtype == bf and y.astype(np.float32).tolist() == [1, 5, 3]
