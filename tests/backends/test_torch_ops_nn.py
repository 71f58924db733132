"""Convolution, pooling, normalization and Resize of the torch operator table against onnxruntime
(forward) and finite differences (backward), at every schema version of opsets 13–23: explicit,
asymmetric and automatic pads, ceil_mode, groups, dilations, and Resize's modes."""

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

IMAGE = normal(2, 4, 5, 6)
SMALL = normal(1, 2, 4, 5)
SEQ = normal(2, 3, 7)
W = normal(6, 4, 3, 3, scale=0.3)
CLOSE = (1e-4, 1e-5)  # sums over windows: onnxruntime accumulates in another order

CONV: list[Case] = [
    case("Conv", IMAGE, W, normal(6), grad=[0, 1, 2], pads=[1, 1, 1, 1], tol=CLOSE),
    case(
        "Conv", IMAGE, normal(4, 2, 3, 2), grad=[0, 1], group=2, strides=[2, 1], dilations=[1, 2], tol=CLOSE
    ),
    case("Conv", IMAGE, W, grad=[0, 1], pads=[0, 1, 2, 0], tol=CLOSE),
    case("Conv", IMAGE, W, strides=[2, 2], auto_pad="SAME_UPPER", tol=CLOSE),
    case("Conv", IMAGE, W, strides=[2, 2], auto_pad="SAME_LOWER", tol=CLOSE),
    case("Conv", IMAGE, W, auto_pad="VALID", tol=CLOSE),
    case("Conv", SEQ, normal(4, 3, 3), normal(4), grad=[0, 1, 2], pads=[2, 0], tol=CLOSE),
    case("Conv", normal(1, 2, 3, 4, 4), normal(2, 2, 2, 2, 2), grad=[0, 1], strides=[1, 2, 2], tol=CLOSE),
    case("ConvTranspose", SMALL, normal(2, 3, 3, 3), normal(3), grad=[0, 1, 2], tol=CLOSE),
    case(
        "ConvTranspose",
        SMALL,
        normal(2, 2, 3, 2),
        normal(4),
        grad=[0, 1, 2],
        strides=[2, 2],
        pads=[1, 0, 0, 1],
        output_padding=[1, 1],
        group=2,
        tol=CLOSE,
    ),  # fmt: skip
    case(
        "ConvTranspose",
        SMALL,
        normal(2, 3, 3, 3),
        strides=[2, 3],
        dilations=[2, 1],
        pads=[1, 1, 1, 1],
        tol=CLOSE,
    ),
    case("ConvTranspose", SMALL, normal(2, 3, 3, 3), strides=[2, 2], output_shape=[8, 10], tol=CLOSE),
    case("ConvTranspose", SMALL, normal(2, 3, 3, 3), strides=[2, 2], output_shape=[9, 10], tol=CLOSE),
    case("ConvTranspose", SMALL, normal(2, 3, 2, 2), strides=[2, 2], auto_pad="SAME_UPPER", tol=CLOSE),
    case("ConvTranspose", SMALL, normal(2, 3, 3, 3), strides=[2, 2], auto_pad="SAME_LOWER", tol=CLOSE),
    case("ConvTranspose", SEQ, normal(3, 2, 4), grad=[0, 1], strides=[3], tol=CLOSE),
]

POOLS: list[Case] = [
    case("MaxPool", IMAGE, grad=[0], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
    case("MaxPool", IMAGE, grad=[0], kernel_shape=[2, 3], strides=[2, 2], ceil_mode=1),
    case("MaxPool", IMAGE, grad=[0], kernel_shape=[3, 3], strides=[2, 2], pads=[0, 2, 1, 0], ceil_mode=1),
    case("MaxPool", IMAGE, grad=[0], kernel_shape=[2, 2], dilations=[2, 2], pads=[1, 1, 1, 1]),
    case("MaxPool", IMAGE, grad=[0], kernel_shape=[3, 2], strides=[2, 2], auto_pad="SAME_UPPER"),
    case("MaxPool", SEQ, grad=[0], kernel_shape=[3], strides=[2], auto_pad="SAME_LOWER"),
    case("AveragePool", IMAGE, grad=[0], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
    case("AveragePool", IMAGE, grad=[0], kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1),
    case("AveragePool", IMAGE, grad=[0], kernel_shape=[3, 2], strides=[2, 2], pads=[0, 1, 2, 0]),
    case("AveragePool", IMAGE, grad=[0], kernel_shape=[3, 2], pads=[0, 1, 2, 0], count_include_pad=1),
    case("AveragePool", IMAGE, grad=[0], kernel_shape=[2, 4], strides=[2, 3], ceil_mode=1),
    case("AveragePool", IMAGE, grad=[0], kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"),
    case("AveragePool", SEQ, grad=[0], kernel_shape=[2], strides=[2], pads=[1, 0]),
    case("LpPool", IMAGE, grad=[0], kernel_shape=[2, 2], pads=[1, 0, 0, 1], tol=CLOSE),
    case("LpPool", IMAGE, grad=[0], kernel_shape=[3, 2], strides=[2, 1], p=1),
    case("GlobalAveragePool", IMAGE, grad=[0]),
    case("GlobalMaxPool", SEQ, grad=[0]),
]

SCALE4, SHIFT4 = normal(4), normal(4)
NORMS: list[Case] = [
    case(
        "BatchNormalization",
        IMAGE,
        SCALE4,
        SHIFT4,
        normal(4),
        np.abs(normal(4)) + 0.5,
        grad=[0, 1, 2],
        epsilon=1e-3,
    ),  # fmt: skip
    case("LayerNormalization", IMAGE, normal(6), normal(6), grad=[0, 1, 2], outputs=3),
    case("LayerNormalization", IMAGE, normal(5, 6), grad=[0, 1], outputs=3, axis=-2, epsilon=1e-3),
    case("LayerNormalization", SEQ, normal(3, 7), normal(7), grad=[0, 1, 2], axis=1),
    case("RMSNormalization", IMAGE, normal(6), grad=[0, 1]),
    case("RMSNormalization", IMAGE, normal(4, 5, 6), grad=[0, 1], axis=1, epsilon=1e-3),
    case("InstanceNormalization", IMAGE, SCALE4, SHIFT4, grad=[0, 1, 2], tol=CLOSE),
    case("GroupNormalization", IMAGE, SCALE4, SHIFT4, grad=[0, 1, 2], num_groups=2),
    case("GroupNormalization", IMAGE, SCALE4, SHIFT4, num_groups=4, epsilon=1e-2, tol=CLOSE),
    case("LpNormalization", IMAGE, grad=[0]),
    case("LpNormalization", IMAGE, grad=[0], axis=1, p=1),
    case("LRN", IMAGE, grad=[0], size=3),
    case("LRN", IMAGE, grad=[0], size=5, alpha=0.01, beta=0.5, bias=2.0),
    case("MeanVarianceNormalization", IMAGE, grad=[0], tol=CLOSE),
    case("MeanVarianceNormalization", SEQ, grad=[0], axes=[1], tol=CLOSE),
]

F4 = np.float32
SINCE_18, SINCE_19 = range(18, 24), range(19, 24)
RESIZE: list[Case] = [
    case("Resize", SMALL, None, F4([1, 1, 2, 2]), grad=[0]),
    case("Resize", SMALL, None, F4([1, 1, 0.6, 0.7]), nearest_mode="round_prefer_ceil"),
    case("Resize", SMALL, None, F4([1, 1, 1.5, 1.7]), nearest_mode="floor", coordinate_transformation_mode="asymmetric"),
    case("Resize", SMALL, None, F4([1, 1, 1.5, 0.5]), nearest_mode="ceil", coordinate_transformation_mode="align_corners"),
    case("Resize", SMALL, None, F4([1, 1, 2, 1.5]), grad=[0], mode="linear", tol=CLOSE),
    case("Resize", SMALL, None, F4([1, 1, 0.5, 0.6]), grad=[0], mode="linear", tol=CLOSE),
    case("Resize", SMALL, None, F4([1, 1, 1.7, 2]), mode="linear", coordinate_transformation_mode="align_corners", tol=CLOSE),
    case("Resize", SMALL, None, F4([1, 1, 2, 2]), mode="linear", coordinate_transformation_mode="asymmetric", tol=CLOSE),
    case("Resize", SMALL, None, F4([1, 1, 0.25, 2]), mode="linear", coordinate_transformation_mode="pytorch_half_pixel", tol=CLOSE),
    case("Resize", SMALL, None, F4([1, 1, 1.5, 0.7]), mode="linear", coordinate_transformation_mode="half_pixel_symmetric", tol=CLOSE, opsets=SINCE_19),
    case("Resize", SMALL, None, F4([1, 1, 2, 1.5]), grad=[0], mode="cubic", tol=CLOSE),
    case("Resize", SMALL, None, F4([1, 1, 1.5, 0.8]), mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1, tol=CLOSE),
    case("Resize", SMALL, F4([0, 0, 0.2, 0.1, 1, 1, 0.9, 1.2]), None, i64(1, 2, 5, 4), mode="linear", coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-1.0, tol=CLOSE),
    case("Resize", SMALL, None, None, i64(1, 2, 7, 3), grad=[0], mode="linear", tol=CLOSE),
    # torch.onnx's legacy export: empty roi and scales, sizes as initializers
    case("Resize", SMALL, F4([]), F4([]), i64(1, 2, 3, 8), mode="linear", constants=[1, 2, 3], tol=CLOSE),
    case("Resize", SMALL, None, None, i64(1, 2, 8, 7)),
    case("Resize", SMALL, None, None, i64(8, 8), mode="linear", axes=[2, 3], keep_aspect_ratio_policy="not_larger", tol=CLOSE, opsets=SINCE_18),
    case("Resize", SMALL, None, None, i64(8, 8), axes=[3, 2], keep_aspect_ratio_policy="not_smaller", opsets=SINCE_18),
    case("Resize", SMALL, None, F4([1.5]), grad=[0], mode="linear", axes=[-1], tol=CLOSE, opsets=SINCE_18),
]  # fmt: skip

CASES = CONV + POOLS + NORMS + RESIZE


@pytest.mark.parametrize(("c", "opset"), at_opsets(CASES))
def test_forward_matches_onnxruntime(c: Case, opset: int) -> None:
    check_forward(c, opset)


@pytest.mark.parametrize("c", with_grad(CASES))
def test_backward_matches_finite_differences(c: Case) -> None:
    check_backward(c)
