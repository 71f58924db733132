"""A named pipe or a device where a command reads a file is refused at once (exit 2, one line naming
it): opening a FIFO for reading blocks until a writer comes, and ``/dev/zero`` never ends. Every
user file goes through one reader (:mod:`tessera.core.user_files`)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from cli_runner import Result, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


# -- generated: special files and bombs in every reader slot ------------------------------------

FAST_S = 20.0


def _npz(path: Path, members: dict[str, bytes], compress: bool = False) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def _npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    import io

    import numpy as np

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _make(kind: str, path: Path, size: int) -> None:
    """A hostile file of ``kind`` at ``path`` (``size`` scales the ones with a size)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "link to a fifo":
        os.mkfifo(path.with_name(path.name + ".target"))
        path.symlink_to(path.with_name(path.name + ".target"))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "header declaring 10^11 floats":
        _npz(path, {"x.npy": _npy_header("<f4", (10**11,)) + bytes(size)})
    elif kind == "member inflating to 400 MB":
        import zipfile

        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            with archive.open("x.npy", "w", force_zip64=True) as member:
                member.write(_npy_header("<f4", (100_000_000,)))
                for _ in range(40):
                    member.write(bytes(10_000_000))
    elif kind == "bad npy header":
        _npz(path, {"x.npy": b"\x93NUMPY\x01\x00\x10\x00{'descr': 'zz'}\n" + bytes(size)})
    elif kind == "unterminated npy header":
        header = b"{'descr': '<f4', 'shape': (3,"
        _npz(path, {"x.npy": b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + bytes(size)})
    elif kind == "binary noise":
        path.write_bytes(os.urandom(size + 1))


KINDS = ["fifo", "directory", "link to /dev/zero", "link to a fifo", "empty", "header declaring 10^11 floats",
         "member inflating to 400 MB", "bad npy header", "unterminated npy header", "binary noise"]  # fmt: skip


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(slot=st.sampled_from(sorted(READS)), kind=st.sampled_from(KINDS), size=st.integers(0, 4096))
def test_generated_hostile_files_are_refused_in_one_line(
    tmp_path_factory, slot: str, kind: str, size: int
) -> None:
    """Whatever a reader slot gets (a special file, a link to one, an archive bomb, noise), the
    command exits 2 within 20 s with one line naming the file, no traceback, and writes nothing."""
    import time

    folder = tmp_path_factory.mktemp("gen")
    template, _ = READS[slot]
    target = folder / ("input.npz" if "{f}.npz" in template else "input")
    _make(kind, target, size)
    given_path = str(target)[: -len(".npz")] if "{f}.npz" in template else str(target)
    args = [a.replace("{f}", given_path) for a in template]
    before = set(folder.iterdir())
    start = time.perf_counter()
    result = _run_bounded(args, seconds=int(FAST_S) + 10)
    took = time.perf_counter() - start
    lines = result.err.strip().splitlines()
    assert result.code == 2, (slot, kind, result.code, result.err)
    assert len(lines) == 1 and "Traceback" not in result.err, (slot, kind, result.err)
    assert str(target) in lines[0] or given_path in lines[0], (slot, kind, lines[0])
    assert took < FAST_S, (slot, kind, took)
    assert set(folder.iterdir()) == before
