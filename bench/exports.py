"""Real torch.onnx exports for the placement benchmarks: the corpus's third-party models (transformers'
BERT, ViT, ResNet, GPT-2 and a MobileNetV3-small-style CNN, static batch, from ``tests/corpus``) and
SqueezeNet 1.1 at 224x224 (torchvision's architecture, built here because torchvision's CPU build is
not available; Kaiming-initialised like torchvision's, seeded), exported once per library versions.

Names: ``export:<corpus model>:<exporter>`` or ``squeezenet``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from corpus.exports import cache_dir, entry

EXPORTS = [
    "export:bert:legacy",
    "export:vit:dynamo",
    "export:resnet:legacy",
    "export:mobilenetv3:legacy",
    "export:gpt2:legacy",
    "squeezenet",
]


class _Fire(nn.Module):
    """SqueezeNet's Fire module: squeeze 1x1, then expand 1x1 and 3x3 side by side."""

    def __init__(self, c_in: int, squeeze: int, expand: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(c_in, squeeze, 1)
        self.expand1 = nn.Conv2d(squeeze, expand, 1)
        self.expand3 = nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.squeeze(x))
        return torch.cat([torch.relu(self.expand1(x)), torch.relu(self.expand3(x))], 1)


def squeezenet1_1(classes: int = 1000) -> nn.Module:
    pool = nn.MaxPool2d(3, 2, ceil_mode=True)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, 2), nn.ReLU(), pool,
        _Fire(64, 16, 64), _Fire(128, 16, 64), pool,
        _Fire(128, 32, 128), _Fire(256, 32, 128), pool,
        _Fire(256, 48, 192), _Fire(384, 48, 192), _Fire(384, 64, 256), _Fire(512, 64, 256),
        nn.Dropout(0.5), nn.Conv2d(512, classes, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )  # fmt: skip
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    return model.eval()


def export_path(name: str) -> str:
    """The ONNX file of a benchmark export (made once, then read from the corpus cache)."""
    if name.startswith("export:"):
        _, model, exporter = name.split(":")
        made = entry(model, exporter, "static")
        if made.path is None:
            raise RuntimeError(f"{name}: the export failed: {made.error}")
        return made.path
    if name != "squeezenet":
        raise KeyError(name)
    path = cache_dir() / "bench-squeezenet1_1.onnx"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        tmp = path.with_suffix(f".tmp{os.getpid()}.onnx")
        torch.onnx.export(
            squeezenet1_1(), (torch.randn(1, 3, 224, 224),), str(tmp), input_names=["x"], output_names=["logits"],
            dynamo=False, opset_version=17,
        )  # fmt: skip
        tmp.replace(path)
    return str(path)
