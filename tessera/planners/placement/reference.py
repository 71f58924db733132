"""The fp32 onnxruntime reference every placement is checked against: the calibration inputs (seeded,
or a data file's), the reference outputs, the values of every tensor for backends that quantize, and
the checks of a placement's groups and outputs against them (exact, or within ``--tolerance``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessera.backends.composite import (
    CompileCache,
    CompositeModel,
    compare_outputs,
    load_feeds,
    output_error,
    random_feeds,
    reference_outputs,
    within_tolerance,
)
from tessera.backends.onnxruntime_int8 import TensorValues
from tessera.backends.registry import BackendRegistry
from tessera.core.errors import InputError
from tessera.core.external_data import unread_weights
from tessera.core.graph import Graph
from tessera.planners.placement.evolution import Group


def reference_run(
    graph: Graph, seed: int, data: str | None = None, *, timeout_s: float | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inputs (seeded, or ``data``'s arrays) and onnxruntime's outputs of the whole model, which every
    placement is checked against. A model that cannot give them (no operators, lazy placeholder
    weights, a model onnxruntime cannot load or run) or a data file that does not fit the model is
    refused here, before any measuring, as an :class:`InputError`."""
    from tessera.core.weights import is_lazy

    if not graph.order:
        raise InputError("the model has no operators: nothing to place", source=graph.source)
    if is_lazy(graph.model):
        raise InputError(
            "the model's weights are lazy placeholders (a paper-size zoo build): materialize them first "
            "(tessera.models.materialize)",
            source=graph.source,
        )
    if (why := unread_weights(graph.model)) is not None:
        raise InputError(f"{why}: place runs the model, so it needs them", source=graph.source)
    feeds = load_feeds(graph, data) if data is not None else random_feeds(graph, seed)
    try:
        return feeds, reference_outputs(graph, feeds, timeout_s=timeout_s)
    except TimeoutError:
        raise InputError(
            f"onnxruntime's reference run of the whole model did not end within {timeout_s:g} s (a Loop "
            "with a huge trip count?); give place --timeout more seconds if it is meant to run that long",
            source=graph.source,
        ) from None
    except Exception as exc:  # noqa: BLE001 - ORT's and numpy's many refusals of a model
        why = " ".join(str(exc).split())
        why = why if len(why) <= 300 else why[:300] + "…"
        raise InputError(
            f"unsupported model: onnxruntime, the reference every placement is checked against, cannot "
            f"run it ({type(exc).__name__}: {why})",
            source=graph.source,
        ) from None


def inputs_label(data: str | None, seed: int) -> str:
    """What the outputs were checked on, for the plan: ``random (seed 0)`` or the data file's name and
    the start of its sha256 (not its path: plans stay byte-identical wherever the file lies)."""
    if data is None:
        return f"random (seed {seed})"
    import hashlib
    from pathlib import Path

    with open(data, "rb") as stream:  # read by load_feeds already: a regular file
        digest = hashlib.file_digest(stream, "sha256").hexdigest()[:16]
    return f"{Path(data).name} (sha256 {digest})"


def fp32_comparison(exact: dict[str, float], latency: float, tolerance: float | None) -> dict[str, Any]:
    """Under a tolerance: the fastest fp32 single backend and the speed-up over it."""
    if tolerance is None or not exact:
        return {}
    best = min(exact, key=lambda b: (exact[b], b))
    return {"best_fp32_single_backend": best, "speedup_over_best_fp32": exact[best] / latency}


def error_of(outputs: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """``{max_abs, max_rel}`` of the placed model's outputs against the fp32 onnxruntime reference
    (:func:`~tessera.backends.composite.output_error`)."""
    return output_error(outputs, reference)


def within(got: dict[str, Any], want: dict[str, Any], backend: Any, tolerance: float | None) -> bool:
    """Whether ``backend``'s outputs ``got`` are onnxruntime's ``want``: to fp32 precision, or for a
    reduced-precision backend within ``tolerance`` (:func:`relative_error`)."""
    if backend.exact or tolerance is None:
        return bool(compare_outputs(got, want)["ok"])
    return within_tolerance(got, want, tolerance)


def wrong_groups(
    graph: Graph,
    groups: Sequence[Group],
    feeds: dict[str, Any],
    registry: BackendRegistry,
    compiled: CompileCache,
    *,
    tolerance: float | None = None,
) -> list[tuple[str, frozenset[str]]]:
    """Groups (not on onnxruntime) whose outputs differ from onnxruntime's on the same group inputs,
    running the placement once on ``feeds`` (a reduced-precision backend's: by more than
    ``tolerance``, relative)."""
    model = CompositeModel(graph, [(b, n) for b, n, _ in groups], registry=registry, cache=compiled)
    env: dict[str, Any] = dict(feeds)
    wrong = []
    for step in model.steps:
        ins = {t: env[t] for t in step.inputs}
        out = step.runnable.run(ins)
        if step.backend != "onnxruntime":
            key = ("onnxruntime", step.nodes)
            if key not in compiled:
                compiled[key] = registry.backend("onnxruntime").compile(graph.extract(step.nodes))
            want = compiled[key].run(ins)
            if not within({t: out[t] for t in step.outputs}, want, registry.backend(step.backend), tolerance):
                wrong.append((step.backend, step.nodes))
        env.update({t: out[t] for t in step.outputs})
    return wrong


def calibrate(
    registry: BackendRegistry, backends: Sequence[str], graph: Graph, feeds: dict[str, Any]
) -> None:
    """Give each backend the values ``graph``'s tensors take on ``feeds`` (computed on a quantizing
    backend's first request): ``onnxruntime-int8`` quantizes its groups on them."""
    values = TensorValues(graph, feeds)
    for b in backends:
        registry.backend(b).calibrate(values)
