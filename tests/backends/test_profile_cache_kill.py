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


FILLER = """
import resource, sys
from tessera.backends.profile_cache import Profile, ProfileCache
from tessera.core.errors import InputError
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes fail EFBIG
cache = ProfileCache(sys.argv[1])
try:
    cache.open()
except InputError as exc:
    print("refused:", exc.one_line())
    sys.exit(0)
for i in range(2000):
    cache.put(Profile("onnxruntime", "1", "cpu", f"graph{i:08d}" + "x" * 200, 1e-3, 1e-5, 10))
print("stored until:", cache.unwritable, cache.count() < 2000)
"""


def test_a_disk_that_refuses_writes_is_said_not_crashed(tmp_path: Path) -> None:
    """Under a file-size limit (as on a full disk) the cache raised sqlite's OperationalError
    (exit 1). A cache that cannot even be created is refused in one line, leaving no file; one
    that fills up mid-run stops storing, says so once, and the run goes on."""
    path = tmp_path / "profiles.sqlite"
    small = subprocess.run([sys.executable, "-c", FILLER, str(path), "8192"], capture_output=True, text=True)
    assert small.returncode == 0, small.stderr
    assert small.stdout.startswith(f"refused: {path}: cannot create the profile cache: disk I/O error")
    assert not list(tmp_path.iterdir())
    filled = subprocess.run(
        [sys.executable, "-c", FILLER, str(path), "60000"], capture_output=True, text=True
    )
    assert filled.returncode == 0, filled.stderr
    assert filled.stdout.strip() == "stored until: disk I/O error True"
    assert filled.stderr.count("cannot store measurements (disk I/O error); going on without storing") == 1
