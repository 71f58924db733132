"""The result objects of the API's functions that have none of their own in the layers below:
each ``to_json()`` is what the matching command prints with ``--json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera.core.errors import InputError
from tessera.core.graph import Graph
from tessera.core.plans import PlacementPlan, Plan, dump_plan
from tessera.core.structure import branch_structure
from tessera.core.traced import traced_values_message
from tessera.planners.cp.recognize import recognize_decoder

__all__ = ["Inspection", "Placement", "Validation", "inspect_report"]


@dataclass(frozen=True)
class Inspection:
    """What a model is made of (``tessera inspect``): ``report`` is the ``--json`` document."""

    graph: Graph
    report: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return self.report


@dataclass(frozen=True)
class Placement:
    """A placement (``tessera place``): the plan, the search's report and, with ``verify``, the
    placed model's outputs against onnxruntime's."""

    plan: PlacementPlan
    search_s: float
    report: dict[str, Any]
    verified: dict[str, Any] | None = None

    def to_json(self, output: str | None = None) -> dict[str, Any]:
        import json

        return {
            "plan": json.loads(dump_plan(self.plan)),
            "search_s": self.search_s,
            "timings": self.report["timings"],
            "measured_candidates": self.report["measured_candidates"],
            "final_timings_cached": self.report["final_timings_cached"],
            "verify": self.verified,
            "output": output,
        }


@dataclass(frozen=True)
class Validation:
    """A plan checked against its schema and the model or LLM config it names (``tessera
    validate``); an invalid plan raises instead."""

    plan: Plan
    plan_path: str
    model: str | None = None
    sha256: str | None = None
    llm_config: str | None = None
    shared_weights: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"valid": True, "plan": self.plan_path, "kind": self.plan.kind}
        if self.llm_config is not None:
            return {**out, "llm_config": self.llm_config}
        out.update(model=self.model, sha256=self.sha256)
        if self.shared_weights:
            out["shared_weights"] = self.shared_weights
        return out


def inspect_report(graph: Graph) -> dict[str, Any]:
    """The inspect summary as plain data (the ``--json`` document)."""
    structure = branch_structure(graph)
    model = graph.model
    return {
        "model": {
            "path": graph.source,
            "sha256": graph.sha256,
            "ir_version": model.ir_version,
            "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "producer": f"{model.producer_name} {model.producer_version}".strip(),
        },
        "nodes": graph.num_nodes,
        "op_types": graph.op_histogram(),
        "parameters": {"count": graph.num_params, "bytes": graph.param_bytes},
        "flops": graph.total_flops,
        "bytes_moved": sum(op.bytes_moved for op in graph.ops()),
        "inputs": [t.to_json() for t in graph.inputs.values()],
        "outputs": [t.to_json() for t in graph.outputs.values()],
        "defaulted_dims": graph.defaulted_dims,
        "unknown_shapes": list(graph.unknown_shapes),  # operators counted as 0 FLOPs
        "traced_for_example": traced_values_message(graph),  # why plan, place and launch refuse it
        "branches": structure.to_json(),
        "decoder": _decoder(graph),
    }


def _decoder(graph: Graph) -> dict[str, Any] | None:
    """The decoder-only transformer ``plan --kind cp`` sees in ``graph`` (``recognized``: false and
    ``why`` when it has attention that is not one); None for a model without a Softmax or an
    Attention operator."""
    if not any(op.op_type in ("Softmax", "Attention") for op in graph.ops()):
        return None
    try:
        return {"recognized": True, **recognize_decoder(graph).to_json()}
    except InputError as err:
        return {"recognized": False, "why": err.message}
