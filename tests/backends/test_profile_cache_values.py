"""A cache the user made read-only is used read-only (never moved aside, nothing stored, said once);
rows holding values no measurement has are read as misses and measured again."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from tessera.backends.profile_cache import Profile, ProfileCache
from tessera.core.errors import InputError

KEY = ("onnxruntime", "1.0", "cpu", "subgraph-hash")


def _cache_with_one_profile(path: Path) -> None:
    cache = ProfileCache(path)
    cache.put(Profile(*KEY, 2e-3, 1e-5, 7))
    cache.put_switch("onnxruntime", "openvino", "v", "cpu", 1024, 3e-5)
    cache.close()


@pytest.mark.parametrize("where", ["file", "folder"])
def test_a_read_only_cache_is_read_and_never_moved_aside(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "cache"
    folder.mkdir()
    path = folder / "profiles.sqlite"
    _cache_with_one_profile(path)
    before = sorted(p.name for p in folder.iterdir())
    (path if where == "file" else folder).chmod(0o444 if where == "file" else 0o555)
    try:
        cache = ProfileCache(path)
        with caplog.at_level(logging.WARNING, logger="tessera.backends.profile_cache"):
            hit = cache.get(*KEY)
            assert hit is not None and hit.median_s == pytest.approx(2e-3) and hit.runs == 7
            assert cache.get_switch("onnxruntime", "openvino", "v", "cpu", 1024) == pytest.approx(3e-5)
            assert cache.get("onnxruntime", "1.0", "cpu", "other") is None
            cache.put(Profile("onnxruntime", "1.0", "cpu", "other", 1e-3, 0.0, 3))  # measured, not stored
            cache.put(Profile("onnxruntime", "1.0", "cpu", "third", 1e-3, 0.0, 3))
        cache.close()
    finally:
        folder.chmod(0o755)
        path.chmod(0o644)
    assert cache.read_only
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing moved, nothing added
    assert not any("corrupt" in p.name for p in folder.iterdir())
    assert ProfileCache(path).get("onnxruntime", "1.0", "cpu", "other") is None  # nothing written
    messages = [r.getMessage() for r in caplog.records]
    assert sum("is read-only: using its measurements" in m for m in messages) == 1
    assert sum("not stored" in m for m in messages) == 1  # said once, not per measurement


def test_a_read_only_file_that_is_no_cache_is_bad_input(tmp_path: Path) -> None:
    path = tmp_path / "profiles.sqlite"
    sqlite3.connect(path).execute("CREATE TABLE unrelated (x)").connection.commit()
    path.chmod(0o444)
    try:
        with pytest.raises(InputError, match="read-only profile cache is not a readable tessera cache"):
            ProfileCache(path).get(*KEY)
    finally:
        path.chmod(0o644)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profiles.sqlite"]


@pytest.mark.parametrize(
    "median",
    [-1.0, 1e308, "fast", b"\x00\x01"],
    ids=["negative", "1e308", "text", "binary"],
)
def test_values_no_measurement_has_are_misses(tmp_path: Path, median: object) -> None:
    path = tmp_path / "profiles.sqlite"
    _cache_with_one_profile(path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE profiles SET median_s = ?", (median,))
        conn.execute("UPDATE context_switch SET seconds = ?", (median,))
    cache = ProfileCache(path)
    assert cache.get(*KEY) is None
    assert cache.get_switch("onnxruntime", "openvino", "v", "cpu", 1024) is None
    cache.put(Profile(*KEY, 4e-3, 1e-5, 5))  # measured again: the row is replaced
    assert cache.get(*KEY).median_s == pytest.approx(4e-3)
