"""Shared fixtures: models are built in code (the zoo or onnx.helper), never downloaded."""

from __future__ import annotations

from pathlib import Path

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
