"""Sparse initializers are read as the dense weights they stand for (they were an internal error,
``AttributeError: name``); bad indices and dense sizes past 2 GiB are refused naming the weight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessera.core.errors import InputError
from tessera.core.graph import load_graph


def _model(path: Path, indices: np.ndarray, dims: list[int], values=(1.5, -2.0)) -> Path:
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.array(values, np.float32), "w"),
        numpy_helper.from_array(indices, "w_i"),
        dims,
    )
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], sparse_initializer=[sparse]
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize(
    "indices",
    [np.array([0, 5], np.int64), np.array([[0, 0], [1, 2]], np.int64)],
    ids=["linear", "coordinates"],
)
def test_a_sparse_weight_computes_what_onnxruntime_computes(tmp_path: Path, indices: np.ndarray) -> None:
    path = _model(tmp_path / "m.onnx", indices, [2, 3])
    graph = load_graph(str(path))
    assert not graph.model.graph.sparse_initializer
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    want = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    got = ort.InferenceSession(graph.model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
    assert want[0, 0] == 1.5 and want[1, 2] == 5 - 2.0


@pytest.mark.parametrize(
    ("indices", "dims", "fragment"),
    [
        (np.array([0, 6], np.int64), [2, 3], "indices outside its 6 elements"),
        (np.array([[0, 0], [2, 0]], np.int64), [2, 3], "indices outside its dims [2, 3]"),
        (np.array([0, 1], np.int64), [100000, 100000], "its dense form would exceed 2 GiB"),
    ],
)
def test_bad_sparse_weights_are_refused(tmp_path: Path, indices, dims, fragment) -> None:
    path = _model(tmp_path / "m.onnx", indices, dims)
    with pytest.raises(InputError, match=r"sparse initializer 'w'") as info:
        load_graph(str(path))
    assert fragment in info.value.one_line() and str(path) in info.value.one_line()
