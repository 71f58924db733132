"""Options shared by every command (defined once, Polygraphy-style argument groups)."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from tessera.api.models import load_model
from tessera.api.models import load_plan_model as _load_plan_model
from tessera.core.errors import InputError
from tessera.core.files import check_writable
from tessera.core.graph import Graph

F = Callable[..., Any]


def load_plan_model(plan: Any, plan_path: str, given: str | None) -> Graph:
    """:func:`tessera.api.models.load_plan_model`, its warnings on stderr."""
    return _load_plan_model(plan, plan_path, given, warn=warn_line)


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


def load_model_option(model: str, input_shapes: tuple[str, ...], rewrites: Sequence[str] = ()) -> Graph:
    """Load MODEL as every command does; operators whose shapes stay unknown are named on stderr
    (their FLOPs count 0: never silently)."""
    return load_model(model, input_shapes, rewrites, warn=warn_line)


def warn_line(message: str) -> None:
    """A warning, as every command writes one: a line on stderr."""
    click.echo(f"tessera: warning: {message}", err=True)


def plan_model_option(f: F) -> F:
    """``--model FILE``: the model a plan is for, when not at the path the plan records."""
    return click.option(
        "--model",
        type=click.Path(dir_okay=False, path_type=str),
        help="The model (default: the path in the plan, relative to the working directory or the plan).",
    )(f)


class FiniteFloat(click.ParamType):
    """Every float option's type: a finite number above ``minimum`` (0 by default, excluded unless
    ``minimum`` is given) and at most ``maximum``. ``nan``, ``inf`` and out-of-range values are
    refused when the command line is parsed (exit code 2), before any work; click's FloatRange lets
    NaN through (every comparison with it is false)."""

    name = "float"

    def __init__(self, *, minimum: float | None = None, maximum: float | None = None) -> None:
        self.minimum, self.maximum = minimum, maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = click.FLOAT.convert(value, param, ctx)
        low = number > 0 if self.minimum is None else number >= self.minimum
        if math.isfinite(number) and low and (self.maximum is None or number <= self.maximum):
            return number
        least = "greater than 0" if self.minimum is None else f"{self.minimum:g} or more"
        bound = "" if self.maximum is None else f" and at most {self.maximum:g}"
        self.fail(f"{value!r}: expected a finite number {least}{bound}", param, ctx)


def json_option(f: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout (logs go to stderr)."
    )(f)


class OutputFile(click.Path):
    """A file a command writes: checked writable when the command line is parsed, so that a
    wrong ``-o`` fails at once (exit code 2) rather than after a long search loses its result."""

    name = "file"

    def __init__(self) -> None:
        super().__init__(dir_okay=False, path_type=str)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and (not value or value.endswith(("/", os.sep))):
            self.fail(f"{value!r} names no file", param, ctx)
        path = super().convert(value, param, ctx)
        try:
            check_writable(path)
        except InputError as exc:
            self.fail(f"{click.format_filename(path)}: {exc.message}", param, ctx)
        return path


class FigureFile(OutputFile):
    """A picture a command draws (``--gantt``, ``--plot``): the suffix picks matplotlib's format
    (SVG without one), checked with the path, before any work."""

    FORMATS = ("svg", "png", "pdf", "ps", "eps")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        path = super().convert(value, param, ctx)
        suffix = Path(path).suffix.lstrip(".").lower()
        if suffix and suffix not in self.FORMATS:
            self.fail(
                f"{click.format_filename(path)}: not a picture format ({', '.join(self.FORMATS)})", param, ctx
            )
        return path


def check_outputs(outputs: dict[str, str | None], inputs: dict[str, str | None]) -> None:
    """Outputs that would destroy an input (``-o model.onnx``) or each other (``-o x --gantt x``):
    a usage error before any work. Keys are how the message names each file."""
    named = [(name, path) for name, path in outputs.items() if path is not None]
    for i, (name, path) in enumerate(named):
        others = [*named[:i], *((k, v) for k, v in inputs.items() if v is not None)]
        for other, other_path in others:
            if _same_file(path, other_path):
                raise click.UsageError(f"{name} {path} is also the {other}: one would replace the other")


def _same_file(a: str, b: str) -> bool:
    if os.path.exists(a) and not os.path.isfile(a):
        return False  # a device or a pipe (-o /dev/null --gantt /dev/null) is written into, not replaced
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): the same only if the paths are
        return os.path.abspath(a) == os.path.abspath(b)


def output_option(f: F, help: str = "Write the result to this file (atomically).") -> F:
    return click.option("-o", "--output", type=OutputFile(), default=None, help=help)(f)


class OptionGroup:
    """Options defined once and used by the commands (or plan kinds) that list the group: applied as
    a decorator, in order; :attr:`names` are the parameters it adds (a kind reads only its own)."""

    def __init__(self, *options: Callable[[F], F]) -> None:
        self.options = options

    def __call__(self, f: F) -> F:
        for option in reversed(self.options):
            f = option(f)
        return f

    @functools.cached_property
    def names(self) -> frozenset[str]:
        def probe() -> None: ...

        self(probe)
        return frozenset(p.name for p in probe.__click_params__ if p.name)  # type: ignore[attr-defined]
