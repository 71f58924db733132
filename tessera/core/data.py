"""The mini-batches a training run draws (:class:`TrainingData`): seeded synthetic data, the
arrays of an ``.npz`` file, or windows of a flat token file (:mod:`tessera.core.tokens`). Core, so that the stage profiler measures a stage on the very inputs
the stage workers train on. Semantics: docs/executor.md ("Training semantics").
"""

from __future__ import annotations

import numpy as np

from tessera.core.errors import InputError
from tessera.core.graph import Graph, is_floating
from tessera.core.tokens import TOKEN_SUFFIXES, TokenWindows
from tessera.core.user_files import read_npz


class TrainingData:
    """The mini-batches of a run: ``batch(step)`` → (inputs, targets), numpy arrays by name.

    Synthetic data is drawn from ``numpy.random.default_rng([seed, step])``, so every rank and the
    reference draw the same mini-batch without talking. An ``.npz`` file holds one array per graph
    input (and optionally ``target:<output>``) with ``N`` rows, ``N`` a multiple of the mini-batch;
    step ``k`` takes rows ``[(k mod N/B)·B, …+B)``. A token file (``.bin``, ``.npy``) feeds a
    decoder's one ``[batch, sequence]`` id input with windows of its sequence length, and labels its
    ``[batch, sequence, vocab]`` logits with the next tokens (``targets``).
    """

    def __init__(
        self, graph: Graph, mini_batch: int, seed: int = 0, path: str | None = None, loss: str = "mse"
    ) -> None:
        self.mini_batch = mini_batch
        self.seed = seed
        self.specs = {name: (info.shape or (1,), info.dtype) for name, info in graph.inputs.items()}
        self.id_range = {name: _id_range(graph, name) for name, (_, dtype) in self.specs.items()}
        self.arrays: dict[str, np.ndarray] | None = None
        self.tokens: tuple[str, str, TokenWindows] | None = None  # (ids input, logits output, windows)
        if loss == "graph":
            _check_graph_loss(graph)
        if path is not None and path.endswith(TOKEN_SUFFIXES):
            if loss != "ce":
                raise InputError(
                    f"a token file trains next-token prediction with --loss ce, not {loss}", source=path
                )
            self.tokens = _token_windows(graph, path, seed, self.id_range)
        elif path is not None:
            self.arrays = load_npz(path, graph, mini_batch, loss)
        if (
            loss == "ce"
            and self.tokens is None
            and not any(k.startswith("target:") for k in self.arrays or {})
        ):
            raise InputError(  # every output would score nothing: a run that trains nothing, silently
                "--loss ce scores the logits against labels, and "
                + ("this file has no target:<output> array" if path else "synthetic inputs have none")
                + ": give --data, a token file or an .npz with target:<output> labels",
                source=path or graph.source,
            )

    def batch(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        B = self.mini_batch
        if self.tokens is not None:
            ids, logits, windows = self.tokens
            tokens, labels = windows.batch(step, B)
            return {ids: tokens.astype(self.specs[ids][1])}, {logits: labels}
        if self.arrays is not None:
            n = next(iter(self.arrays.values())).shape[0] // B
            lo = (step % n) * B
            inputs = {k: v[lo : lo + B] for k, v in self.arrays.items() if not k.startswith("target:")}
            targets = {k[7:]: v[lo : lo + B] for k, v in self.arrays.items() if k.startswith("target:")}
            return inputs, targets
        rng = np.random.default_rng([self.seed, step])
        inputs: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in self.specs.items():
            full = (B, *shape[1:])
            if is_floating(dtype):
                inputs[name] = rng.standard_normal(full).astype(dtype)
            elif np.dtype(dtype) == np.bool_:
                inputs[name] = rng.integers(0, 2, full).astype(np.bool_)
            else:
                inputs[name] = rng.integers(0, self.id_range[name], full).astype(dtype)
        return inputs, {}


def _check_graph_loss(graph: Graph) -> None:
    """``--loss graph`` needs exactly one scalar floating-point output: the loss the model computes."""
    scalars = [n for n, info in graph.outputs.items() if info.floating and info.scalar]
    if len(scalars) != 1:
        shapes = ", ".join(
            f"{n} {list(i.shape) if i.shape is not None else '?'}" for n, i in graph.outputs.items()
        )
        raise InputError(
            f"--loss graph trains on the model's own loss, one scalar float output; it has {len(scalars)} "
            f"(outputs: {shapes})",
            source=graph.source,
        )


def _class_ids(name: str, array: np.ndarray, shape: tuple | None, path: str) -> np.ndarray:
    """Cross-entropy labels: integer ids (-100: ignored) below the output's class count (their
    shape is checked on the header, by :func:`load_npz`)."""
    if not np.issubdtype(array.dtype, np.integer):
        raise InputError(
            f"array {name!r} holds {array.dtype}; --loss ce takes integer class ids", source=path
        )
    classes = shape[-1] if shape is not None and isinstance(shape[-1], int) else None
    if (
        classes is not None
        and array.size
        and (array.max() >= classes or array[array != -100].min(initial=0) < 0)
    ):
        raise InputError(
            f"array {name!r} has class ids outside 0..{classes - 1} (and -100, ignored)", source=path
        )
    return array.astype(np.int64)


def _token_windows(
    graph: Graph, path: str, seed: int, vocab: dict[str, int]
) -> tuple[str, str, TokenWindows]:
    """A token file's windows for ``graph``: its one integer ``[batch, sequence]`` input (a fixed
    sequence length) and its ``[batch, sequence, vocab]`` logits."""
    ids = [n for n, info in graph.inputs.items() if not info.floating]
    shape = graph.inputs[ids[0]].shape if len(ids) == 1 else None
    if (
        len(ids) != 1
        or len(graph.inputs) != 1
        or shape is None
        or len(shape) != 2
        or not isinstance(shape[1], int)
    ):
        raise InputError(
            f"a token file feeds a model whose one input is token ids [batch, sequence] of a fixed length "
            f"(plan a dynamic export with --input-shape NAME=BxS); the model has inputs "
            f"{', '.join(f'{n} {graph.inputs[n].shape}' for n in graph.inputs)}",
            source=path,
        )
    logits = [
        n
        for n, info in graph.outputs.items()
        if info.floating and info.shape is not None and len(info.shape) == 3
    ]
    if len(logits) != 1:
        raise InputError(
            "a token file trains next-token prediction: the model needs one [batch, sequence, vocab] "
            f"output; it has {', '.join(graph.outputs)}",
            source=path,
        )
    return ids[0], logits[0], TokenWindows(path, shape[1], vocab[ids[0]], seed)


_ID_PRESERVING = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast")


def _id_range(graph: Graph, name: str) -> int:
    """Rows of the smallest Gather table an integer input indexes (1 when it indexes none), through
    the ops that pass ids on unchanged (an exporter's ``Reshape`` of the ids before the embedding)."""
    rows, seen, frontier = [], {name}, [name]
    while frontier:
        tensor = frontier.pop()
        for c in graph.consumers.get(tensor, ()):
            op = graph.op(c)
            if op.op_type == "Gather" and len(op.inputs) > 1 and op.inputs[1] == tensor:
                if op.inputs[0] in graph.initializers:
                    rows.append(graph.initializers[op.inputs[0]].shape[op.attributes.get("axis", 0)])
            elif op.op_type in _ID_PRESERVING and op.inputs[0] == tensor and op.outputs[0] not in seen:
                seen.add(op.outputs[0])
                frontier.append(op.outputs[0])
    return max(1, min(rows)) if rows else 1


def load_npz(path: str, graph: Graph, mini_batch: int, loss: str = "mse") -> dict[str, np.ndarray]:
    """The arrays of a data file, checked against ``graph`` (every input present, sample shapes,
    ``target:<output>`` names) and cast to its dtypes; InputError naming the file otherwise. Under
    ``loss="ce"`` a target holds integer class ids, one per output row without its last (class) axis.
    Shapes are checked on the arrays' headers, before any is read; other arrays are never read."""
    rows: set[int] = set()

    def wanted(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> bool:
        if name.startswith("target:"):
            if name[7:] not in graph.outputs:
                raise InputError(f"{name!r} names no model output", source=path)
            info, ce = graph.outputs[name[7:]], loss == "ce"
            wants = f"{'cross-entropy labels of ' if ce else ''}the model's output {name[7:]!r}"
            wants += f" of shape {list(info.shape)} have" if ce else " has"
        elif name in graph.inputs:
            info, ce, wants = graph.inputs[name], False, "the model wants"
        else:
            return False
        if info.shape is not None and shape[1:] != (sample := tuple(info.shape[1 : -1 if ce else None])):
            raise InputError(
                f"array {name!r} has sample shape {list(shape[1:])}, {wants} {list(sample)}", source=path
            )
        rows.add(shape[0] if shape else 0)
        return True

    arrays = read_npz(path, wanted=wanted)
    missing = [n for n in graph.inputs if n not in arrays]
    if missing:
        raise InputError(f"no array for model input(s) {', '.join(missing)}", source=path)
    if len(rows) != 1 or (n := rows.pop()) < mini_batch or n % mini_batch:
        raise InputError(
            f"every array needs the same number of rows, a multiple of the mini-batch {mini_batch}",
            source=path,
        )
    out: dict[str, np.ndarray] = {}
    for name, array in arrays.items():
        if name.startswith("target:"):
            info = graph.outputs[name[7:]]
            if loss == "ce":
                out[name] = _class_ids(name, array, info.shape, path)
                continue
        else:
            info = graph.inputs[name]
        out[name] = array.astype(info.dtype)
    return out
