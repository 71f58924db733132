"""Shared fixtures: models are built in code (the zoo or onnx.helper), never downloaded."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Triton picks interpreter mode when first imported: on a machine without an NVIDIA GPU, set it before
# any test module imports triton, so the kernel tests run on the interpreter instead of skipping.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import onnx
import pytest


@pytest.fixture
def write_model(tmp_path: Path):
    """Write a ModelProto (or raw bytes) to a file under tmp_path and return the path."""

    def write(model: onnx.ModelProto | bytes, name: str = "model.onnx") -> Path:
        path = tmp_path / name
        path.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
        return path

    return write
