"""The measurer and the SQLite profile cache: hits, canonical hashes, corruption, concurrency, ε."""

from __future__ import annotations

import math
import sqlite3
import threading
from pathlib import Path

import onnx
import pytest

from tessera.backends.base import Backend, BuildError, Capability
from tessera.backends.measure import Measurer, time_runs
from tessera.backends.onnxruntime import OnnxRuntimeBackend
from tessera.backends.openvino import OpenVinoBackend
from tessera.backends.profile_cache import Profile, ProfileCache, subgraph_hash
from tessera.core.errors import InputError

LINEAR = ["layer0/ffn/fc1/matmul", "layer0/ffn/fc1/bias_add"]
LINEAR_1 = ["layer1/ffn/fc1/matmul", "layer1/ffn/fc1/bias_add"]


@pytest.fixture(scope="module")
def ort() -> OnnxRuntimeBackend:
    return OnnxRuntimeBackend()


def fast(cache: ProfileCache) -> Measurer:
    return Measurer(cache, warmup=1, repeat=5)


def test_canonical_hash_ignores_names_and_weights(gpt) -> None:
    a, b = subgraph_hash(gpt.extract(LINEAR)), subgraph_hash(gpt.extract(LINEAR_1))
    assert a == b  # the same layer at two places (different names and weights)
    assert a != subgraph_hash(
        gpt.extract(["layer0/ffn/fc2/matmul", "layer0/ffn/fc2/bias_add"])
    )  # other shapes
    assert a != subgraph_hash(gpt.extract(LINEAR[:1]))


def test_second_measurement_hits_the_cache(tmp_path: Path, gpt, ort) -> None:
    cache = ProfileCache(tmp_path / "profiles.sqlite")
    first = fast(cache).measure(ort, gpt, LINEAR)
    assert not first.cached and first.ok and first.median_s > 0 and first.iqr_s >= 0 and first.compile_s
    second = fast(cache).measure(ort, gpt, LINEAR)
    assert second.cached and second.median_s == first.median_s and second.iqr_s == first.iqr_s
    other_layer = fast(cache).measure(ort, gpt, LINEAR_1)
    assert other_layer.cached and other_layer.subgraph == first.subgraph
    assert cache.count() == 1
    # Another process sees the same rows.
    assert ProfileCache(tmp_path / "profiles.sqlite").count() == 1


def test_cache_survives_truncation_and_garbage(tmp_path: Path, gpt, ort, caplog, monkeypatch) -> None:
    path = tmp_path / "profiles.sqlite"
    cache = ProfileCache(path)
    fast(cache).measure(ort, gpt, LINEAR)
    cache.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])  # truncated mid-file
    for p in tmp_path.glob("profiles.sqlite-*"):
        p.unlink()
    again = ProfileCache(path)
    m = fast(again).measure(ort, gpt, LINEAR)
    assert m.ok and not m.cached  # rebuilt, measured anew
    assert fast(again).measure(ort, gpt, LINEAR).cached
    assert list(tmp_path.glob("profiles.sqlite.corrupt-*"))
    again.close()
    caplog.clear()
    path.write_bytes(b"this is not a database" * 10)  # at the default path: tessera's own file
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    assert ProfileCache().get("onnxruntime", "x", "y", "z") is None
    assert "unreadable" in caplog.text


def test_a_cache_path_that_holds_another_file_is_left_alone(tmp_path: Path) -> None:
    """``--cache plan.json`` (a typo): an error naming the file, which stays as it was; a link
    loop is an error too, not moved aside."""
    other = tmp_path / "model.onnx"
    other.write_bytes(b"\x08\x07not sqlite")
    with pytest.raises(InputError, match="not a profile cache") as info:
        ProfileCache(other).get("onnxruntime", "x", "y", "z")
    assert info.value.source == str(other)
    assert other.read_bytes() == b"\x08\x07not sqlite" and sorted(tmp_path.iterdir()) == [other]
    loop = tmp_path / "loop.sqlite"
    loop.symlink_to(loop)
    with pytest.raises(InputError, match="cannot open the profile cache"):
        ProfileCache(loop).get("onnxruntime", "x", "y", "z")
    assert loop.is_symlink()


def test_concurrent_writers(tmp_path: Path) -> None:
    path = tmp_path / "profiles.sqlite"
    errors: list[Exception] = []

    def writer(i: int) -> None:
        try:
            cache = ProfileCache(path)
            for j in range(20):
                cache.put(Profile("b", "1", "dev", f"{i}-{j}", 1e-3, 1e-5, 5))
            cache.close()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert ProfileCache(path).count() == 80
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


class Broken(Backend):
    name = "broken"

    def available(self) -> tuple[bool, str]:
        return True, ""

    def capability(self) -> Capability:
        return Capability(None, frozenset({"float32"}), "test")

    def compile(self, model: onnx.ModelProto):
        raise BuildError("no kernel for this")


def test_failed_build_costs_infinity_and_is_cached(tmp_path: Path, gpt, caplog) -> None:
    caplog.set_level("INFO")
    cache = ProfileCache(tmp_path / "p.sqlite")
    m = fast(cache).measure(Broken(), gpt, LINEAR)
    assert m.cost == math.inf and not m.ok and "no kernel" in m.error
    measurer = fast(cache)
    again = measurer.measure(Broken(), gpt, LINEAR)
    assert again.cached and again.cost == math.inf
    assert "broken failed" in caplog.text  # each failure at -v
    measurer.measure(Broken(), gpt, ["layer0/attn/softmax"])
    # one line for the backend (a cached failure counts: the search still places it elsewhere)
    assert measurer.failures() == [
        "broken failed on 2 of the 2 subgraph(s) it was given (-v shows each); most often (2×): "
        "BuildError: no kernel for this"
    ]


def test_constant_inputs_get_real_values(tmp_path: Path, gpt, ort) -> None:
    # mask_add reads the causal mask computed by constant nodes outside the subgraph.
    m = fast(ProfileCache(tmp_path / "p.sqlite")).measure(
        ort, gpt, ["layer0/attn/mask_add", "layer0/attn/softmax"]
    )
    assert m.ok


def test_context_switch_is_measured_and_cached(tmp_path: Path, ort) -> None:
    cache = ProfileCache(tmp_path / "p.sqlite")
    ov = OpenVinoBackend()
    eps = fast(cache).context_switch(ort, ov, 1 << 14)
    assert 0.0 <= eps < 0.01
    assert (
        cache.get_switch("onnxruntime", "openvino", f"{ort.version}|{ov.version}", *_switch_key(ort, ov))
        == eps
    )
    assert fast(cache).context_switch(ort, ov, 1 << 14) == eps  # from the cache
    assert fast(cache).context_switch(ort, ort, 1 << 14) >= 0.0


def _switch_key(src, dst) -> tuple[str, int]:
    from tessera.backends.profile_cache import device_fingerprint

    return device_fingerprint(f"{src.device} -> {dst.device}"), 1 << 14


def test_time_runs() -> None:
    t = time_runs(lambda: sum(range(100)), warmup=1, repeat=7)
    assert t.median_s > 0 and t.iqr_s >= 0 and t.runs >= 7


def test_measure_many_with_progress_off_tty(tmp_path: Path, gpt, ort) -> None:
    measurer = Measurer(ProfileCache(tmp_path / "p.sqlite"), warmup=1, repeat=3, progress=True)
    results = measurer.measure_many([(ort, LINEAR), (ort, LINEAR_1)], gpt)
    assert [r.cached for r in results] == [False, True]
