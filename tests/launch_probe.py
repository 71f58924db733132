"""A rank entry point for launcher tests: what the rank sees of its process and environment."""

from __future__ import annotations

import os
from typing import Any


def probe(name: str) -> dict[str, Any]:
    return {
        "value": os.environ.get(name),
        "rank": int(os.environ["RANK"]),
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }
