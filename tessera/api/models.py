"""Loading what the API and the CLI take: a model, and the model and LLM config a plan names,
checked against the plan."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx

from tessera.core.errors import InputError
from tessera.core.graph import Graph, load_graph
from tessera.core.onnx_io import parse_input_shapes

__all__ = [
    "TesseraWarning",
    "check_plan_llm_config",
    "load_model",
    "load_plan_model",
    "plan_graph",
    "plan_model_path",
]

Shapes = Mapping[str, Sequence[int]] | Sequence[str] | None


class TesseraWarning(UserWarning):
    """Something a result depends on that the caller should know (operators of unknown shape)."""


def load_model(
    model: str | os.PathLike[str] | onnx.ModelProto,
    input_shapes: Shapes = None,
    rewrites: Sequence[str] = (),
    *,
    warn: Callable[[str], None] | None = None,
) -> Graph:
    """Load ``model`` as every command does: ``input_shapes`` as ``{name: dims}`` or ``NAME=DxD``
    strings; operators whose shapes stay unknown are reported through ``warn`` (default: a
    :class:`TesseraWarning`), since their FLOPs count 0."""
    if input_shapes is None or isinstance(input_shapes, Mapping):
        shapes = {k: [int(d) for d in v] for k, v in (input_shapes or {}).items()} or None
    else:
        shapes = parse_input_shapes(tuple(input_shapes))
    source = model if isinstance(model, onnx.ModelProto) else os.fspath(model)
    graph = load_graph(source, input_shapes=shapes, rewrites=rewrites)
    if (message := graph.unknown_shapes_message()) is not None:
        text = f"{graph.source}: {message}"
        if warn is not None:
            warn(text)
        else:
            warnings.warn(text, TesseraWarning, stacklevel=2)
    return graph


def plan_model_path(plan_path: str, recorded: str, given: str | None, sha256: str | None = None) -> str:
    """--model, else the plan's recorded model path (as it was given when planning), looked for
    beside the plan and in the working directory: of those that exist, the one whose sha256 is the
    plan's (beside the plan on a tie), so a same-named other model does not shadow it."""
    candidates = (
        [Path(given)] if given else list(dict.fromkeys([Path(plan_path).parent / recorded, Path(recorded)]))
    )
    present = [c for c in candidates if c.is_file()]
    if sha256 is not None and len(present) > 1:
        present.sort(key=lambda c: _file_sha256(c) != sha256)  # stable: the plan's folder first
    if present:
        return str(present[0])
    if given:
        raise InputError("no such model file (given as --model)", source=given)
    raise InputError(
        f"the model {recorded!r} the plan names does not exist beside the plan or in the working directory "
        "(give --model)",
        source=plan_path,
    )


def _file_sha256(path: Path) -> str:
    import hashlib

    with path.open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def load_plan_model(
    plan: Any, plan_path: str, given: str | None, *, warn: Callable[[str], None] | None = None
) -> Graph:
    """Load the model a plan names (with the input shapes it was planned at) and check the plan
    against it: sha256, node names, coverage and the planner's constraints. InputError otherwise."""
    from tessera.backends import plan_check  # noqa: F401 - registers the placement check
    from tessera.core.plan_checks import check_plan_against_model, problems_error
    from tessera.planners.cp import plan_check as _cp_check  # noqa: F401 - registers the llm-block check
    from tessera.planners.pipeline import checks  # noqa: F401 - registers C1–C5 + memory checks

    model_path = plan_model_path(plan_path, plan.model.path, given, plan.model.sha256)
    shapes = tuple(f"{k}={'x'.join(map(str, v))}" for k, v in plan.model.input_shapes.items())
    try:
        graph = load_model(model_path, shapes, plan.model.rewrites, warn=warn)
    except InputError as exc:
        if not shapes or "--input-shape" not in exc.message:
            raise
        # The shapes are the plan's, not an option the user gave.
        message = exc.message.replace("--input-shape", f"model.input_shapes (for {model_path})")
        raise InputError(message, source=plan_path) from None
    problems = check_plan_against_model(plan, graph)
    if problems:
        raise problems_error(problems, plan_path)
    return graph


def check_plan_llm_config(plan: Any, plan_path: str, *, must_exist: bool) -> None:
    """A cp plan made from ``--llm``: what it says must hold (:func:`cp_plan_problems`) and its
    config must be unchanged (sha256). When the file cannot be read, that is an error only if
    ``must_exist`` (the plan itself carries the config's shape)."""
    from tessera.core.plan_checks import cp_plan_problems, problems_error
    from tessera.planners.cp.llm import load_llm_config

    if problems := cp_plan_problems(plan):
        raise problems_error(problems, plan_path)
    ref = plan.llm_config
    try:
        config, source = load_llm_config(ref.path)
    except InputError as exc:
        if not must_exist:
            return
        raise InputError(
            f"the LLM config the plan names is unusable: {exc.one_line()}", source=plan_path
        ) from None
    if source.sha256 != ref.sha256:
        raise InputError(
            f"LLM config changed: the plan was made for sha256 {ref.sha256[:12]}…, {ref.path} is {source.sha256[:12]}…",
            source=plan_path,
        )
    # The workers build the model the plan's own llm block describes: it must be the config's
    # (the dtype may differ: plan --dtype serves the config in another type).
    for key, value in config.to_json().items():
        if key != "dtype" and plan.llm.get(key) != value:
            raise InputError(
                f"llm.{key} is {plan.llm.get(key)!r} but the LLM config {ref.path} gives {value!r}",
                source=plan_path,
            )


def plan_graph(
    plan: Any, plan_path: str, given: str | None, *, warn: Callable[[str], None] | None = None
) -> Graph | None:
    """The model a plan runs, loaded and checked against it (:func:`load_plan_model`); None for a cp
    plan made from an LLM config, whose config is checked when it can be read."""
    if plan.model is not None:
        return load_plan_model(plan, plan_path, given, warn=warn)
    if getattr(plan, "llm_config", None) is not None:
        check_plan_llm_config(plan, plan_path, must_exist=False)
    return None
