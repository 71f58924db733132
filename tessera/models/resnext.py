"""ResNeXt: a CNN of grouped-convolution bottleneck blocks (ResNeXt-50 32x4d at paper size).

Xie et al.'s ResNeXt-50 (32x4d) at 224x224 in the torchvision layout (stride on the 3x3 convolution):
``stem`` → ``stage{s}/block{b}`` (1x1 → grouped 3x3 → 1x1, ``downsample`` on a stage's first block,
residual Add, Relu) → ``head`` (GlobalAveragePool, Gemm) → ``logits``: the kind of model Collage places
across backends. References: Collage paper evaluation (ResNeXt-50). Structure: docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto

from tessera.models.layers import BATCH, GraphBuilder, conv_bn, gemm


@dataclass(frozen=True)
class ResNeXtConfig:
    image: int
    stem_channels: int
    stem_kernel: int
    stem_stride: int
    stem_maxpool: bool
    blocks: tuple[int, ...]
    base_planes: int
    cardinality: int
    base_width: int
    classes: int


CONFIGS = {
    "tiny": ResNeXtConfig(
        image=32, stem_channels=16, stem_kernel=3, stem_stride=1, stem_maxpool=False, blocks=(1, 1, 1),
        base_planes=8, cardinality=4, base_width=16, classes=10,
    ),
    "paper": ResNeXtConfig(
        image=224, stem_channels=64, stem_kernel=7, stem_stride=2, stem_maxpool=True, blocks=(3, 4, 6, 3),
        base_planes=64, cardinality=32, base_width=4, classes=1000,
    ),
}  # fmt: skip

_EXPANSION = 4  # bottleneck output channels = 4 x planes


def build_resnext(config: ResNeXtConfig, *, seed: int = 0, lazy: bool = False) -> onnx.ModelProto:
    """Build the ResNeXt of ``config`` (ResNeXt-50 32x4d at paper size)."""
    c = config
    g = GraphBuilder("resnext", seed=seed, lazy=lazy)
    x = g.input("image", TensorProto.FLOAT, [BATCH, 3, c.image, c.image])
    x = conv_bn(g, x, 3, c.stem_channels, "stem", kernel=c.stem_kernel, stride=c.stem_stride)
    if c.stem_maxpool:
        x = g.op("MaxPool", [x], "stem/maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    channels = c.stem_channels
    for s, count in enumerate(c.blocks):
        planes = c.base_planes * 2**s
        for b in range(count):
            with g.scope(f"stage{s}/block{b}"):
                stride = 2 if s > 0 and b == 0 else 1
                x = _bottleneck(g, x, channels, planes, stride, c)
            channels = planes * _EXPANSION
    with g.scope("head"):
        x = g.op("GlobalAveragePool", [x], "pool")
        x = g.op("Flatten", [x], "flatten", axis=1)
        logits = gemm(g, x, channels, c.classes, "fc", std=channels**-0.5, output="logits")
    g.output(logits, TensorProto.FLOAT, [BATCH, c.classes])
    return g.build(c, "ResNeXt CNN with grouped convolutions.")


def _bottleneck(g: GraphBuilder, x: str, in_ch: int, planes: int, stride: int, c: ResNeXtConfig) -> str:
    """The ResNeXt bottleneck block (aggregated residual transformations, as grouped convolution)."""
    width = planes * c.base_width // 64 * c.cardinality
    out_ch = planes * _EXPANSION
    h = conv_bn(g, x, in_ch, width, "conv1", kernel=1)
    h = conv_bn(g, h, width, width, "conv2", kernel=3, stride=stride, group=c.cardinality)
    h = conv_bn(g, h, width, out_ch, "conv3", kernel=1, relu=False)
    if stride != 1 or in_ch != out_ch:
        x = conv_bn(g, x, in_ch, out_ch, "downsample", kernel=1, stride=stride, relu=False)
    y = g.op("Add", [h, x], "residual")
    return g.op("Relu", [y], "relu")
