"""MetaSchedule tuning of TVM subgraphs, with tuning records persisted in a directory.

``tune(fused_mod, target, work_dir, trials)`` tunes the fused kernels of a legalized Relax module that
have no record yet and writes each kernel's best records to ``work_dir/records/<workload>.json``;
``apply_records`` applies them before a build, so a kernel is tuned once for every model containing it.
Candidates are built and timed in this process with the ``replay-func`` strategy, because the installed
TVM's TIR JSON serializer crashes (details: docs/backends.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.core.files import write_atomic

log = logging.getLogger(__name__)

RECORDS_PER_KERNEL = 4


def prepare(mod: Any, target: Any) -> Any:
    """Legalize and fuse a Relax module (the preparation MetaSchedule extracts its tasks from)."""
    import tvm
    from tvm import relax

    with target:
        return tvm.transform.Sequential(
            [
                relax.transform.DecomposeOpsForInference(),
                relax.transform.CanonicalizeBindings(),
                relax.pipeline.zero_pipeline(),
            ]
        )(mod)


@dataclass(frozen=True)
class TuneResult:
    """What a tuning call did: kernels found, tuned now, already tuned, trials spent, best times."""

    kernels: tuple[str, ...]
    tuned: tuple[str, ...]
    reused: tuple[str, ...]
    trials: int
    best_seconds: dict[str, float]
    work_dir: Path


def tune(fused: Any, target: Any, work_dir: Path, trials: int, *, seed: int = 0) -> TuneResult:
    """Tune the kernels of ``fused`` that have no record in ``work_dir`` (see the module docstring)."""
    from tvm.s_tir import meta_schedule as ms

    _import_cpu_tensor_intrinsics()
    tasks = ms.relax_integration.extract_tasks(fused, target)
    store = RecordStore(work_dir)
    todo = [t for t in tasks if not store.load(t.dispatched[0], target)]
    reused = tuple(t.task_name for t in tasks if t not in todo)
    best: dict[str, float] = {}
    if todo and trials > 0:
        database = ms.database.MemoryDatabase()
        from tvm.s_tir.meta_schedule.tune_context import TuneContext
        from tvm.s_tir.meta_schedule.utils import fork_seed

        # Contexts made here, not by extracted_tasks_to_tune_contexts: that one reconfigures Python
        # logging from a work_dir on every call and fails the second time in one process.
        contexts = [
            TuneContext(
                mod=task.dispatched[0],
                target=task.target,
                space_generator=_space(),
                search_strategy="replay-func",
                task_name=task.task_name,
                logger=logging.getLogger(f"{__name__}.meta_schedule"),
                rand_state=rand_state,
                num_threads=max(1, int(target.attrs.get("num-cores", 1))),
            ).clone()
            for task, rand_state in zip(todo, fork_seed(seed, len(todo)), strict=True)
        ]
        with tempfile.TemporaryDirectory(prefix="tessera-ms-") as scratch:
            ms.tune.tune_tasks(
                tasks=contexts,
                task_weights=[float(t.weight) for t in todo],
                work_dir=scratch,
                max_trials_global=trials,
                max_trials_per_task=trials,
                num_trials_per_iter=min(trials, 8),
                builder=InProcessBuilder(),
                runner=InProcessRunner(),
                database=database,
                cost_model="random",
                measure_callbacks=[
                    ms.measure_callback.AddToDatabase(),
                    ms.measure_callback.UpdateCostModel(),
                ],
            )
        for task in todo:
            workload = database.commit_workload(task.dispatched[0])
            records = database.get_top_k(workload, RECORDS_PER_KERNEL)
            if records:
                store.save(task.dispatched[0], target, task.task_name, records)
                best[task.task_name] = min(float(s) for s in records[0].run_secs)
    return TuneResult(
        kernels=tuple(t.task_name for t in tasks),
        tuned=tuple(best),
        reused=reused,
        trials=trials if todo else 0,
        best_seconds=best,
        work_dir=work_dir,
    )


def apply_records(fused: Any, target: Any, work_dir: Path) -> Any:
    """``fused`` with the recorded schedule of every kernel that has one in ``work_dir``."""
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    store = RecordStore(work_dir)
    if not store.exists():
        return fused
    tasks = ms.relax_integration.extract_tasks(fused, target)
    database = ms.database.MemoryDatabase()
    found = 0
    for task in tasks:
        for record in store.load(task.dispatched[0], target):
            database.commit_tuning_record(record_from_json(record, task.dispatched[0], target, database))
            found += 1
    if not found:
        return fused
    with target, database:
        return relax.transform.MetaScheduleApplyDatabase()(fused)


# --- the record directory --------------------------------------------------------------------


class RecordStore:
    """``work_dir/records/<structural hash>-<target hash>.json``: a kernel's best records."""

    def __init__(self, work_dir: Path) -> None:
        self.root = Path(work_dir) / "records"

    def exists(self) -> bool:
        return self.root.is_dir()

    def digest(self) -> str:
        """The first 12 hex digits of a sha256 over every record file (name and bytes); "" when there
        are none."""
        import hashlib

        files = sorted(self.root.glob("*.json")) if self.exists() else []
        if not files:
            return ""
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode())
            h.update(f.read_bytes())
        return h.hexdigest()[:12]

    def path(self, kernel: Any, target: Any) -> Path:
        from tvm.s_tir.meta_schedule.utils import shash2hex

        return self.root / f"{shash2hex(kernel)}-{_stable_target_key(target)}.json"

    def load(self, kernel: Any, target: Any) -> list[dict[str, Any]]:
        path = self.path(kernel, target)
        try:
            data = json.loads(path.read_text())
            return list(data["records"])
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable TVM tuning record %s: %s", path, exc)
            return []

    def save(self, kernel: Any, target: Any, task_name: str, records: list[Any]) -> Path:
        payload = {
            "task": task_name,
            "target": str(target),
            "records": [
                {
                    "trace": _plain(r.trace.as_json()),
                    "run_secs": [float(s) for s in (r.run_secs or [])],
                    "args_info": [_plain(a.as_json()) for a in r.args_info],
                }
                for r in records
            ],
        }
        return write_atomic(self.path(kernel, target), json.dumps(payload, indent=1))


def _stable_target_key(target: Any) -> str:
    import hashlib

    return hashlib.sha256(str(target).encode()).hexdigest()[:12]


def record_from_json(record: dict[str, Any], kernel: Any, target: Any, database: Any) -> Any:
    """A ``TuningRecord`` rebuilt by replaying the stored trace onto ``kernel``."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.database import TuningRecord
    from tvm.s_tir.schedule import Schedule, Trace

    sch = Schedule(kernel)
    Trace.apply_json_to_schedule(record["trace"], sch)
    workload = database.commit_workload(kernel)
    args = [ArgInfo.from_json(a) for a in record["args_info"]]
    return TuningRecord(sch.trace, workload, record["run_secs"], target, args)


def _plain(value: Any) -> Any:
    """TVM FFI containers and immediates as plain JSON values."""
    import tvm

    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, tvm.tirx.IntImm):
        return int(value.value)
    if isinstance(value, tvm.tirx.FloatImm):
        return float(value.value)
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "__iter__"):
        return [_plain(v) for v in value]
    raise TypeError(f"cannot store {type(value).__name__} in a tuning record")


# --- MetaSchedule plumbing ---------------------------------------------------------------------


def _import_cpu_tensor_intrinsics() -> None:
    """Register only the x86 tensor intrinsics MetaSchedule's CPU rules use.

    ``tvm.s_tir.tensor_intrin`` registers every target's intrinsics on import (CUDA, ROCm, Hexagon,
    ARM…), which takes about 30 s; MetaSchedule imports it when a tuning context is made. Loading the
    package without running its ``__init__`` and importing the x86 module keeps CPU tuning quick.
    """
    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None:  # pragma: no cover
        return
    sys.modules[name] = importlib.util.module_from_spec(spec)
    importlib.import_module(f"{name}.x86")


def _space() -> Any:
    """Post-order-apply with the LLVM rules; the mutators that crash in this TVM build are left out."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.space_generator import PostOrderApply

    return PostOrderApply(
        sch_rules="llvm",
        postprocs="llvm",
        mutator_probs={ms.mutator.MutateTileSize(): 0.9, ms.mutator.MutateUnroll(): 0.1},
    )


def _make_builder_runner() -> tuple[type, type]:
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
    from tvm.s_tir.meta_schedule.runner import PyRunner, PyRunnerFuture, RunnerResult
    from tvm.s_tir.meta_schedule.runner.config import EvaluatorConfig
    from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common, run_evaluator_common

    artifacts: dict[str, Any] = {}

    @derived_object
    class _Builder(PyBuilder):
        """Builds candidates in this process; artifacts stay in memory (keyed by a token)."""

        def build(self, build_inputs: list[Any]) -> list[Any]:
            import tvm
            from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

            results = []
            for item in build_inputs:
                try:
                    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(item.mod)
                    token = f"tessera-memory:{len(artifacts)}:{id(item)}"
                    artifacts[token] = tvm.tirx.build(mod, target=item.target)
                    results.append(BuilderResult(token, None))
                except Exception as exc:  # noqa: BLE001 - a candidate that fails to build is skipped
                    results.append(BuilderResult(None, f"{type(exc).__name__}: {exc}"))
            return results

    @derived_object
    class _Done(PyRunnerFuture):
        def __init__(self, seconds: list[float] | None, error: str | None) -> None:
            super().__init__()
            self.seconds = seconds
            self.error = error

        def done(self) -> bool:
            return True

        def result(self) -> Any:
            return RunnerResult(self.seconds, self.error)

    @derived_object
    class _Runner(PyRunner):
        """Times candidates in this process with TVM's time evaluator (random-filled arguments)."""

        def __init__(self) -> None:
            super().__init__()

        def run(self, runner_inputs: list[Any]) -> list[Any]:
            import tvm

            config = EvaluatorConfig(number=3, repeat=1, min_repeat_ms=0, enable_cpu_cache_flush=False)
            fill = tvm.get_global_func("tvm.contrib.random.random_fill_for_measure", True)
            futures = []
            for item in runner_inputs:
                try:
                    module = artifacts.pop(item.artifact_path)
                    device = tvm.runtime.device(item.device_type, 0)
                    args = alloc_argument_common(fill, device, [a.as_json() for a in item.args_info], 1)
                    futures.append(_Done(run_evaluator_common(module, device, config, args), None))
                except Exception as exc:  # noqa: BLE001
                    futures.append(_Done(None, f"{type(exc).__name__}: {exc}"))
            return futures

    return _Builder, _Runner


_CLASSES: tuple[type, type] | None = None


def InProcessBuilder() -> Any:  # noqa: N802 - reads as a class at the call site
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _make_builder_runner()
    return _CLASSES[0]()


def InProcessRunner() -> Any:  # noqa: N802
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _make_builder_runner()
    return _CLASSES[1]()
