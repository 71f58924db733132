"""Options shared by every command (defined once, Polygraphy-style argument groups)."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from tessera.core.errors import InputError
from tessera.core.files import check_writable
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


def load_model_option(model: str, input_shapes: tuple[str, ...], rewrites: Sequence[str] = ()) -> Graph:
    """Load MODEL as every command does; operators whose shapes stay unknown are named on stderr
    (their FLOPs count 0: never silently)."""
    graph = load_graph(model, input_shapes=parse_input_shapes(input_shapes), rewrites=rewrites)
    if (message := graph.unknown_shapes_message()) is not None:
        click.echo(f"tessera: warning: {graph.source}: {message}", err=True)
    return graph


def plan_model_option(f: F) -> F:
    """``--model FILE``: the model a plan is for, when not at the path the plan records."""
    return click.option(
        "--model",
        type=click.Path(dir_okay=False, path_type=str),
        help="The model (default: the path in the plan, relative to the working directory or the plan).",
    )(f)


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


def load_plan_model(plan: Any, plan_path: str, given: str | None) -> Graph:
    """Load the model a plan names (with the input shapes it was planned at) and check the plan
    against it: sha256, node names, coverage and the planner's constraints. InputError otherwise."""
    from tessera.backends import plan_check  # noqa: F401 - registers the placement check
    from tessera.core.plans import check_plan_against_model, problems_error
    from tessera.planners.cp import plan_check as _cp_check  # noqa: F401 - registers the llm-block check
    from tessera.planners.pipeline import checks  # noqa: F401 - registers C1–C5 + memory checks

    model_path = plan_model_path(plan_path, plan.model.path, given, plan.model.sha256)
    shapes = tuple(f"{k}={'x'.join(map(str, v))}" for k, v in plan.model.input_shapes.items())
    try:
        graph = load_model_option(model_path, shapes, plan.model.rewrites)
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
    from tessera.core.plans import cp_plan_problems, problems_error
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
