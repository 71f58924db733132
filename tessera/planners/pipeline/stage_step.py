"""One step of a pipeline stage as a rank runs it, timed in parts (the data drawn, the
forwards, the backwards, the optimizer step): what ``plan --profile`` measures a stage with
(:mod:`~tessera.planners.pipeline.stage_profile`, and on a tensor-parallel stage's ranks
:mod:`~tessera.planners.pipeline.stage_ranks`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.core.data import TrainingData

if TYPE_CHECKING:
    import torch

    from tessera.backends.torch_module import OnnxModule

__all__ = ["StageProfileOptions", "StageRun", "no_sync", "one_step", "scored", "stage_run"]


@dataclass(frozen=True)
class StageProfileOptions:
    budget_s: float = 0.3  # timed runs per stage and burst stop after this long …
    min_repeats: int = 5  # … and at least this many
    max_repeats: int = 50
    warmup: int = 2
    # Each part's time is the median of the bursts' medians: a burst that another process slowed
    # (a stage once measured 2.6x its time a minute later) is outvoted, not averaged in. A plan's
    # stages take their bursts in turns (see StageProfiler._times).
    bursts: int = 5

    def more(self, steps: int, spent_s: float, warmup: int) -> bool:
        """Whether a burst that took ``steps`` steps in ``spent_s`` (``warmup`` of them left out)
        takes another: until the budget is spent, at least ``min_repeats``, at most ``max_repeats``."""
        return steps < warmup + self.min_repeats or (
            spent_s < self.budget_s and steps < warmup + self.max_repeats
        )


def one_step(run: StageRun, draw: Callable[[], object]) -> tuple[float, float, float]:
    """One step of the stage as a rank runs it: the data drawn, ``actions`` in order (a forward
    with a squared-error loss of the outputs, or the cross-entropy of the model's logits where the
    run's loss is ``ce`` (labels fixed, classes last); a backward accumulating into
    the gradients), the gradients' norm clipped where the run clips, the optimizer's step. Seconds: the mean forward, the mean backward, and the data and
    the optimizer step together (each in the cache state the step leaves them, not in a tight loop
    of its own: measured apart, both ran 30-40% faster than in a step). ``sync`` waits for a GPU's
    queued kernels before each reading of the clock."""
    module, feeds, optimizer, actions, sync = run.module, run.feeds, run.optimizer, run.actions, run.sync
    t0 = time.perf_counter()
    draw()
    own = time.perf_counter() - t0
    forward = backward = 0.0
    losses: dict[str, object] = {}
    for action in actions:
        t0 = time.perf_counter()
        if action[0] == "F":
            # a micro-batch's inputs: leaves of their own, as received buffers are (no copy)
            leaves = [x.detach().requires_grad_(x.requires_grad) for x in feeds]
            terms = [scored(o, ce) for o, ce in zip(module(*leaves), run.cross_entropy, strict=True)]
            loss = sum(s for s in terms if s is not None) if any(s is not None for s in terms) else None
            if loss is not None:
                float(loss.detach())  # the worker reads the loss in its forward
            losses[action[1:]] = loss
            sync()
            forward += time.perf_counter() - t0
        else:
            loss = losses.pop(action[1:])
            if loss is not None:
                loss.backward()  # type: ignore[attr-defined]
            del loss
            sync()
            backward += time.perf_counter() - t0
    t0 = time.perf_counter()
    if run.clip is not None:
        run.clip()
    if optimizer is not None:
        optimizer.step()  # type: ignore[attr-defined]
        optimizer.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    sync()
    own += time.perf_counter() - t0
    micro_batches = max(len(actions) // 2, 1)
    return forward / micro_batches, backward / micro_batches, own


@dataclass
class StageRun:
    """A stage built to be measured: its program, inputs, optimizer, schedule and data."""

    module: OnnxModule
    feeds: list[torch.Tensor]
    optimizer: object
    actions: tuple[str, ...]
    data: TrainingData
    sync: Callable[[], None]
    cross_entropy: tuple[bool, ...]  # per output of the stage: scored by cross-entropy
    clip: Callable[[], object] | None  # the gradients' norm clipped (launch --max-grad-norm)
    step: int = 0


def stage_run(
    module: OnnxModule,
    feeds: list[torch.Tensor],
    actions: tuple[str, ...],
    data: TrainingData,
    *,
    optimizer: str,
    scored_outputs: frozenset[str],
    max_grad_norm: float | None,
    device: str,
) -> StageRun:
    """``module`` on ``device`` made ready to measure: its parameters' ``optimizer`` (torch_optim,
    a negligible learning rate), the outputs in ``scored_outputs`` scored by cross-entropy, the
    gradients' norm clipped to ``max_grad_norm`` where given, a GPU's queue awaited at each clock."""
    import torch

    from tessera.backends.torch_optim import global_norm_clip, torch_optimizer

    params = [p for _, p in module.onnx_parameters()]
    return StageRun(
        module,
        feeds,
        torch_optimizer(optimizer, params, lr=1e-9) if params else None,
        actions,
        data,
        torch.cuda.synchronize if device.startswith("cuda") else no_sync,
        tuple(name in scored_outputs for name in module.output_names),
        (lambda: global_norm_clip(params, params, max_grad_norm))
        if max_grad_norm is not None and params
        else None,
    )


def scored(output: torch.Tensor, cross_entropy: bool) -> torch.Tensor | None:
    """An output's loss as the profile times it (None: it takes no gradient)."""
    import torch

    if not output.requires_grad:
        return None
    if cross_entropy and output.dim() >= 2:
        logits = output.reshape(-1, output.shape[-1]).float()
        labels = torch.arange(logits.shape[0], device=logits.device) % logits.shape[-1]
        return torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / logits.shape[0]
    return (output * output).sum() / output.numel()


def no_sync() -> None:
    pass
