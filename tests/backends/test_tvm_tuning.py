"""MetaSchedule tuning of a TVM subgraph: a few trials on one small matmul; records persist and are reused."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tessera.backends.onnxruntime import OnnxRuntimeBackend
from tessera.backends.tvm import TvmBackend

LINEAR = ["layer0/ffn/fc1/matmul", "layer0/ffn/fc1/bias_add"]


def test_tune_persists_and_reuses_records(tmp_path: Path, gpt) -> None:
    sub = gpt.extract(LINEAR)
    first = TvmBackend(work_dir=tmp_path).tune(sub, trials=4)
    assert first.kernels and first.tuned == first.kernels and not first.reused
    assert all(s > 0 for s in first.best_seconds.values())
    records = list((tmp_path / "records").glob("*.json"))
    assert len(records) == len(first.kernels)

    # A new backend object (as in a new process) finds the records and does not tune again.
    again = TvmBackend(work_dir=tmp_path)
    second = again.tune(sub, trials=4)
    assert second.reused == first.kernels and not second.tuned and second.trials == 0

    # The tuned kernel is the one compiled, and it is still right.
    (name,) = [i.name for i in sub.graph.input]
    x = {name: np.random.default_rng(0).standard_normal((1, 16, 32), dtype=np.float32)}
    got = again.compile(sub).run(x)
    want = OnnxRuntimeBackend().compile(sub).run(x)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5)


def test_unreadable_record_is_ignored(tmp_path: Path, gpt) -> None:
    sub = gpt.extract(LINEAR[:1])
    backend = TvmBackend(work_dir=tmp_path)
    result = backend.tune(sub, trials=2)
    for path in (tmp_path / "records").glob("*.json"):
        path.write_text("{not json")
    assert backend.compile(sub).run({sub.graph.input[0].name: np.ones((1, 16, 32), np.float32)})
    assert backend.tune(sub, trials=0).reused == ()
    assert result.kernels


def test_records_are_part_of_the_version_profile_caches_key_on(tmp_path: Path, gpt) -> None:
    backend = TvmBackend(work_dir=tmp_path)
    untuned = backend.version
    assert untuned is not None and "+records." not in untuned
    backend.tune(gpt.extract(LINEAR[:1]), trials=2)
    tuned = backend.version
    assert tuned is not None and tuned.startswith(untuned + "+records.")
    assert TvmBackend(work_dir=tmp_path).version == tuned  # the same records: the same version


def test_place_tunes_the_models_tvm_kernels_first(tmp_path: Path) -> None:
    from cli.test_place import mlp

    from tessera.backends.measure import Measurer
    from tessera.backends.profile_cache import ProfileCache
    from tessera.backends.registry import builtin_registry
    from tessera.planners.placement import PlacementOptions, plan_placement

    registry = builtin_registry()
    tvm = registry.backend("tvm")
    tvm.work_dir = tmp_path / "tvm"
    options = PlacementOptions(backends=("onnxruntime", "tvm"), tvm_trials=4, max_group_ops=2, rounds=3)
    plan = plan_placement(
        mlp(), options, registry=registry, measurer=Measurer(ProfileCache(tmp_path / "c.sqlite"))
    )
    assert list((tmp_path / "tvm" / "records").glob("*.json"))  # tuned before the search
    assert "+records." in tvm.version
    assert plan.plan.measured["single_backend_latency_s"]["tvm"] > 0
