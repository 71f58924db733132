"""Training checks shared by the corpus's tests: a 1-stage and a forced 2-stage plan of a graph,
launched on 2 CPU ranks, train as one process does (tests/corpus/test_corpus.py's rule)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from tessera.core.errors import InfeasibleError
from tessera.core.graph import Graph
from tessera.core.specs import load_cluster
from tessera.executor.gpp_run import run_gpp_plan
from tessera.executor.launcher import LaunchOptions
from tessera.executor.training import TrainOptions, train_reference
from tessera.planners.pipeline.plan import pipeline_options, plan_gpp


def assert_plans_train_exactly(graph: Graph, path: str) -> None:
    """A 1-stage and a 2-stage plan of ``graph`` (the model file ``path``) train 3 steps as one
    process does."""
    cluster = load_cluster("local-cpu-split")
    one, _, _ = plan_gpp(graph, cluster, pipeline_options(cluster, mini_batch=4), baseline=False)
    two = _two_stage(graph, cluster, max(st.memory.peak for st in one.stages))
    options = TrainOptions(steps=3, lr=0.05, seed=1)
    reference = train_reference(graph, options.steps, 4, seed=options.seed, lr=options.lr)
    exact64 = functools.cache(
        lambda: train_reference(
            graph, options.steps, 4, seed=options.seed, lr=options.lr, dtype=torch.float64
        )
    )
    for plan in (one, two):
        run = run_gpp_plan(plan, graph, path, options, LaunchOptions(timeout_s=120), return_weights=True)
        _assert_trains_like_one_process(run, reference, exact64, f"{len(plan.stages)} stage(s)")


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


def _assert_trains_like_one_process(run, reference, exact64, label: str) -> None:
    """The run's losses and weights are one-process training's (rtol 1e-5). Where they are not,
    float64 training of the same graph arbitrates: the model amplifies fp32 round-off (random
    weights drawn large, lr 0.05), and the run is exact if it lies no farther from float64 than
    one-process fp32 training does (with a 2x margin: both orders of summation are as good)."""
    np.testing.assert_allclose(run.losses[0], reference.losses[0], rtol=1e-5, err_msg=label)
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
