"""Apache TVM (Relax) on the CPU through LLVM.

A sub-model is imported with ``tvm.relax.frontend.onnx.from_onnx`` (weights bound as constants),
legalized and fused (Relax's zero pipeline: LegalizeOps, FuseOps, FuseTIR), given the tuned
schedules of any of its fused kernels found in the tuning-record directory
(:mod:`tessera.backends.tvm_tuning`), built with ``tvm.compile`` for the host CPU and run on the
Relax virtual machine. Untuned kernels get TVM's default schedules, which are slow: tune the
subgraphs that matter with :meth:`TvmBackend.tune`.

Capability: the op types the Relax ONNX frontend has converters for (its ``_get_convert_map``).
"""

from __future__ import annotations

import importlib.util
import logging
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tessera.backends.base import Backend, BuildError, Capability, Feeds, cpu_cores, model_io

log = logging.getLogger(__name__)

DTYPES = frozenset(
    {"float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"}
)  # fmt: skip
_ALIGNMENT = 64  # TVM takes numpy memory without a copy only when it is 64-byte aligned


def host_target() -> Any:
    """The LLVM target for this CPU (its LLVM cpu name and core count)."""
    import tvm
    from tvm.target import codegen

    return tvm.target.Target(
        {"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": cpu_cores()}
    )


def default_work_dir() -> Path:
    from tessera.backends.base import default_cache_dir

    return default_cache_dir() / "tvm"


class TvmRunnable:
    """A Relax VM over one compiled sub-model.

    Inputs: numpy arrays that are C-contiguous, of the right dtype and 64-byte aligned are passed to
    TVM through DLPack without a copy; other arrays are copied once (TVM rejects unaligned memory).
    Outputs: TVM's result tensors are exposed to numpy through DLPack, without a copy.
    """

    def __init__(
        self, vm: Any, input_names: tuple[str, ...], output_names: tuple[str, ...], dtypes: list[str]
    ):
        import tvm

        self._tvm = tvm
        self.vm = vm
        self._main = vm["main"]
        self.input_names = input_names
        self.output_names = output_names
        self._dtypes = dtypes

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]:
        tvm = self._tvm
        args = []
        for name, dtype in zip(self.input_names, self._dtypes, strict=True):
            array = np.ascontiguousarray(feeds[name], dtype=dtype)
            if array.ctypes.data % _ALIGNMENT == 0:
                args.append(tvm.runtime.from_dlpack(array))
            else:
                args.append(tvm.runtime.tensor(array))
        result = self._main(*args)
        outs = [result] if len(self.output_names) == 1 else list(result)
        return {name: _to_numpy(o) for name, o in zip(self.output_names, outs, strict=True)}


def _to_numpy(value: Any) -> np.ndarray:
    try:
        return np.from_dlpack(value)
    except (TypeError, RuntimeError, BufferError):
        return value.numpy()


class TvmBackend(Backend):
    """TVM Relax on the host CPU (LLVM), with MetaSchedule tuning records reused across runs."""

    name = "tvm"
    by_default = False  # a compile per candidate takes seconds: placed on when --backends names it
    distribution = "apache-tvm"

    def __init__(self, work_dir: str | Path | None = None) -> None:
        self.work_dir = Path(work_dir) if work_dir is not None else default_work_dir()
        self._records: str | None = None

    @property
    def version(self) -> str | None:
        # Tuning records change what is measured: profile-cache keys carry a digest of them.
        base = super().version
        if base is None:
            return None
        if self._records is None:
            from tessera.backends.tvm_tuning import RecordStore

            self._records = RecordStore(self.work_dir).digest()
        return f"{base}+records.{self._records}" if self._records else base

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("tvm") is None:
            return False, "apache-tvm not installed"
        try:
            import tvm
        except Exception as exc:  # noqa: BLE001 - a broken native library
            return False, f"tvm fails to import: {type(exc).__name__}: {exc}"
        if not tvm.runtime.enabled("llvm"):
            return False, "tvm was built without LLVM (no CPU code generation)"
        try:
            import tvm.relax.frontend.onnx
        except Exception as exc:  # noqa: BLE001
            return False, f"tvm has no Relax ONNX frontend: {exc}"
        return True, ""

    @property
    def device(self) -> str:
        try:
            from tvm.target import codegen

            return f"{super().device} llvm -mcpu={codegen.llvm_get_system_cpu()}"
        except Exception:  # noqa: BLE001
            return super().device

    @cached_property
    def _converters(self) -> frozenset[str]:
        self.require()
        from tvm.relax.frontend.onnx import onnx_frontend

        return frozenset(onnx_frontend._get_convert_map())

    def capability(self) -> Capability:
        return Capability(self._converters, DTYPES, "tvm.relax.frontend.onnx converter table")

    @cached_property
    def target(self) -> Any:
        self.require()
        return host_target()

    def import_model(self, model: onnx.ModelProto) -> Any:
        """The sub-model as a legalized, fused Relax module (what tuning and compiling share)."""
        from tvm.relax.frontend.onnx import from_onnx

        from tessera.backends.tvm_tuning import prepare

        try:
            mod = from_onnx(model, keep_params_in_input=False)
            return prepare(mod, self.target)
        except Exception as exc:  # noqa: BLE001 - the frontend raises many types
            raise BuildError(
                f"tvm could not import the subgraph: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            ) from exc

    def compile(self, model: onnx.ModelProto) -> TvmRunnable:
        self.require()
        import tvm
        from tvm import relax

        from tessera.backends.tvm_tuning import apply_records

        fused = self.import_model(model)
        try:
            mod = apply_records(fused, self.target, self.work_dir)
            executable = tvm.compile(mod, target=self.target)
            vm = relax.VirtualMachine(executable, tvm.cpu())
        except Exception as exc:  # noqa: BLE001
            raise BuildError(
                f"tvm could not build the subgraph: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            ) from exc
        ins, outs = model_io(model)
        inits = {t.name for t in model.graph.initializer}
        dtypes = [
            np.dtype(onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)).name
            for v in model.graph.input
            if v.name not in inits
        ]
        return TvmRunnable(vm, ins, outs, dtypes)

    def tune(
        self, model: onnx.ModelProto, trials: int, work_dir: str | Path | None = None, *, seed: int = 0
    ) -> Any:
        """MetaSchedule-tune the sub-model's kernels with ``trials`` measured candidates in all.

        Records go to ``work_dir`` (default: this backend's record directory) and are reused by every
        later :meth:`compile`; kernels that already have records are not tuned again.
        """
        from tessera.backends.tvm_tuning import tune

        self.require()
        self._records = None  # new records: a new version
        return tune(
            self.import_model(model),
            self.target,
            Path(work_dir) if work_dir else self.work_dir,
            trials,
            seed=seed,
        )
