"""Printing results: JSON for machines, rich tables for people (no colour when not a terminal)."""

from __future__ import annotations

import math
import os
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tessera.core.errors import terminal_safe
from tessera.core.plan_files import json_text

# Set by `tessera --no-progress` (and honoured by library code that shows progress).
NO_PROGRESS_ENV = "TESSERA_NO_PROGRESS"


def json_safe(data: Any) -> Any:
    """``data`` with every non-finite float (NaN, ±Infinity: not JSON) replaced by ``None`` (null)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: json_safe(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(value) for value in data]
    return data


def emit_json(data: Any) -> None:
    """Write ``data`` to stdout as JSON and nothing else (deterministic key order as built).

    Always valid JSON: a non-finite number (a diverged loss, a ratio over zero) is written as null.
    """
    sys.stdout.write(json_text(json_safe(data)))
    sys.stdout.flush()


# Columns of plain output (stdout not a terminal): wide enough that no table row is wrapped.
PLAIN_WIDTH = 1000


class _Console(Console):
    def render_str(self, text: str, **kwargs: Any) -> Any:
        """Every string rich shows (a line, a table cell) with its control characters escaped: a
        name read from a model (an input, a dim_param) cannot break a line or reach the terminal
        as an escape sequence. Lines tessera writes hold no control characters of their own."""
        return super().render_str(text if self._rendered else terminal_safe(text), **kwargs)

    _rendered = False  # set while a table rendered (and escaped) already is written out

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """Tables as plain text when stdout is not a terminal: columns separated by spaces, no box
        characters (a script reading ``tessera inspect m.onnx | grep`` sees words and numbers)."""
        if self.is_terminal or not any(isinstance(o, Table) for o in objects):
            super().print(*objects, **kwargs)
            return
        for table in objects:
            if isinstance(table, Table):
                table.box = None
                table.pad_edge = False
        with self.capture() as captured:
            super().print(*objects, **kwargs)
        # rich pads every cell to its column's width: no trailing blanks in plain text
        self._rendered = True
        try:
            self.out("\n".join(line.rstrip() for line in captured.get().splitlines()), highlight=False)
        finally:
            self._rendered = False

    def on_broken_pipe(self) -> None:
        """A reader that went away (``tessera inspect m.onnx | head -1``): rich exits 1 here; raise
        BrokenPipeError instead, which the entry point turns into exit 0 as for plain output."""
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        raise BrokenPipeError


def console() -> Console:
    """A console on stdout; colour and markup only when stdout is a terminal and NO_COLOR is unset,
    tables boxed only on a terminal (plain text otherwise, rows never wrapped)."""
    out = _Console(file=sys.stdout, highlight=False, soft_wrap=True)
    if not out.is_terminal:
        out.width = PLAIN_WIDTH
    return out


def human_count(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n:g} {unit}".rstrip()


def human_bytes(n: float) -> str:
    for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{int(n)} B"


def progress_enabled() -> bool:
    """Progress bars only on an interactive stderr, and never with --no-progress."""
    return sys.stderr.isatty() and not os.environ.get(NO_PROGRESS_ENV)


def progress_bar() -> Progress:
    """A rich progress bar on stderr; disabled (prints nothing) when progress is off."""
    return Progress(
        TextColumn("{task.description}", markup=False),  # descriptions carry user text
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
        disable=not progress_enabled(),
        transient=True,
    )
