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
from tessera.core.data import TrainingData, load_npz
from tessera.core.graph import Graph, load_graph

__all__ = ["TrainingData", "load_npz"]  # re-exported: the training semantics' data, from core


@dataclass(frozen=True)
class TrainOptions:
    """What one training run does: ``steps`` SGD steps with learning rate ``lr`` on ``data``
    (an ``.npz`` file) or seeded synthetic data."""

    steps: int = 3
    lr: float = 0.01
    seed: int = 0
    data: str | None = None
    compile: bool = False  # stages run torch.compile of their program (launch --compile)


def loss_term(output: Tensor, target: Tensor | None, samples: int, mini_batch: int) -> Tensor:
    """This piece's share of ``mean((o − t)²)`` over the mini-batch: ``Σ (o − t)² / (B · n)``,
    ``n`` the elements per sample. Summed over micro-batches and replicas it is the mean."""
    diff = output if target is None else output - target
    per_sample = output.numel() / max(samples, 1)
    return (diff * diff).sum() / (mini_batch * per_sample)


def float_outputs(graph: Graph) -> list[str]:
    """The graph outputs the loss scores: the floating-point ones."""
    return [n for n, info in graph.outputs.items() if info.floating]


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
