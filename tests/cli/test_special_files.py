"""A named pipe or a device where a command reads a file is refused at once (exit 2, one line naming
it): opening a FIFO for reading blocks until a writer comes, and ``/dev/zero`` never ends. Every
user file goes through one reader (:mod:`tessera.core.user_files`)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from cli_runner import Result, run_cli

BAD = Path(__file__).parents[1] / "data" / "bad"
MODEL = str(BAD / "plan_model.onnx")
PLAN = str(BAD / "plan_ok.json")
CP = ["plan", "--kind", "cp", "--llm", "gpt2", "--cluster", "a5000-4x", "--batch", "4", "--context", "1K"]

# (command line with {f} where the special file goes, what the message calls the file)
READS = {
    "inspect MODEL": (["inspect", "{f}"], "ONNX model"),
    "validate PLAN": (["validate", "{f}"], "plan"),
    "launch PLAN": (["launch", "{f}"], "plan"),
    "plan --cluster": (["plan", MODEL, "--cluster", "{f}", "--mini-batch", "8"], "cluster spec YAML"),
    "plan --llm": (
        ["plan", "--kind", "cp", "--llm", "{f}", "--cluster", "a5000-4x", "--batch", "4", "--context", "1K"],
        "LLM config YAML",
    ),  # fmt: skip
    "plan --output-len file:": ([*CP, "--output-len", "file:{f}"], "--output-len lengths"),
    "place --data": (["place", MODEL, "--backends", "onnxruntime", "--data", "{f}"], "inputs"),
    "launch --data": (["launch", PLAN, "--data", "{f}.npz"], "data"),
}


def _run_bounded(args: list[str], seconds: int = 30) -> Result:
    """``run_cli`` in this (the main) thread, interrupted by SIGALRM if it blocks: a blocked
    ``open`` of a FIFO returns EINTR and the handler's exception ends it."""

    def blocked(signum: int, frame: object) -> None:
        raise TimeoutError(f"tessera {' '.join(args)} blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(seconds)
    try:
        return run_cli(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("case", sorted(READS))
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_special_files_are_refused_before_they_are_read(tmp_path: Path, case: str, kind: str) -> None:
    template, what = READS[case]
    if kind == "fifo":
        special = str(tmp_path / "special")
        os.mkfifo(special + (".npz" if "{f}.npz" in template else ""))
        shown, kind_text = special, "a named pipe (FIFO)"
    else:
        if "{f}.npz" in template:
            pytest.skip("/dev/zero has no .npz suffix to pick the reader by")
        special, shown, kind_text = "/dev/zero", "/dev/zero", "a character device"
    args = [a.replace("{f}", special) for a in template]
    result = _run_bounded(args)
    assert result.code == 2, (result.code, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.err, result.err
    assert (
        shown in lines[0]
        and f"expected {'an' if what[0] in 'aeiouAEIOU' else 'a'} {what} file; this is {kind_text}"
        in lines[0]
    ), lines[0]
