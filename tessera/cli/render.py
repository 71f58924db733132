"""Printing results: JSON for machines, rich tables for people (no colour when not a terminal)."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console


def emit_json(data: Any) -> None:
    """Write ``data`` to stdout as JSON and nothing else (deterministic key order as built)."""
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def console() -> Console:
    """A console on stdout; colour and markup only when stdout is a terminal and NO_COLOR is unset."""
    return Console(file=sys.stdout, highlight=False, soft_wrap=True)


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
