"""Run a placement plan: build its composite model, check it against onnxruntime, time it.

:func:`run_placement_plan` runs in this process (no workers): it builds the plan's groups on their
backends, checks the outputs against onnxruntime on the same inputs and times the placed model,
reporting the measured latency against the plan's prediction (:class:`PlacementRun`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tessera.core.errors import LaunchError
from tessera.core.graph import Graph
from tessera.core.plans import PlacementPlan
from tessera.executor.report import RunReport, ratios


@dataclass(kw_only=True)
class PlacementRun(RunReport):
    """What ``tessera launch`` reports for a placement plan (``to_json`` is the ``--json`` output)."""

    kind: str = "placement"
    groups: int
    backends: list[str]
    build_s: float
    planned_measurement: dict[str, Any]
    verify: dict[str, Any]
    data: str
    output_error: dict[str, float]  # composite.output_error: the measure place recorded

    @property
    def failure(self) -> str | None:
        if self.verify["ok"]:
            return None
        return f"the placed model's outputs differ from onnxruntime's: {worst_output(self.verify)}"

    @property
    def error(self) -> dict[str, float]:
        """The placed model's outputs against onnxruntime's fp32 reference on the same inputs, measured
        as ``place`` measures them (``composite.output_error``: NaN is infinitely wrong)."""
        return self.output_error

    def details(self) -> dict[str, Any]:
        return {
            "error": self.error,
            "groups": self.groups,
            "backends": self.backends,
            "build_s": self.build_s,
            "planned_measurement": self.planned_measurement,
            "verify": self.verify,
            "data": self.data,
        }


def worst_output(report: dict[str, Any]) -> str:
    """One line on the output that differs most from onnxruntime's (``compare_outputs``' report;
    ``verify_outputs``' under a tolerance: the relative error and the tolerance)."""
    if report.get("tolerance") is not None:
        return f"relative error {report['relative_error']:.3g}, --tolerance {report['tolerance']:g}"
    bad = [(k, v) for k, v in report["outputs"].items() if not v.get("ok")]
    name, row = bad[0] if bad else next(iter(report["outputs"].items()))
    return (
        f"output {name!r} max abs diff {row.get('max_abs_diff', float('nan')):.3g} "
        f"(rtol {report['rtol']}, atol {report['atol']})"
    )


def run_placement_plan(
    plan: PlacementPlan,
    graph: Graph,
    *,
    plan_path: str = "<plan>",
    repeat: int = 7,
    data: str | None = None,
    seed: int = 0,
) -> PlacementRun:
    """Build ``plan``'s composite model of ``graph`` (checked against the plan by the caller), check
    its outputs against onnxruntime on ``data`` (an ``.npz``) or seeded random inputs, and time it
    (the median of ``repeat`` interleaved rounds). Raises LaunchError when the model fails to run;
    outputs that differ are the report's :attr:`~PlacementRun.failure`."""
    from tessera.backends.composite import (
        CompositeModel,
        latencies,
        load_feeds,
        output_error,
        random_feeds,
        reference_outputs,
        verify_outputs,
    )
    from tessera.backends.registry import default_registry
    from tessera.planners.placement.reference import calibrate

    feeds = load_feeds(graph, data) if data else random_feeds(graph, seed)
    start = time.perf_counter()
    # int8 groups are quantized on the inputs they are checked on (the plan's, given the same data)
    backends = sorted({g.backend for g in plan.groups})
    calibrate(default_registry(), backends, graph, feeds)
    model = CompositeModel(graph, [(g.backend, g.nodes) for g in plan.groups], concurrent=plan.concurrent)
    build_s = time.perf_counter() - start
    try:
        outputs = model.run(feeds)
    except Exception as exc:  # noqa: BLE001 - a runtime failing mid-run
        raise LaunchError(f"the placed model failed to run: {type(exc).__name__}: {exc}") from exc
    reference = reference_outputs(graph, feeds)
    verified = verify_outputs(outputs, reference, plan.measured.get("tolerance"))
    latency = latencies({"placement": lambda: model.run(feeds)}, rounds=repeat)["placement"]
    measured = {"latency_s": latency, "rounds": repeat}
    predicted = {"latency_s": plan.predicted.get("latency_s")}
    return PlacementRun(
        plan_path=plan_path,
        groups=len(plan.groups),
        backends=model.backends,
        build_s=build_s,
        measured=measured,
        predicted=predicted,
        planned_measurement={"latency_s": plan.measured.get("latency_s")},
        ratio=ratios(measured, predicted, {"latency": "latency_s"}),
        verify=verified,
        data=data or f"random (seed {seed})",
        output_error=output_error(outputs, reference),
    )


def verify_placement(graph: Graph, plan: PlacementPlan, seed: int, data: str | None) -> dict[str, Any]:
    """The placed model's outputs on ``data`` (or seeded random inputs) against onnxruntime's whole
    model, within the plan's tolerance (``place --verify``). LaunchError when it fails to run."""
    from tessera.backends.composite import (
        CompositeModel,
        load_feeds,
        random_feeds,
        reference_outputs,
        verify_outputs,
    )

    feeds = load_feeds(graph, data) if data is not None else random_feeds(graph, seed)
    model = CompositeModel(graph, [(g.backend, g.nodes) for g in plan.groups], concurrent=plan.concurrent)
    try:
        outputs = model.run(feeds)
    except Exception as exc:  # noqa: BLE001 - a runtime failing mid-run
        raise LaunchError(f"the placed model failed to run: {type(exc).__name__}: {exc}") from exc
    return verify_outputs(outputs, reference_outputs(graph, feeds), plan.measured.get("tolerance"))
