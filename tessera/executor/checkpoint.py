"""Training checkpoints (``launch --checkpoint DIR``): each rank's share written with
torch.distributed.checkpoint, a checkpoint complete or absent, and the newest complete one resumed.

``DIR/step-N/`` holds the state after ``N`` steps: every weight and its optimizer state by ONNX name
(a weight several ranks hold — data-parallel replicas, a tied weight's copies — is written once),
the schedule's and the data's position (the step: data and schedule follow from it), each rank's RNG
state, and ``tessera.json`` (what the run was: plan, model, options). The ranks write into
``DIR/.step-N.partial/``; once all have, rank 0 writes ``tessera.json`` and renames the folder to
``step-N``: a killed run leaves only a partial folder, which resuming ignores. Details:
docs/executor.md ("Checkpoints").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.core.errors import InputError

__all__ = ["CheckpointSpec", "latest", "load_state", "resume", "run_identity", "save_state"]

META = "tessera.json"
_STEP = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class CheckpointSpec:
    """What the ranks get: the folder, a checkpoint every ``every`` steps (0: only after the last),
    the run's identity, and where to resume from (``resume``, after ``start`` steps; None: step 0)."""

    folder: str
    every: int
    identity: dict[str, Any]
    resume: str | None = None
    start: int = 0

    def due(self, done: int, steps: int) -> bool:
        """Whether to write a checkpoint after ``done`` steps of ``steps``."""
        return done == steps or (self.every > 0 and done % self.every == 0)


def run_identity(plan_sha256: str, model_sha256: str, options: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the plan, the model and the training options
    that shape the state (the optimizer, its settings, the loss, the data, the seed)."""
    keep = (
        "optimizer",
        "momentum",
        "weight_decay",
        "lr",
        "lr_schedule",
        "warmup_steps",
        "loss",
        "data",
        "seed",
        "precision",
    )
    return {"plan_sha256": plan_sha256, "model_sha256": model_sha256, **{k: options.get(k) for k in keep}}


# What a checkpoint written before a field was recorded means by it.
_WRITTEN_BEFORE = {"precision": "fp32"}


def latest(folder: str | os.PathLike[str], identity: dict[str, Any]) -> tuple[int, Path] | None:
    """The newest complete checkpoint in ``folder`` (None: none yet); InputError naming the folder
    when it is not a folder, or naming what differs when its newest was written by another run."""
    root = Path(folder)
    if root.exists() and not root.is_dir():
        raise InputError("--checkpoint names a file, not a folder", source=str(root))
    found = sorted(
        (int(m.group(1)), p)
        for p in (root.iterdir() if root.is_dir() else ())
        if (m := _STEP.match(p.name)) and (p / META).is_file() and (p / ".metadata").is_file()
    )
    if not found:
        return None
    step, path = found[-1]
    try:
        written = json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {META}: {exc}", source=str(path)) from None
    recorded = {k: written.get(k, _WRITTEN_BEFORE.get(k)) for k in identity}
    differs = [k for k, v in identity.items() if recorded[k] != v]
    if differs:
        what = "; ".join(f"{k}: checkpoint {recorded[k]!r}, this run {identity[k]!r}" for k in differs)
        raise InputError(f"the checkpoint was written by another run ({what})", source=str(path))
    return step, path


def _state(
    named: list[tuple[str, Tensor]],
    optimizer: torch.optim.Optimizer | None,
    rank: int,
    sharded: Sequence[tuple[str, Tensor]] = (),
) -> dict[str, Any]:
    """This rank's state by global names: ``weights/<name>``, ``optimizer/<name>/<key>``, the RNG;
    ``sharded``: a ZeRO shard's optimizer state, under the shard's name (its weights are views of
    ``named``'s)."""
    state: dict[str, Any] = {f"weights/{n}": p.data for n, p in named}
    if optimizer is not None:
        for n, p in [*named, *sharded]:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor):
                    state[f"optimizer/{n}/{key}"] = value
    state[f"rng/rank{rank}"] = torch.get_rng_state()
    return state


def save_state(
    folder: str | os.PathLike[str],
    step: int,
    named: list[tuple[str, Tensor]],
    optimizer: torch.optim.Optimizer | None,
    identity: dict[str, Any],
    sharded: Sequence[tuple[str, Tensor]] = (),
) -> None:
    """Every rank: write this rank's share of the state after ``step`` steps (collective)."""
    rank = dist.get_rank()
    root = Path(folder)
    partial, final = root / f".step-{step}.partial", root / f"step-{step}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a killed run's leftover
    dist.barrier()
    import torch.distributed.checkpoint as dcp  # 1.2 s of imports: paid by runs that checkpoint

    dcp.save(_state(named, optimizer, rank, sharded), checkpoint_id=str(partial))
    dist.barrier()  # every rank's share is written
    if rank == 0:
        (partial / META).write_text(json.dumps({**identity, "step": step}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
    dist.barrier()


def load_state(
    path: str | os.PathLike[str],
    named: list[tuple[str, Tensor]],
    optimizer: torch.optim.Optimizer | None,
    sharded: Sequence[tuple[str, Tensor]] = (),
) -> None:
    """Every rank: load its weights and optimizer state (created as the optimizer's first step
    creates it, then overwritten in place) from the checkpoint at ``path`` (collective)."""
    if optimizer is not None:
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for _, p in [*named, *sharded]:
            if id(p) in stepped:
                optimizer.state[p] = _fresh_state(optimizer, p)
    state = _state(named, optimizer, dist.get_rank(), sharded)
    import torch.distributed.checkpoint as dcp  # 1.2 s of imports: paid by runs that resume

    dcp.load(state, checkpoint_id=str(path))
    torch.set_rng_state(state[f"rng/rank{dist.get_rank()}"])


def resume(
    spec: CheckpointSpec,
    named: list[tuple[str, Tensor]],
    optimizer: torch.optim.Optimizer | None,
    schedule: torch.optim.lr_scheduler.LRScheduler | None,
    sharded: Sequence[tuple[str, Tensor]] = (),
) -> int:
    """Every rank: load the checkpoint the run resumes from, if any; the first step to run."""
    if spec.resume is None:
        return 0
    load_state(spec.resume, named, optimizer, sharded)
    if schedule is not None:
        with warnings.catch_warnings():  # stepped without an optimizer step: its position only
            warnings.simplefilter("ignore")
            for _ in range(spec.start):
                schedule.step()
    return spec.start


def _fresh_state(optimizer: torch.optim.Optimizer, p: Tensor) -> dict[str, Tensor]:
    """What torch.optim's first step keeps for ``p`` (the tensors the checkpoint then fills)."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    if isinstance(optimizer, torch.optim.SGD) and optimizer.defaults.get("momentum"):
        return {"momentum_buffer": torch.zeros_like(p)}
    return {}


def stop_on_sigterm() -> threading.Event:
    """A run that writes checkpoints ends on SIGTERM (the launcher's, passed on by the elastic
    agent) after the step in progress, with a checkpoint of it: set here, agreed on by every rank
    after each step (:func:`stop_agreed`), so they all stop after the same one."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    return stop


def leave_stopped() -> NoReturn:
    """End a rank that stopped on SIGTERM once its checkpoint is written. The elastic agent, shutting
    down, waits for its workers to exit, while a worker that returns waits for the agent to collect
    its result, which it never does while shutting down: the stop would last the whole grace period
    (a minute here, past a scheduler's usual 30 s before SIGKILL). Nothing is left to report."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def stop_agreed(stop: threading.Event, world_size: int) -> bool:
    """Whether any rank was asked to stop (one small all-reduce a step, only with --checkpoint)."""
    flag = torch.tensor([1 if stop.is_set() else 0], dtype=torch.int32)
    if world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
