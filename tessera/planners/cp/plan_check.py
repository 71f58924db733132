"""Validity of a cp plan made from an ONNX model: its ``llm`` block is what the model computes.
Registered in :data:`tessera.core.plans.PLAN_CHECKS` for kind ``cp`` when imported, so ``tessera
validate`` and ``launch`` re-derive the decoder from the model instead of trusting the plan."""

from __future__ import annotations

from typing import Any

from tessera.core.errors import InputError
from tessera.core.external_data import unread_weights
from tessera.core.plans import DENSE_FFN, PLAN_CHECKS
from tessera.planners.cp.recognize import recognize_decoder

# The file's stem (a renamed copy is the same model) and the type plan --dtype serves it in.
_FREE = ("name", "dtype")


def check_cp_plan(plan: Any, graph: Any) -> list[str]:
    if plan.model is None:
        return []  # made from an LLM config: checked against that config (cli.options)
    if (why := unread_weights(graph.model)) is not None:
        return [f"launch cannot decode the model: {why}"]
    try:
        config = recognize_decoder(graph).config.to_json()
    except InputError as exc:
        return [f"launch cannot decode the model: {exc.message}"]
    return [
        f"llm.{key} is {plan.llm.get(key)!r} but the model has {value!r}"
        for key, value in config.items()
        if key not in _FREE and plan.llm.get(key, DENSE_FFN.get(key)) != value
    ]


if check_cp_plan not in PLAN_CHECKS.setdefault("cp", []):
    PLAN_CHECKS["cp"].append(check_cp_plan)
