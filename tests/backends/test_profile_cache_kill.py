"""The profile cache survives a writer killed in the middle of writing (issue: nothing lost)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tessera.backends.profile_cache import Profile, ProfileCache

WRITER = """
import sys
from tessera.backends.profile_cache import Profile, ProfileCache
cache = ProfileCache(sys.argv[1])
i = 0
while True:  # write until killed
    cache.put(Profile("onnxruntime", "1", "cpu", f"graph{i:08d}", 1e-3 + i * 1e-9, 1e-5, 10))
    if i == 50:
        print("writing", flush=True)
    i += 1
"""


def test_cache_survives_a_killed_writer(tmp_path: Path) -> None:
    path = tmp_path / "profiles.sqlite"
    cache = ProfileCache(path)
    cache.put(Profile("openvino", "1", "cpu", "kept", 2e-3, 1e-5, 10))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    time.sleep(0.2)  # the writer is in the middle of its stream of transactions
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)

    reopened = ProfileCache(path)
    kept = reopened.get("openvino", "1", "cpu", "kept")
    assert kept is not None and kept.median_s == 2e-3  # what was there before is intact
    written = reopened.count()
    assert written >= 51  # every committed write of the killed process is there
    # Rows are whole (no half-written row), and the cache still takes writes.
    for i in range(50):
        row = reopened.get("onnxruntime", "1", "cpu", f"graph{i:08d}")
        assert row is not None and row.runs == 10
    reopened.put(Profile("tvm", "1", "cpu", "after", 3e-3, 1e-5, 10))
    assert reopened.count() == written + 1
