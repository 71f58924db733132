"""The registry: built-ins, YAML patterns, entry-point plugins, candidates, and ``tessera backends``."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_runner import run_cli

from tessera.backends.base import Backend, Capability
from tessera.backends.patterns import is_op, wildcard
from tessera.backends.registry import BackendRegistry, builtin_registry, pattern_from_yaml
from tessera.backends.rules import SingleOpRule
from tessera.core.errors import InputError


class EchoBackend(Backend):
    """A third-party backend that runs only Relu, with numpy."""

    name = "echo"

    def available(self) -> tuple[bool, str]:
        return True, ""

    def capability(self) -> Capability:
        return Capability(frozenset({"Relu"}), frozenset({"float32"}), "numpy")

    def compile(self, model: onnx.ModelProto):
        raise NotImplementedError


def test_register_patterns_and_rules(gpt) -> None:
    registry = BackendRegistry()
    registry.register_backend(
        "echo", EchoBackend, patterns=[is_op("Relu")(wildcard())], rules=[SingleOpRule()]
    )
    registry.add_pattern("echo", is_op("Add"), name="add")
    assert [p.name for p in registry.entry("echo").patterns] == ["pattern0", "add"]
    assert len(registry.entry("echo").rules) == 1
    with pytest.raises(ValueError):
        registry.register_backend("echo", EchoBackend)
    with pytest.raises(InputError, match="unknown backend 'nope'"):
        registry.backend("nope")
    # Candidates keep only what the backend supports (no Relu in gpt: nothing).
    assert registry.candidates(gpt, ["echo"]) == []


class FakeEntryPoint:
    """Stands in for an installed distribution's ``tessera.backends`` entry point."""

    def __init__(self, name: str, obj: object) -> None:
        self.name, self.value, self._obj = name, f"thirdparty:{name}", obj

    def load(self) -> object:
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


def test_entry_point_plugins(monkeypatch) -> None:
    def register(registry: BackendRegistry) -> None:
        registry.register_backend("echo2", EchoBackend(), rules=[SingleOpRule({"Relu"})], origin="plugin")

    plugins = [
        FakeEntryPoint("echo", EchoBackend),
        FakeEntryPoint("fn", register),
        FakeEntryPoint("broken", ImportError("No module named 'thirdparty_missing'")),
    ]
    seen_groups = []

    def fake_entry_points(*, group: str):
        seen_groups.append(group)
        return plugins

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    registry = BackendRegistry()
    assert registry.load_entry_points() == ["echo", "echo2"]
    assert seen_groups == ["tessera.backends"]
    assert registry.backend("echo").capability().op_types == {"Relu"}
    report = {row["name"]: row for row in registry.report()}
    assert report["echo"]["available"] and report["echo"]["origin"].startswith("entry point echo")
    assert report["echo2"]["rules"] == 1
    assert not report["broken"]["available"]
    assert "thirdparty_missing" in report["broken"]["reason"]


def test_yaml_patterns(tmp_path: Path, resnext) -> None:
    registry = builtin_registry()
    assert registry.load_yaml_dir() >= 2  # configs/backends/*.yaml
    names = [p.name for p in registry.entry("cudnn").patterns]
    assert "conv_bn_relu" in names
    stem = registry.entry("cudnn").patterns[names.index("conv_bn_relu")].pattern
    assert stem.match(resnext, "stem/relu") == {"stem/conv", "stem/bn", "stem/relu"}

    spec = tmp_path / "mine.yaml"
    spec.write_text(
        "backend: later\npatterns:\n  act:\n    any_of: [Relu, {op: Sigmoid, dtype: float32}]\n"
        "  gemm:\n    op: [MatMul, Gemm]\n    args: ['*', const]\n    shape: [1, null]\n"
    )
    assert registry.load_yaml(spec) == 2
    registry.register_backend("later", EchoBackend)  # patterns wait for their backend
    assert [p.name for p in registry.entry("later").patterns] == ["act", "gemm"]
    gemm = registry.entry("later").patterns[1].pattern
    assert gemm.match(resnext, "head/fc/gemm") == {"head/fc/gemm"}

    bad = tmp_path / "bad.yaml"
    bad.write_text("backend: x\npatterns:\n  p: {op: Relu, colour: red}\n")
    with pytest.raises(InputError, match="unknown field"):
        registry.load_yaml(bad)
    with pytest.raises(InputError, match="shape"):
        pattern_from_yaml({"op": "Relu", "shape": "1x2"})
    dup = tmp_path / "dup.yaml"
    dup.write_text("backend: x\nbackend: y\n")
    with pytest.raises(InputError, match="duplicate"):
        registry.load_yaml(dup)


def test_candidates_on_a_zoo_model(resnext) -> None:
    registry = builtin_registry()
    registry.load_yaml_dir()
    cands = registry.candidates(resnext, ["onnxruntime"])
    assert {c.backend for c in cands} == {"onnxruntime"}
    nodes = {c.nodes for c in cands}
    assert frozenset({"stem/conv", "stem/bn", "stem/relu"}) in nodes
    assert all(frozenset({n}) in nodes for n in resnext.order)  # every operator alone


def test_cli_lists_backends() -> None:
    result = run_cli("backends", "--json")
    assert result.code == 0, result.err
    rows = {row["name"]: row for row in json.loads(result.out)["backends"]}
    for name in ("onnxruntime", "openvino", "tvm"):
        assert rows[name]["available"], rows[name]
        assert rows[name]["version"] and rows[name]["device"]
        assert rows[name]["rules"] >= 1
    assert rows["onnxruntime"]["capability"]["op_types"] > 100
    assert rows["cudnn"]["patterns"] >= 3
    if not rows["tensorrt"]["available"]:
        assert (
            "tensorrt not installed" in rows["tensorrt"]["reason"]
            or "no NVIDIA GPU" in rows["tensorrt"]["reason"]
        )
    if not rows["cudnn"]["available"]:
        assert (
            "onnxruntime-gpu not installed" in rows["cudnn"]["reason"]
            or "no NVIDIA GPU" in rows["cudnn"]["reason"]
        )
    human = run_cli("backends")
    assert human.code == 0 and "onnxruntime" in human.out


def test_cpu_machine_reasons() -> None:
    from tessera.backends.base import nvidia_gpus

    registry = builtin_registry()
    if nvidia_gpus():
        pytest.skip("this machine has an NVIDIA GPU")
    for name in ("cudnn", "tensorrt"):
        ok, reason = registry.backend(name).available()
        assert not ok and "no NVIDIA GPU" in reason
    assert np.isfinite(1.0)
