"""A model whose external weights would take it past protobuf's 2 GiB (a 2.15 GB weight was an
internal EncodeError after 28 s) keeps its large weights on disk: it inspects and plans from their
shapes, and what must run it refuses in one line. The 2 GiB limit is lowered here to a few KiB:
the same code path without writing gigabytes."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from cli_runner import run_cli

import tessera.core.external_data as external_data
from tessera.core.graph import load_graph
from tessera.models import build


@pytest.fixture
def big_model(tmp_path: Path) -> Path:
    path = tmp_path / "mmt.onnx"
    onnx.save(build("mmt", "tiny"), path, save_as_external_data=True, location="w.bin", size_threshold=1024)
    return path


def test_weights_in_memory_when_they_fit(big_model: Path) -> None:
    graph = load_graph(str(big_model))
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in graph.model.graph.initializer)


def test_past_the_limit_large_weights_stay_on_disk_and_runs_are_refused(
    big_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(external_data, "MAX_INLINE_BYTES", 10_000)
    monkeypatch.setattr(external_data, "SMALL_BYTES", 1024)
    inspected = run_cli("inspect", str(big_model), "--json")
    assert inspected.code == 0, inspected.err
    assert "are left on disk: with them the model passes protobuf's 2 GiB" in caplog.text
    plan = tmp_path / "plan.json"
    planned = run_cli("plan", str(big_model), "--cluster", "local-cpu", "--mini-batch", "8", "-o", str(plan))
    assert planned.code == 0, planned.err
    assert "launch cannot train this model:" in planned.err and "are not in memory" in planned.err
    for args in (["place", str(big_model), "--backends", "onnxruntime"], ["validate", str(plan)]):
        result = run_cli(*args)
        lines = result.err.strip().splitlines()
        assert result.code == 2 and "Traceback" not in result.err, result.err
        assert "weight(s) are not in memory" in lines[-1] and "external data 'w.bin'" in lines[-1], lines
