"""The table ``tessera launch`` dispatches through: one runner per plan kind.

A runner takes a plan (already checked against its model) and the parsed :class:`LaunchRequest`,
runs it and returns its :class:`~tessera.executor.report.RunReport`. Runners import their
executor lazily: reading the table costs nothing (no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tessera.core.errors import InputError
from tessera.core.graph import Graph
from tessera.core.plans import CpPlan, GppPlan, PlacementPlan, Plan
from tessera.executor.launcher import LaunchOptions
from tessera.executor.report import RunReport


@dataclass(frozen=True)
class LaunchRequest:
    """What ``tessera launch`` was asked, parsed; each runner reads its kind's fields."""

    plan_path: str = "<plan>"
    graph: Graph | None = None  # the plan's model, loaded and checked; None for an --llm cp plan
    launch: LaunchOptions = field(default_factory=LaunchOptions)  # gpp, spp, cp: the workers
    seed: int = 0
    data: str | None = None  # gpp, spp, placement: an .npz of inputs (and targets)
    steps: int = 5  # gpp, spp
    lr: float = 0.01  # gpp, spp
    training: dict[str, Any] = field(default_factory=dict)  # gpp, spp: TrainOptions' other fields
    save_model: str | None = None  # gpp, spp: write the trained model there
    trace: str | None = None  # gpp, spp: write the run's timeline there (trace-event JSON)
    compile: bool = False  # torch.compile every stage's program (gpp, spp) or decode step (cp)
    new_tokens: int = 8  # cp
    prompt_lens: tuple[int, ...] | None = None  # cp
    prompts: tuple[tuple[int, ...], ...] | None = None  # cp: token ids of each request (--prompts)
    attention: str = "torch"  # cp
    repeat: int = 7  # placement


Runner = Callable[[Plan, LaunchRequest], RunReport]


def run_pipeline(plan: Plan, request: LaunchRequest) -> RunReport:
    """A gpp or spp plan: train ``steps`` mini-batches on stage workers."""
    assert isinstance(plan, GppPlan)
    from tessera.executor.gpp_run import run_gpp_plan
    from tessera.executor.training import TrainOptions

    graph = _graph(request)
    options = TrainOptions(
        steps=request.steps,
        lr=request.lr,
        seed=request.seed,
        data=request.data,
        compile=request.compile,
        **request.training,
    )
    save = request.save_model
    run = run_gpp_plan(
        plan,
        graph,
        graph.source,
        options,
        request.launch,
        plan_path=request.plan_path,
        return_weights=bool(save),
        trace=request.trace is not None,
    )
    if request.trace is not None and run.trace is not None:
        from tessera.core.files import write_output
        from tessera.core.plan_files import json_text

        write_output(request.trace, json_text(run.trace))
    if save and run.failure is None:
        from tessera.executor.trained_model import save_trained_model, trained_model

        # the inputs and outputs as the model declares them: it runs at any size the original ran at
        model = trained_model(graph.named_model(), run.weights)
        run.saved_model = [str(p) for p in save_trained_model(model, save)]
    return run


def run_decode(plan: Plan, request: LaunchRequest) -> RunReport:
    """A cp plan: decode its batch greedily on cache-parallel (or TP / DP) workers."""
    assert isinstance(plan, CpPlan)
    from tessera.executor.cp_run import run_cp_plan
    from tessera.executor.decode_worker import DecodeOptions

    options = DecodeOptions(
        new_tokens=request.new_tokens,
        prompt_lens=request.prompt_lens,
        prompts=request.prompts,
        seed=request.seed,
        attention=request.attention,
        step="inductor" if request.compile else "fx",
    )
    model_path = None if request.graph is None else request.graph.source
    return run_cp_plan(plan, model_path, options, request.launch, plan_path=request.plan_path)


def run_placement(plan: Plan, request: LaunchRequest) -> RunReport:
    """A placement plan: time its composite model in this process."""
    assert isinstance(plan, PlacementPlan)
    from tessera.executor.placement import run_placement_plan

    return run_placement_plan(
        plan,
        _graph(request),
        plan_path=request.plan_path,
        repeat=request.repeat,
        data=request.data,
        seed=request.seed,
    )


def _graph(request: LaunchRequest) -> Graph:
    if request.graph is None:
        raise InputError("the plan names no model to run", source=request.plan_path)
    return request.graph


RUNNERS: dict[str, Runner] = {
    "gpp": run_pipeline,
    "spp": run_pipeline,
    "cp": run_decode,
    "placement": run_placement,
}
