"""Exports of the corpus models with torch.onnx's two exporters, static and dynamic batch, cached on
disk between runs under a key of the library versions (``TESSERA_CORPUS_CACHE`` overrides where)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
import torch
from corpus.models import MODELS, CacheOutputs, MaskInput, MaskPositionInput, _DecoderLogits
from torch.utils.flop_counter import FlopCounterMode

CORPUS_VERSION = 5  # bump when the models or the export calls change
EXPORTERS = (
    "legacy",
    "dynamo",
)  # legacy: TorchScript, opset 17; dynamo: torch.export, opset 20 (or a Spec's)
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


def reference(model: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The seeded torch module an export was made from, in eval mode, and its example input."""
    spec = MODELS[model]
    torch.manual_seed(0)
    return spec.build().eval(), spec.example()


def torch_flops(module: torch.nn.Module, x: torch.Tensor) -> int:
    """FLOPs of one forward as torch's FlopCounterMode counts them (a multiply-accumulate is 2)."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        module(x)
    return counter.get_total_flops()


def entry(model: str, exporter: str, batch: str) -> Entry:
    """The export (made once, then read from the cache)."""
    folder = cache_dir()
    stem = f"{model}-{exporter}-{batch}"
    if exporter == "ort":  # the optimizer's output follows onnxruntime's version
        import onnxruntime

        stem += f"-{onnxruntime.__version__}"
    meta, onnx_path = folder / f"{stem}.json", folder / f"{stem}.onnx"
    cached = _cached(meta, onnx_path)
    if cached is not None:
        return cached
    folder.mkdir(parents=True, exist_ok=True)
    # One export per stem however many test processes ask (pytest -n): the others wait, then read it.
    with open(folder / f"{stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _cached(meta, onnx_path) or _made(model, exporter, batch, meta, onnx_path)


def _cached(meta: Path, onnx_path: Path) -> Entry | None:
    if not meta.is_file():
        return None
    data = json.loads(meta.read_text())
    if data["error"] is None and not onnx_path.is_file():
        return None
    # paths are re-rooted: the folder may move
    return Entry(**{**data, "shape": tuple(data["shape"]), "path": data["path"] and str(onnx_path)})


def _made(model: str, exporter: str, batch: str, meta: Path, onnx_path: Path) -> Entry:
    spec = MODELS[model]
    module, x = reference(model)
    flops = torch_flops(module, x)
    axes = ("batch", "sequence") if spec.decoder else ("batch",)
    if exporter == "ort":  # the legacy export as onnxruntime's transformer optimizer leaves it
        legacy = entry(model, "legacy", batch)
        error = legacy.error or _optimized(Path(legacy.path), onnx_path, "gpt2" if spec.decoder else "bert")
    else:
        error = _export(
            module, x, spec.input, exporter, axes if batch == "dynamic" else (), onnx_path, spec.opset
        )
    made = Entry(
        model, exporter, batch, spec.input, tuple(x.shape), flops, None if error else str(onnx_path), error
    )
    tmp = meta.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(made)))
    tmp.replace(meta)
    return made


def _export(
    module: torch.nn.Module,
    x: torch.Tensor,
    name: str,
    exporter: str,
    axes: tuple[str, ...],
    path: Path,
    opset: int = 20,
    *,
    extra: dict[str, torch.Tensor] | None = None,
) -> str | None:
    """Export to ``path`` atomically, the leading ``axes`` of the input dynamic (a decoder's batch and
    sequence, another model's batch); ``extra``: further inputs by name after ``x`` (a mask,
    positions), dynamic alike (dynamo only); the exporter's error in one line if it fails."""
    names, args = [name, *(extra or {})], (x, *(extra or {}).values())
    with _written(path) as (tmp, failed):
        if exporter == "legacy":
            assert not extra, "extra inputs are exported by the dynamo exporter"
            dims = dict(enumerate(axes))
            torch.onnx.export(
                module, (x,), str(tmp), dynamo=False, opset_version=17, input_names=[name],
                output_names=["output"], dynamic_axes={name: dims, "output": dims} if axes else None,
            )  # fmt: skip
        else:
            # Sequences of 2..32 tokens: within every corpus decoder's positions.
            bounds = {"batch": (1, 64), "sequence": (2, 32)}
            dims = {
                i: torch.export.Dim(axis, min=bounds[axis][0], max=bounds[axis][1])
                for i, axis in enumerate(axes)
            }
            shapes = tuple(dims for _ in args) if axes else None
            torch.onnx.export(
                module, args, str(tmp), dynamo=True, opset_version=opset, verbose=False,
                input_names=names, output_names=["output"], dynamic_shapes=shapes,
            )  # fmt: skip
        onnx.save(onnx.load(str(tmp)), str(tmp))  # one file: external data folded in
    return failed[0] if failed else None


def _optimized(source: Path, path: Path, model_type: str) -> str | None:
    """``onnxruntime.transformers.optimizer.optimize_model`` of ``source`` (heads and width found by
    the optimizer), written atomically: layer norms and activations fused into onnxruntime's own
    operators (com.microsoft ``SkipLayerNormalization``, ``FastGelu``, ``BiasGelu``, …)."""
    from onnxruntime.transformers.optimizer import optimize_model

    with _written(path) as (tmp, failed):
        optimized = optimize_model(str(source), model_type=model_type, num_heads=0, hidden_size=0)
        optimized.save_model_to_file(str(tmp))
    return failed[0] if failed else None


@contextlib.contextmanager
def _written(path: Path) -> Iterator[tuple[Path, list[str]]]:
    """A temporary file beside ``path`` that becomes it when the block ends; the block's error, in
    one line, lands in the yielded list instead (the corpus records what an exporter cannot do)."""
    tmp = path.with_suffix(f".tmp{os.getpid()}.onnx")
    failed: list[str] = []
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            yield tmp, failed
        tmp.replace(path)
    except Exception as exc:  # noqa: BLE001 - recorded, not raised: what the tool cannot do
        failed.append(f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
    finally:
        logging.disable(logging.NOTSET)
        tmp.unlink(missing_ok=True)
        Path(str(tmp) + ".data").unlink(missing_ok=True)


# The other ways users export a plain family besides ``model(input_ids)`` by the dynamo exporter:
# the attention mask as a second input (dynamo), an all-ones mask made inside the forward (the
# legacy exporter: without a mask transformers 5 tests for packed sequences with ``torch.diff``,
# which it cannot export), bf16 weights (dynamo, no mask), and an example of batch 1 (dynamo, a
# dynamic batch asked for: torch.export fixes it at 1 anyway), position ids as an input beside the
# mask (optimum's inputs), and the KV cache returned beside the logits (``use_cache=True``).
FORMS = ("mask-input", "legacy-mask-inside", "bf16", "batch1", "mask-position-input", "cache-outputs")


def form_export(model: str, form: str) -> Path:
    """``model`` (a plain family) exported in ``form``, made once then read from the cache beside the
    corpus; AssertionError with the exporter's error if it fails."""
    path = cache_dir() / f"{model}-{form}.onnx"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            error = _form_made(model, form, path)
            assert error is None, f"{model} {form}: {error}"
    return path


def _form_made(model: str, form: str, path: Path) -> str | None:
    module, x = reference(model)
    hf = module.model  # the transformers model inside the plain wrapper
    axes, mask = ("batch", "sequence"), torch.ones_like(x)
    if form == "legacy-mask-inside":
        return _export(_DecoderLogits(hf), x, "input_ids", "legacy", axes, path)
    if form == "bf16":
        return _export(module.to(torch.bfloat16), x, "input_ids", "dynamo", axes, path)
    if form == "batch1":
        return _export(module, x[:1], "input_ids", "dynamo", axes, path)
    if form == "mask-input":
        return _export(MaskInput(hf), x, "input_ids", "dynamo", axes, path, extra={"attention_mask": mask})
    if form == "mask-position-input":
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        extra = {"attention_mask": mask, "position_ids": positions}
        return _export(MaskPositionInput(hf), x, "input_ids", "dynamo", axes, path, extra=extra)
    assert form == "cache-outputs", form
    return _export(CacheOutputs(hf), x, "input_ids", "dynamo", axes, path)


# Models whose legacy export also enters as onnxruntime's optimizer leaves it (dynamic batch).
OPTIMIZED = ("gpt2", "llama-gqa", "bert")
ENTRIES = [
    (m, e, b)
    for m in MODELS
    for e in EXPORTERS
    for b in BATCHES
    if not MODELS[m].plain or (e, b) == ("dynamo", "dynamic")
] + [(m, "ort", "dynamic") for m in OPTIMIZED]
Key = tuple[str, str, str]  # (model, exporter, batch)


@dataclass
class Corpus:
    """Every export of the corpus, made or read from the cache; the reference modules built on demand."""

    entries: dict[Key, Entry]
    _modules: dict[str, tuple[torch.nn.Module, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def paths(self) -> dict[Key, Path]:
        """The exports written, by (model, exporter, batch)."""
        return {key: Path(made.path) for key, made in self.entries.items() if made.path is not None}

    @property
    def failures(self) -> dict[Key, str]:
        """What an exporter could not export, and its error in one line."""
        return {key: made.error for key, made in self.entries.items() if made.error is not None}

    def input_shapes(self, key: Key) -> dict[str, tuple[int, ...]]:
        """The example input's shape by input name (``load_graph``'s ``input_shapes``)."""
        made = self.entries[key]
        return {made.input: made.shape}

    def reference(self, model: str) -> tuple[torch.nn.Module, torch.Tensor]:
        """The torch module ``model``'s exports were made from, and its example input (built once)."""
        if model not in self._modules:
            self._modules[model] = reference(model)
        return self._modules[model]


def build_corpus(keys: Sequence[Key] = tuple(ENTRIES)) -> Corpus:
    """Make (or read from the cache) every export in ``keys``."""
    return Corpus({key: entry(*key) for key in keys})
