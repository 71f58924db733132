"""Shape, layout and tensor-making operators of the torch operator table against onnxruntime
(forward) and finite differences (backward), at every schema version of opsets 13–23; each input
form (attributes or inputs) at the opsets that allow it."""

from __future__ import annotations

import numpy as np
import pytest
from backends.torch_op_cases import (
    Case,
    at_opsets,
    case,
    check_backward,
    check_forward,
    i64,
    normal,
    with_grad,
)
from onnx import numpy_helper

X = normal(3, 4)
CUBE = normal(2, 3, 4)
IMAGE = normal(1, 8, 2, 3)
BIG = 2**63 - 1
SINCE_18 = range(18, 24)
BEFORE_18 = range(13, 18)

LAYOUT: list[Case] = [
    case("Identity", X, grad=[0]),
    case("Dropout", X, outputs=2),
    case("Dropout", X, np.float32(0.3), np.array(False), outputs=2),
    case("Reshape", X, i64(2, -1), grad=[0]),
    case("Reshape", X, i64(-1, 6), constants=[1]),
    case("Reshape", CUBE, i64(0, 2, -1), grad=[0]),  # 0 copies the dimension
    case("Reshape", CUBE, i64(4, 6), grad=[0], allowzero=1, opsets=range(14, 24)),
    case("Flatten", CUBE, grad=[0]),
    case("Flatten", CUBE, axis=0),
    case("Flatten", CUBE, axis=-1),
    case("Flatten", CUBE, axis=3),
    case("Transpose", CUBE, grad=[0]),
    case("Transpose", CUBE, grad=[0], perm=[1, 2, 0]),
    case("Concat", X, normal(3, 2), normal(3, 1), grad=[0, 1, 2], axis=1),
    case("Concat", CUBE, CUBE, axis=-3),
    case("Split", normal(6, 2), i64(1, 2, 3), grad=[0], outputs=3),
    case("Split", CUBE, i64(3, 1), outputs=2, axis=-1),
    case("Split", normal(6, 2), outputs=3, opsets=BEFORE_18),  # as many equal parts as outputs
    case("Split", normal(7, 2), grad=[0], outputs=3, num_outputs=3, opsets=SINCE_18),  # 3, 3, 1
    case("Split", CUBE, outputs=2, axis=1, num_outputs=2, opsets=SINCE_18),
    case("Squeeze", normal(3, 1, 4, 1), i64(1), grad=[0]),
    case("Squeeze", normal(3, 1, 4, 1), i64(-1, 1)),
    case("Squeeze", normal(3, 1, 4, 1)),
    case("Unsqueeze", X, i64(0, -1), grad=[0]),
    case("Unsqueeze", X, i64(1, 3)),
    case("Expand", normal(3, 1), i64(2, 3, 4), grad=[0]),
    case("Expand", X, i64(4)),  # a smaller shape broadcasts
    case("Tile", X, i64(2, 1), grad=[0]),
    case("Tile", CUBE, i64(1, 2, 3)),
    case("Shape", CUBE),
    case("Shape", CUBE, start=1, opsets=range(15, 24)),
    case("Shape", CUBE, start=-5, end=-1, opsets=range(15, 24)),  # clamped
    case("Size", CUBE),
    case("Slice", X, i64(1, -3), i64(BIG, -1), grad=[0]),
    case("Slice", X, i64(0, 3), i64(3, 0), i64(0, 1), i64(2, -1), grad=[0]),
    case("Slice", X, i64(-1), i64(-(2**63)), i64(1), i64(-2)),
    case("Slice", CUBE, i64(1), i64(100), i64(-2)),
    case("Slice", CUBE, np.array([0], np.int32), np.array([1], np.int32), np.array([0], np.int32)),
    case("Slice", X, i64(5), i64(9), i64(1)),  # empty
]

PADS: list[Case] = [
    case("Pad", X, i64(1, 0, 2, 1), grad=[0]),
    case("Pad", X, i64(1, 2, 0, 1), np.float32(1.5), grad=[0]),
    case("Pad", X, i64(-1, 1, 0, -2), grad=[0]),  # negative pads crop
    case("Pad", i64(1, 2, 3), i64(2, 1), np.int64(7)),
    case("Pad", CUBE, i64(1, 2, 0, 1, 1, 3), grad=[0], mode="reflect"),
    case("Pad", CUBE, i64(2, 0, 1, 1, 3, 0), grad=[0], mode="edge"),
    case("Pad", CUBE, i64(0, -1, 1, 0, 2, -1), grad=[0], mode="edge"),
    case("Pad", CUBE, i64(1, 2, 0, 2, 5, 3), grad=[0], mode="wrap", opsets=range(19, 24)),
    case("Pad", CUBE, i64(1, 2, 3, 0), None, i64(-1, 1), grad=[0], opsets=SINCE_18),
    case("Pad", CUBE, i64(2, 1, 3, 0), None, i64(2, 0), grad=[0], mode="reflect", opsets=SINCE_18),
]

BLOCKS: list[Case] = [
    case("DepthToSpace", IMAGE, grad=[0], blocksize=2),
    case("DepthToSpace", IMAGE, grad=[0], blocksize=2, mode="CRD"),
    case("SpaceToDepth", normal(1, 2, 4, 6), grad=[0], blocksize=2),
]

CREATION: list[Case] = [
    case("Constant", value=numpy_helper.from_array(X)),
    case("Constant", value_float=0.25),
    case("Constant", value_floats=[1.0, 2.5]),
    case("Constant", value_int=3),
    case("Constant", value_ints=[3, -1]),
    case("ConstantOfShape", i64(2, 3)),
    case("ConstantOfShape", i64(2), value=numpy_helper.from_array(i64(7))),
    case(
        "ConstantOfShape", np.zeros(0, np.int64), value=numpy_helper.from_array(np.array([0.5], np.float32))
    ),
    case("Range", np.int64(0), np.int64(7), np.int64(2)),
    case("Range", np.int64(5), np.int64(-2), np.int64(-3)),
    case("Range", np.float32(1.0), np.float32(2.0), np.float32(0.25)),
    case("EyeLike", X),
    case("EyeLike", X, k=1, dtype=7),
    case("EyeLike", normal(4, 2), k=-1),
    case("Trilu", X, grad=[0]),
    case("Trilu", CUBE, np.int64(-1), grad=[0], upper=0),
    case("Trilu", X, np.int64(2)),
]

CASES = LAYOUT + PADS + BLOCKS + CREATION


@pytest.mark.parametrize(("c", "opset"), at_opsets(CASES))
def test_forward_matches_onnxruntime(c: Case, opset: int) -> None:
    check_forward(c, opset)


@pytest.mark.parametrize("c", with_grad(CASES))
def test_backward_matches_finite_differences(c: Case) -> None:
    check_backward(c)
