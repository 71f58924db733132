"""Shared fixtures: models are built in code (the zoo or onnx.helper), never downloaded.

The session-scoped factories (``cluster``, ``v100``, ``zoo``, ``zoo_graph``) load or build each thing
once. What they share is read-only: a :class:`ClusterSpec` is frozen (pydantic ``frozen=True``; a test
that needs another cluster edits ``to_json_dict()`` and builds its own), a loaded :class:`Graph` is
never modified by tessera (and must not be by a test), and ``zoo`` hands out a fresh ``ModelProto``
copy on every call, since a proto is mutable.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path

# Triton picks interpreter mode when first imported: on a machine without an NVIDIA GPU, set it before
# any test module imports triton, so the kernel tests run on the interpreter instead of skipping.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import onnx
import pytest

from tessera.core.graph import Graph, load_graph
from tessera.core.specs import ClusterSpec, load_cluster
from tessera.models import build


@pytest.fixture
def write_model(tmp_path: Path):
    """Write a ModelProto (or raw bytes) to a file under tmp_path and return the path."""

    def write(model: onnx.ModelProto | bytes, name: str = "model.onnx") -> Path:
        path = tmp_path / name
        path.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
        return path

    return write


@pytest.fixture(scope="session")
def cluster() -> Callable[[str], ClusterSpec]:
    """``cluster(name)``: the cluster preset (or spec file) ``name``, loaded once per session."""
    return functools.cache(load_cluster)


@pytest.fixture(scope="session")
def v100(cluster: Callable[[str], ClusterSpec]) -> ClusterSpec:
    """GraphPipe's cluster: 16 GB V100s, four per node (the pipeline planners' usual target)."""
    return cluster("graphpipe-v100")


@functools.cache
def _built(name: str, size: str) -> onnx.ModelProto:
    return build(name, size)  # deterministic: the same bytes for the same arguments


@pytest.fixture(scope="session")
def zoo() -> Callable[..., onnx.ModelProto]:
    """``zoo(name, size="tiny")``: a fresh copy of zoo model ``name`` (seed 0), built once per session."""

    def copy(name: str, size: str = "tiny") -> onnx.ModelProto:
        model = onnx.ModelProto()
        model.CopyFrom(_built(name, size))
        return model

    return copy


@pytest.fixture(scope="session")
def zoo_graph() -> Callable[..., Graph]:
    """``zoo_graph(name, size="tiny")``: zoo model ``name`` (seed 0) loaded, shared by the session's
    tests: read it, do not modify it."""

    @functools.cache
    def loaded(name: str, size: str) -> Graph:
        return load_graph(_built(name, size))

    def graph(name: str, size: str = "tiny") -> Graph:
        return loaded(name, size)

    return graph
