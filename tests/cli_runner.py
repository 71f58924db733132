"""Run the tessera CLI in-process (fast) or as a real subprocess, capturing code, stdout and stderr."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass

from tessera.cli.main import main


@dataclass
class Result:
    code: int
    out: str
    err: str


def run_cli(*args: str) -> Result:
    """Call the console entry point with ``args`` in this process."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return Result(code, out.getvalue(), err.getvalue())


def run_tessera(*args: str, timeout: float = 120) -> Result:
    """Run ``python -m tessera`` as a subprocess (what a CI script sees)."""
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "tessera", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)
