"""Exports of the corpus models with torch.onnx's two exporters, static and dynamic batch, cached on
disk between runs under a key of the library versions (``TESSERA_CORPUS_CACHE`` overrides where)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx
import torch
from corpus.models import MODELS
from torch.utils.flop_counter import FlopCounterMode

CORPUS_VERSION = 1  # bump when the models or the export calls change
EXPORTERS = ("legacy", "dynamo")  # legacy: TorchScript, opset 17; dynamo: torch.export, opset 20
BATCHES = ("dynamic", "static")


@dataclass(frozen=True)
class Entry:
    model: str
    exporter: str
    batch: str
    input: str
    shape: tuple[int, ...]  # the example input's shape
    torch_flops: int  # FlopCounterMode of the same forward
    path: str | None  # None: the exporter failed (``error`` says why)
    error: str | None = None

    @property
    def name(self) -> str:
        return f"{self.model}-{self.exporter}-{self.batch}"


def cache_dir() -> Path:
    import onnxscript
    import transformers

    versions = {
        "torch": torch.__version__, "transformers": transformers.__version__, "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__, "corpus": CORPUS_VERSION,
    }  # fmt: skip
    key = hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(os.environ.get("TESSERA_CORPUS_CACHE", Path.home() / ".cache" / "tessera" / "corpus"))
    return root / key


def entry(model: str, exporter: str, batch: str) -> Entry:
    """The export (made once, then read from the cache)."""
    folder = cache_dir()
    meta = folder / f"{model}-{exporter}-{batch}.json"
    if meta.is_file():
        data = json.loads(meta.read_text())
        return Entry(**{**data, "shape": tuple(data["shape"])})
    folder.mkdir(parents=True, exist_ok=True)
    spec = MODELS[model]
    torch.manual_seed(0)
    module, x = spec.build().eval(), spec.example()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        module(x)
    onnx_path = folder / f"{model}-{exporter}-{batch}.onnx"
    error = _export(module, x, spec.input, exporter, batch == "dynamic", onnx_path)
    made = Entry(
        model, exporter, batch, spec.input, tuple(x.shape), counter.get_total_flops(),
        None if error else str(onnx_path), error,
    )  # fmt: skip
    tmp = meta.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(made)))
    tmp.replace(meta)
    return made


def _export(
    module: torch.nn.Module, x: torch.Tensor, name: str, exporter: str, dynamic: bool, path: Path
) -> str | None:
    """Export to ``path`` atomically; the exporter's error in one line if it fails."""
    tmp = path.with_suffix(f".tmp{os.getpid()}.onnx")
    quiet = contextlib.redirect_stdout(io.StringIO())
    try:
        with warnings.catch_warnings(), quiet:
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            if exporter == "legacy":
                axes = {name: {0: "batch"}, "output": {0: "batch"}} if dynamic else None
                torch.onnx.export(
                    module, (x,), str(tmp), dynamo=False, opset_version=17,
                    input_names=[name], output_names=["output"], dynamic_axes=axes,
                )  # fmt: skip
            else:
                shapes = ({0: torch.export.Dim("batch", min=1, max=64)},) if dynamic else None
                torch.onnx.export(
                    module, (x,), str(tmp), dynamo=True, opset_version=20, verbose=False,
                    input_names=[name], output_names=["output"], dynamic_shapes=shapes,
                )  # fmt: skip
        onnx.save(onnx.load(str(tmp)), str(tmp))  # one file: external data folded in
        tmp.replace(path)
        return None
    except Exception as exc:  # noqa: BLE001 - the corpus records what an exporter cannot do
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    finally:
        logging.disable(logging.NOTSET)
        tmp.unlink(missing_ok=True)
        Path(str(tmp) + ".data").unlink(missing_ok=True)


ENTRIES = [(m, e, b) for m in MODELS for e in EXPORTERS for b in BATCHES]
