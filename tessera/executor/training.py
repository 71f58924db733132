"""Training semantics of a GPP/SPP run, shared by the stage workers and :func:`train_reference`.

Owns the run's options (:class:`TrainOptions`), its mini-batches (:class:`TrainingData`: seeded
synthetic data or an ``.npz`` file), the loss (``Σ_o mean((o − t_o)²)`` over the float outputs,
target 0 unless the data gives ``target:<output>``; :func:`loss_term` is one piece's share), the
optimizer and its learning-rate schedule (:func:`make_optimizer`: torch.optim). :func:`train_reference`
trains in one process: the ground truth a plan must reproduce.
See docs/executor.md ("Training semantics").
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from torch import Tensor

from tessera.backends.torch_module import to_torch
from tessera.backends.torch_ops import to_numpy
from tessera.backends.torch_optim import torch_optimizer
from tessera.core.data import TrainingData, load_npz
from tessera.core.graph import Graph, load_graph

__all__ = ["TrainingData", "load_npz"]  # re-exported: the training semantics' data, from core


SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class TrainOptions:
    """What one training run does: ``steps`` optimizer steps on ``data`` (an ``.npz`` file) or
    seeded synthetic data. The optimizer (torch.optim's ``sgd``, ``adamw`` or ``adam``) at peak
    learning rate ``lr``, ``weight_decay`` (None: the optimizer's default) and ``momentum`` (SGD);
    the rate warms up linearly over ``warmup_steps``, then follows ``lr_schedule`` down to 0 at the
    last step (``constant``: stays); gradients clipped to the global norm ``max_grad_norm``; the
    products computed in ``precision`` (:mod:`tessera.backends.precision`)."""

    steps: int = 3
    lr: float = 0.01
    seed: int = 0
    data: str | None = None
    compile: bool = False  # stages run torch.compile of their program (launch --compile)
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float | None = None
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float | None = None
    loss: str = "mse"  # "ce": cross-entropy against labels (token files: next-token labels); "graph"
    checkpoint: str | None = None  # a folder of checkpoints (executor/checkpoint.py)
    checkpoint_every: int = 0  # steps between checkpoints (0: after the last step only)
    resume: bool = False  # continue from the newest complete checkpoint in ``checkpoint``
    precision: str = "fp32"  # "bf16": products in bf16 (backends/precision.py)

    def describe(self) -> str:
        """``AdamW(lr=0.001, weight_decay=0.01, cosine, warmup 3, clip 1, bf16)`` as the report prints it."""
        name = {"sgd": "SGD", "adamw": "AdamW", "adam": "Adam"}[self.optimizer]
        parts = [f"lr={self.lr:g}"]
        if self.momentum:
            parts.append(f"momentum={self.momentum:g}")
        if self.weight_decay is not None:
            parts.append(f"weight_decay={self.weight_decay:g}")
        if self.lr_schedule != "constant":
            parts.append(self.lr_schedule)
        if self.warmup_steps:
            parts.append(f"warmup {self.warmup_steps}")
        if self.max_grad_norm is not None:
            parts.append(f"clip {self.max_grad_norm:g}")
        if self.precision != "fp32":
            parts.append(self.precision)
        return f"{name}({', '.join(parts)})"


def make_optimizer(
    params: list[Tensor], options: TrainOptions
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The run's optimizer over ``params`` and its schedule (stepped once per optimizer step): the
    same objects in one process and on every stage, so each weight takes the same updates."""
    opt = torch_optimizer(
        options.optimizer, params, lr=options.lr, momentum=options.momentum, weight_decay=options.weight_decay
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, options))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """The bytes of ``optimizer``'s state tensors (Adam's moments, SGD's momentum buffers)."""
    if optimizer is None:
        return 0
    states = optimizer.state.values()
    return sum(
        v.numel() * v.element_size() for s in states for v in s.values() if isinstance(v, Tensor) and v.dim()
    )


def lr_factor(step: int, options: TrainOptions) -> float:
    """The learning rate of optimizer step ``step`` (0-based) over the peak: linear warm-up to 1 over
    ``warmup_steps``, then ``lr_schedule`` from 1 to 0 at the last step."""
    warmup = options.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if options.lr_schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, options.steps - warmup)
    if options.lr_schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


LOSSES = ("mse", "ce", "graph")
IGNORED = -100  # a cross-entropy label that counts for nothing (torch's ignore_index)


def labelled(targets: Mapping[str, np.ndarray]) -> int:
    """The cross-entropy labels of a whole mini-batch (those not ``IGNORED``): its mean's divisor."""
    return int(sum(np.count_nonzero(t != IGNORED) for t in targets.values()))


def loss_term(
    output: Tensor,
    target: Tensor | None,
    samples: int,
    mini_batch: int,
    *,
    kind: str = "mse",
    labels: int = 0,
) -> Tensor | None:
    """This piece's share of the mini-batch's loss; summed over micro-batches and replicas it is the
    loss. ``mse``: ``Σ (o − t)² / (B · n)``, ``n`` the elements per sample (target 0 when None).
    ``ce``: the cross-entropy of logits ``output`` (classes last) against integer ``target``, summed,
    over ``labels``, the mini-batch's labels (None: an output without labels scores nothing).
    ``graph``: the model's one scalar output, the mean loss of the ``samples`` it was given (an
    exported training graph's loss), weighted by its share of the mini-batch; other outputs score
    nothing."""
    if kind == "graph":
        return output.reshape(()) * (samples / mini_batch) if output.numel() == 1 else None
    if kind == "ce":
        if target is None:
            return None
        logits = output.reshape(-1, output.shape[-1]).float()
        total = torch.nn.functional.cross_entropy(
            logits, target.reshape(-1).long(), reduction="sum", ignore_index=IGNORED
        )
        return total / max(labels, 1)
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
    options: TrainOptions | None = None,
    dtype: torch.dtype = torch.float32,
) -> ReferenceRun:
    """Train ``model`` for ``steps`` steps on whole mini-batches in this process (see the module
    docstring for data, loss and optimizer; ``options``, when given, for the optimizer, schedule and
    clipping, else SGD at ``lr``): the ground truth of a GPP run. ``dtype=torch.float64`` trains
    the same graph in double precision, the arbiter of fp32 round-off on ill-conditioned models."""
    from tessera.backends.torch_optim import global_norm_clip

    options = options or TrainOptions(steps=steps, lr=lr, seed=seed, data=data)
    graph = model if isinstance(model, Graph) else load_graph(model)
    # the float64 arbiter computes every operator in float64, the graph's own casts included; else
    # a model's own dtypes (bf16 weights) stay
    precision = "fp64" if dtype == torch.float64 else options.precision
    module = to_torch(graph.model, label=graph.source, precision=precision)
    if dtype != torch.float32:
        module = module.to(dtype)
    params = [p for _, p in module.onnx_parameters()]
    opt, schedule = make_optimizer(params, options)
    source = TrainingData(graph, mini_batch, options.seed, options.data, options.loss)
    outputs = float_outputs(graph)
    losses: list[float] = []
    for step in range(options.steps):
        inputs, targets = source.batch(step)
        outs = module.run({k: _float_as(torch.from_numpy(v), dtype) for k, v in inputs.items()})
        count = labelled(targets)
        terms = [
            loss_term(
                outs[o],
                _float_as(_tensor_or_none(targets.get(o)), dtype),
                mini_batch,
                mini_batch,
                kind=options.loss,
                labels=count,
            )
            for o in outputs
        ]
        loss = sum(t for t in terms if t is not None)
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        if options.max_grad_norm is not None:
            global_norm_clip(params, params, options.max_grad_norm)
        opt.step()
        schedule.step()
        losses.append(float(loss.detach()))  # type: ignore[union-attr]
    weights = {n: to_numpy(p).copy() for n, p in module.onnx_parameters()}
    return ReferenceRun(losses, weights)


def _float_as(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return t.to(dtype) if t is not None and t.is_floating_point() else t


def _tensor_or_none(array: np.ndarray | None, device: torch.device | None = None) -> Tensor | None:
    return None if array is None else torch.from_numpy(array).to(device or "cpu")
