"""Backends' native stderr (TVM's C++ warnings, OpenVINO's) is caught per backend while they build
and run, told once per backend, each line kept for ``-v``; the process's stderr is whole again after."""

from __future__ import annotations

import logging
import os

from tessera.backends.native_output import caught, summary


def test_native_lines_are_caught_counted_and_told_once(capfd, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tessera.backends.native_output")
    summary()  # nothing left over from another test
    for _ in range(3):
        with caught("tvm"):
            os.write(2, b"[09:00:24] /tvm/topi/transform.h:1261: Warning: Fast mode segfaults\n")
            os.write(2, b"\x1b[2K progress bar frame\n")  # a terminal's, not the backend's
    with caught("openvino"):
        os.write(2, b"first\nsecond\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"  # nothing caught leaked; stderr is back
    assert summary() == [
        "openvino printed 2 line(s), 2 different (-v shows each); most often (1×): first",
        "tvm printed 3 line(s) (-v shows each); most often (3×): /tvm/topi/transform.h:1261: Warning: Fast "
        "mode segfaults",
    ]
    assert summary() == []  # told once
    assert caplog.text.count("tvm: /tvm/topi/transform.h:1261") == 3


def test_an_error_inside_still_restores_stderr(capfd) -> None:
    try:
        with caught("tvm"):
            os.write(2, b"about to fail\n")
            raise RuntimeError("build failed")
    except RuntimeError:
        pass
    os.write(2, b"visible\n")
    assert capfd.readouterr().err == "visible\n"
    assert summary() == ["tvm printed 1 line(s) (-v shows each); most often (1×): about to fail"]
