"""Training semantics of a GPP/SPP run, shared by the stage workers and :func:`train_reference`.

Owns the run's options (:class:`TrainOptions`), its mini-batches (:class:`TrainingData`: seeded
synthetic data or an ``.npz`` file), the loss (``Σ_o mean((o − t_o)²)`` over the float outputs,
target 0 unless the data gives ``target:<output>``; :func:`loss_term` is one piece's share) and
plain SGD. :func:`train_reference` trains in one process: the ground truth a plan must reproduce.
See docs/executor.md ("Training semantics").
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from torch import Tensor

from tessera.backends.torch_module import to_torch
from tessera.core.errors import InputError
from tessera.core.files import read_npz
from tessera.core.graph import Graph, load_graph


@dataclass(frozen=True)
class TrainOptions:
    """What one training run does: ``steps`` SGD steps with learning rate ``lr`` on ``data``
    (an ``.npz`` file) or seeded synthetic data."""

    steps: int = 3
    lr: float = 0.01
    seed: int = 0
    data: str | None = None
    compile: bool = False  # stages run torch.compile of their program (launch --compile)


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


def loss_term(output: Tensor, target: Tensor | None, samples: int, mini_batch: int) -> Tensor:
    """This piece's share of ``mean((o − t)²)`` over the mini-batch: ``Σ (o − t)² / (B · n)``,
    ``n`` the elements per sample. Summed over micro-batches and replicas it is the mean."""
    diff = output if target is None else output - target
    per_sample = output.numel() / max(samples, 1)
    return (diff * diff).sum() / (mini_batch * per_sample)


def float_outputs(graph: Graph) -> list[str]:
    """The graph outputs the loss scores: the floating-point ones."""
    return [n for n, info in graph.outputs.items() if np.issubdtype(np.dtype(info.dtype), np.floating)]


@dataclass
class ReferenceRun:
    """The single-process run a plan must reproduce: loss per step (before its update) and the
    weights after the last step, by initializer name."""

    losses: list[float]
    weights: dict[str, np.ndarray]


def train_reference(
    model: str | os.PathLike[str] | bytes | onnx.ModelProto | Graph,
    steps: int,
    mini_batch: int,
    seed: int = 0,
    lr: float = 0.01,
    *,
    data: str | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> ReferenceRun:
    """Train ``model`` for ``steps`` SGD steps on whole mini-batches in this process (see the
    module docstring for data, loss and optimizer): the ground truth of a GPP run."""
    graph = model if isinstance(model, Graph) else load_graph(model, input_shapes=input_shapes)
    module = to_torch(graph.model, label=graph.source)
    params = [p for _, p in module.onnx_parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    source = TrainingData(graph, mini_batch, seed, data)
    outputs = float_outputs(graph)
    losses: list[float] = []
    for step in range(steps):
        inputs, targets = source.batch(step)
        outs = module.run({k: torch.from_numpy(v) for k, v in inputs.items()})
        loss = sum(
            loss_term(outs[o], _tensor_or_none(targets.get(o)), mini_batch, mini_batch) for o in outputs
        )
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        losses.append(float(loss.detach()))  # type: ignore[union-attr]
    weights = {n: p.detach().numpy().copy() for n, p in module.onnx_parameters()}
    return ReferenceRun(losses, weights)


def _tensor_or_none(array: np.ndarray | None, device: torch.device | None = None) -> Tensor | None:
    return None if array is None else torch.from_numpy(array).to(device or "cpu")
