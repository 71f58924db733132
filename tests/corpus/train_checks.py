"""Training checks shared by the corpus's tests: a 1-stage and a forced 2-stage plan of a graph,
launched on 2 CPU ranks, train as one process does (tests/corpus/test_corpus.py's rule)."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import torch

from tessera.core.errors import InfeasibleError
from tessera.core.graph import Graph
from tessera.core.specs import load_cluster
from tessera.executor.gpp_run import run_gpp_plan
from tessera.executor.launcher import LaunchOptions
from tessera.executor.training import TrainOptions, train_reference
from tessera.planners.pipeline.plan import pipeline_options, plan_gpp


def assert_plans_train_exactly(graph: Graph, path: str, stages: tuple[int, ...] = (1, 2)) -> None:
    """A 1-stage and a 2-stage plan of ``graph`` (the model file ``path``; those of ``stages``) train
    3 steps as one process does."""
    cluster = load_cluster("local-cpu-split")
    one, _, _ = plan_gpp(graph, cluster, pipeline_options(cluster, mini_batch=4), baseline=False)
    plans = {1: one}
    if 2 in stages:
        plans[2] = _two_stage(graph, cluster, max(st.memory.peak for st in one.stages))
    options = TrainOptions(steps=3, lr=0.05, seed=1)
    reference = train_reference(graph, options.steps, 4, seed=options.seed, lr=options.lr)
    while max(reference.losses) > 10 * reference.losses[0]:
        # one process diverges (weights drawn large: BLOOM's at std 1): chaos amplifies round-off
        # without bound, and no comparison means anything there; a smaller step does not diverge
        options = TrainOptions(steps=3, lr=options.lr / 10, seed=1)
        reference = train_reference(graph, options.steps, 4, seed=options.seed, lr=options.lr)
    exact64 = functools.cache(
        lambda: train_reference(
            graph, options.steps, 4, seed=options.seed, lr=options.lr, dtype=torch.float64
        )
    )
    # the first step's loss is one forward's: split into micro-batches it rounds as its dtype does
    first = max(float(ml_dtypes.finfo(i.dtype).eps) for i in graph.outputs.values() if i.floating)
    for plan in (plans[n] for n in stages):
        run = run_gpp_plan(plan, graph, path, options, LaunchOptions(timeout_s=120), return_weights=True)
        _assert_trains_like_one_process(
            run, reference, exact64, f"{len(plan.stages)} stage(s)", max(first, 1e-5)
        )


def _two_stage(graph, cluster, one_stage_peak: int):
    """--devices 2 with a memory limit below the one-stage plan's peak: a plan of 2 stages."""
    for share in (0.75, 0.6, 0.5, 0.4, 0.3):
        options = pipeline_options(cluster, mini_batch=4, devices=2, memory_limit=int(one_stage_peak * share))
        try:
            plan, _, _ = plan_gpp(graph, cluster, options, baseline=False)
        except InfeasibleError:
            break
        if len(plan.stages) == 2:
            return plan
    raise AssertionError("no memory limit gave a 2-stage plan")


def _farthest(weights: dict[str, np.ndarray], truth: dict[str, np.ndarray]) -> float:
    """The largest difference of any weight from ``truth``'s, relative to that weight's largest value."""
    return max(float(np.abs(weights[n] - w).max() / max(np.abs(w).max(), 1e-12)) for n, w in truth.items())


def _assert_trains_like_one_process(run, reference, exact64, label: str, first_rtol: float) -> None:
    """The run's losses and weights are one-process training's (rtol 1e-5). Where they are not,
    float64 training of the same graph arbitrates: the model amplifies fp32 round-off (random
    weights drawn large, lr 0.05; a bf16 model rounds at every operator), and the run is exact if
    it lies no farther from float64 than one-process training does (with a 2x margin: both orders
    of summation are as good). The first loss agrees to ``first_rtol`` (its dtype's rounding)."""
    np.testing.assert_allclose(run.losses[0], reference.losses[0], rtol=first_rtol, err_msg=label)
    try:
        np.testing.assert_allclose(run.losses, reference.losses, rtol=1e-5, err_msg=label)
        for name, want in reference.weights.items():
            np.testing.assert_allclose(run.weights[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    except AssertionError:
        truth = exact64()
        fp32_error = _farthest(reference.weights, truth.weights)
        assert _farthest(run.weights, truth.weights) <= 2 * fp32_error + 1e-6, label
        loss_error = np.abs(np.subtract(reference.losses, truth.losses))
        assert np.all(
            np.abs(np.subtract(run.losses, truth.losses)) <= 2 * loss_error + 1e-5 * np.abs(truth.losses)
        ), label
