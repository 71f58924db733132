"""Costs as the composite model runs them: ε measured through it, onnxruntime measured as composed."""

from __future__ import annotations

import math

from tessera.backends.composite import (
    ComposedOnnxRuntime,
    composite_variant,
    model_written_bytes,
    written_bytes,
)
from tessera.backends.registry import default_registry
from tessera.core.graph import load_graph
from tessera.models import build
from tessera.planners.placement.costs import measure_switch


def test_context_switch_is_measured_through_the_composite_model() -> None:
    registry = default_registry()
    for src, dst in (("onnxruntime", "openvino"), ("openvino", "onnxruntime")):
        eps = measure_switch(registry, src, dst, 1 << 16)
        assert math.isfinite(eps) and 0.0 <= eps < 0.05


def test_composed_onnxruntime_builds_what_the_composite_model_builds() -> None:
    graph = load_graph(build("resnext", "tiny"))
    nodes = graph.order[:4]
    assert model_written_bytes(graph.extract(nodes)) == written_bytes(graph, nodes)
    composed = ComposedOnnxRuntime(default_registry().backend("onnxruntime"))
    assert composed.name == "onnxruntime+composite"
    runnable = composed.compile(graph.extract(nodes))
    assert runnable.input_names and composite_variant(graph, "onnxruntime", nodes, mixed=True).startswith(
        "onnxruntime/no-spin"
    )
