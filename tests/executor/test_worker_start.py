"""Ranks are forked from one server per launching process, and each takes the launching process's
environment and working folder as they are at its launch, not as they were when the server started."""

from __future__ import annotations

import os
from pathlib import Path

from launch_probe import probe

from tessera.executor.launcher import LaunchOptions, launch_workers

NAME = "TESSERA_PROBE_VALUE"


def test_ranks_take_the_launching_processs_environment_and_folder_at_each_launch(monkeypatch, tmp_path: Path):
    monkeypatch.setenv(NAME, "first")
    first = launch_workers(probe, (NAME,), 2, LaunchOptions(timeout_s=60))
    assert sorted(first) == [0, 1] and [first[r]["rank"] for r in (0, 1)] == [0, 1]
    assert {r["value"] for r in first.values()} == {"first"}
    # forked from the server, not spawned by this process; the server stays for the next launch
    servers = {r["ppid"] for r in first.values()}
    assert len(servers) == 1 and os.getpid() not in servers

    monkeypatch.setenv(NAME, "second")
    monkeypatch.chdir(tmp_path)
    second = launch_workers(probe, (NAME,), 2, LaunchOptions(timeout_s=60))
    assert {r["value"] for r in second.values()} == {"second"}
    assert {r["cwd"] for r in second.values()} == {str(tmp_path)}
    assert {r["ppid"] for r in second.values()} == servers
    assert not {r["pid"] for r in second.values()} & {r["pid"] for r in first.values()}

    monkeypatch.delenv(NAME)  # gone here: gone in the ranks, though the server started with it
    third = launch_workers(probe, (NAME,), 2, LaunchOptions(timeout_s=60))
    assert {r["value"] for r in third.values()} == {None}
