"""A rank is pinned to cores of its own where its node's ranks fit them, and knows it (its
all-reduces then poll rather than sleep: stage_worker._Bucket)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import os, sys
from tessera.executor.launcher import own_cores, pin_cores
local_rank, local_ranks, threads = map(int, sys.argv[1:])
mine = pin_cores(local_rank, local_ranks, threads)
print(mine, own_cores(), sorted(os.sched_getaffinity(0)))
"""


def _probe(local_rank: int, local_ranks: int, threads: int) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(local_rank), str(local_ranks), str(threads)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout.strip()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_ranks_that_fit_the_cores_are_pinned_and_know_it_and_others_are_left_alone() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    assert _probe(1, 2, 1) == f"[{cores[1]}] True [{cores[1]}]"
    # More ranks than cores: left to the scheduler, and they do not poll.
    assert _probe(0, 2 * len(cores), 1) == f"None False {cores}"
    # One rank on the node: nothing to share.
    assert _probe(0, 1, 1) == f"None False {cores}"
