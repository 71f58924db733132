"""Options shared by every command (defined once, Polygraphy-style argument groups)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from tessera.core.errors import InputError
from tessera.core.graph import Graph, load_graph
from tessera.core.onnx_io import parse_input_shapes

F = Callable[..., Any]


def model_options(f: F) -> F:
    """``MODEL`` plus ``--input-shape NAME=DxD…`` (repeatable), loaded into ``graph``."""

    @click.argument("model", type=click.Path(dir_okay=False, path_type=str))
    @click.option(
        "--input-shape",
        "input_shapes",
        multiple=True,
        metavar="NAME=DxD…",
        help="Concrete shape for an input with symbolic dims (repeatable); other symbolic dims are 1.",
    )
    @functools.wraps(f)
    def wrapper(*args: Any, model: str, input_shapes: tuple[str, ...], **kwargs: Any) -> Any:
        graph = load_model_option(model, input_shapes)
        return f(*args, graph=graph, **kwargs)

    return wrapper


def load_model_option(model: str, input_shapes: tuple[str, ...]) -> Graph:
    return load_graph(model, input_shapes=parse_input_shapes(input_shapes))


def plan_model_option(f: F) -> F:
    """``--model FILE``: the model a plan is for, when not at the path the plan records."""
    return click.option(
        "--model",
        type=click.Path(dir_okay=False, path_type=str),
        help="The model (default: the path in the plan, relative to the working directory or the plan).",
    )(f)


def plan_model_path(plan_path: str, recorded: str, given: str | None) -> str:
    """--model, else the plan's recorded model path (relative to the working directory or the plan)."""
    candidates = [Path(given)] if given else [Path(recorded), Path(plan_path).parent / recorded]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise InputError(
        f"the model {str(candidates[0])!r} the plan names does not exist (give --model)", source=plan_path
    )


def json_option(f: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout (logs go to stderr)."
    )(f)


def output_option(f: F, help: str = "Write the result to this file (atomically).") -> F:
    return click.option(
        "-o", "--output", type=click.Path(dir_okay=False, path_type=str), default=None, help=help
    )(f)
