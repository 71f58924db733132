"""The mini-batches a training run draws (:class:`TrainingData`): seeded synthetic data or the
arrays of an ``.npz`` file. Core, so that the stage profiler measures a stage on the very inputs
the stage workers train on. Semantics: docs/executor.md ("Training semantics").
"""

from __future__ import annotations

import numpy as np

from tessera.core.errors import InputError
from tessera.core.files import read_npz
from tessera.core.graph import Graph


class TrainingData:
    """The mini-batches of a run: ``batch(step)`` → (inputs, targets), numpy arrays by name.

    Synthetic data is drawn from ``numpy.random.default_rng([seed, step])``, so every rank and the
    reference draw the same mini-batch without talking. An ``.npz`` file holds one array per graph
    input (and optionally ``target:<output>``) with ``N`` rows, ``N`` a multiple of the mini-batch;
    step ``k`` takes rows ``[(k mod N/B)·B, …+B)``.
    """

    def __init__(self, graph: Graph, mini_batch: int, seed: int = 0, path: str | None = None) -> None:
        self.mini_batch = mini_batch
        self.seed = seed
        self.specs = {name: (info.shape or (1,), info.dtype) for name, info in graph.inputs.items()}
        self.id_range = {name: _id_range(graph, name) for name, (_, dtype) in self.specs.items()}
        self.arrays: dict[str, np.ndarray] | None = None
        if path is not None:
            self.arrays = load_npz(path, graph, mini_batch)

    def batch(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        B = self.mini_batch
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
            if np.issubdtype(np.dtype(dtype), np.floating):
                inputs[name] = rng.standard_normal(full).astype(dtype)
            elif np.dtype(dtype) == np.bool_:
                inputs[name] = rng.integers(0, 2, full).astype(np.bool_)
            else:
                inputs[name] = rng.integers(0, self.id_range[name], full).astype(dtype)
        return inputs, {}


def _id_range(graph: Graph, name: str) -> int:
    """Rows of the smallest Gather table an integer input indexes (1 when it indexes none)."""
    rows = [
        graph.initializers[op.inputs[0]].shape[op.attributes.get("axis", 0)]
        for c in graph.consumers.get(name, ())
        if (op := graph.op(c)).op_type == "Gather"
        and len(op.inputs) > 1
        and op.inputs[1] == name
        and op.inputs[0] in graph.initializers
    ]
    return max(1, min(rows)) if rows else 1


def load_npz(path: str, graph: Graph, mini_batch: int) -> dict[str, np.ndarray]:
    """The arrays of a data file, checked against ``graph`` (every input present, sample shapes,
    ``target:<output>`` names) and cast to its dtypes; InputError naming the file otherwise."""
    arrays = read_npz(path)
    missing = [n for n in graph.inputs if n not in arrays]
    if missing:
        raise InputError(f"no array for model input(s) {', '.join(missing)}", source=path)
    rows = {v.shape[0] if v.ndim else 0 for v in arrays.values()}
    if len(rows) != 1 or (n := rows.pop()) < mini_batch or n % mini_batch:
        raise InputError(
            f"every array needs the same number of rows, a multiple of the mini-batch {mini_batch}",
            source=path,
        )
    out: dict[str, np.ndarray] = {}
    for name, array in arrays.items():
        if name.startswith("target:"):
            if name[7:] not in graph.outputs:
                raise InputError(f"{name!r} names no model output", source=path)
            info, wants = graph.outputs[name[7:]], f"the model's output {name[7:]!r} has"
        elif name in graph.inputs:
            info, wants = graph.inputs[name], "the model wants"
        else:
            continue
        if info.shape is not None and tuple(array.shape[1:]) != tuple(info.shape[1:]):
            raise InputError(
                f"array {name!r} has sample shape {list(array.shape[1:])}, {wants} {list(info.shape[1:])}",
                source=path,
            )
        out[name] = array.astype(info.dtype)
    return out
