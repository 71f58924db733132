"""ZeRO-1 stages (a stage's ``zero``): the replicas keep 1/d of the optimizer state, reduce-scatter
the gradients and all-gather the weights, and train exactly as one process, tied weights, clipping
and checkpoints included."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from executor.plans import make_plan, save_model
from onnx_builders import tied_chain

from tessera.executor.gpp_run import run_gpp_plan
from tessera.executor.launcher import LaunchOptions
from tessera.executor.training import TrainOptions, train_reference

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-5, 1e-6
ADAMW = TrainOptions(
    steps=12, lr=0.05, seed=3, optimizer="adamw", weight_decay=0.1, lr_schedule="cosine",
    warmup_steps=2, max_grad_norm=0.05,
)  # fmt: skip


def _exact(plan, graph, path: Path, options: TrainOptions):
    run = run_gpp_plan(plan, graph, str(path), options, LaunchOptions(timeout_s=60), return_weights=True)
    ref = train_reference(graph, options.steps, plan.mini_batch_size, options=options)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    for name, want in ref.weights.items():
        np.testing.assert_allclose(run.weights[name], want, rtol=RTOL, atol=ATOL, err_msg=name)
    return run


def test_a_zero_stage_of_two_replicas_trains_as_one_process(tmp_path: Path) -> None:
    """One stage on 2 ranks with ZeRO-1: AdamW, a schedule and a global clip that binds (the norm
    summed over the two shards) give one process's losses and weights."""
    path = tmp_path / "tied.onnx"
    graph = save_model(tied_chain(width=16), path)
    plan = make_plan(graph, [(graph.order, ["d0", "d1"], 4)], 8, zero=[0])
    assert plan.stages[0].zero == 1
    run = _exact(plan, graph, path, ADAMW)
    assert run.to_json()["stages"][0]["zero"] == 1
    unclipped = train_reference(graph, ADAMW.steps, 8, options=replace(ADAMW, max_grad_norm=None))
    assert not np.allclose(run.losses, unclipped.losses, rtol=1e-3)  # the clipping binds
    # Each replica held half the optimizer state: the plan says so, and validate agrees.
    whole = make_plan(graph, [(graph.order, ["d0", "d1"], 4)], 8)
    state = 12 * sum(i.numel for i in graph.initializers.values())  # Adam, mixed: master + 2 moments
    assert whole.stages[0].memory.optimizer - plan.stages[0].memory.optimizer == state // 2


@pytest.mark.parametrize("zero", [[1], [0, 1]], ids=["3-ranks", "4-ranks"])
def test_zero_beside_a_tied_weight_and_another_stage_trains_as_one_process(tmp_path: Path, zero) -> None:
    """Two stages, ZeRO-1 on 2 replicas of the second (3 ranks) or of both (4 ranks), the tied
    weight read by both (its state kept whole, its gradient summed over every rank of both):
    one process's losses and weights, with SGD and momentum."""
    path = tmp_path / "tied.onnx"
    graph = save_model(tied_chain(), path)
    first = ["d0", "d3"] if 0 in zero else ["d0"]
    plan = make_plan(graph, [(graph.order[:6], first, 2), (graph.order[6:], ["d1", "d2"], 2)], 8, zero=zero)
    _exact(plan, graph, path, replace(ADAMW, optimizer="sgd", momentum=0.9, weight_decay=None))


def test_a_zero_run_resumes_exactly(tmp_path: Path) -> None:
    """Each replica checkpoints its shard's optimizer state; the resumed run's losses and weights
    are the whole run's."""
    path = tmp_path / "tied.onnx"
    graph = save_model(tied_chain(width=16), path)
    plan = make_plan(graph, [(graph.order, ["d0", "d1"], 4)], 8, zero=[0])
    folder = tmp_path / "ckpt"
    options = replace(ADAMW, steps=6, checkpoint=str(folder), checkpoint_every=3)
    whole = run_gpp_plan(plan, graph, str(path), options, LaunchOptions(timeout_s=60), return_weights=True)
    shutil.rmtree(folder / "step-6")
    resumed = run_gpp_plan(
        plan,
        graph,
        str(path),
        replace(options, resume=True),
        LaunchOptions(timeout_s=60),
        return_weights=True,
    )
    assert resumed.losses == whole.losses[3:]
    for name, want in whole.weights.items():
        np.testing.assert_array_equal(resumed.weights[name], want, err_msg=name)


def _mixed_dtype_mlp() -> onnx.ModelProto:
    """bf16 products around an fp32 gain (a bf16 export keeps its norms' weights in fp32)."""
    import ml_dtypes
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.normal(size=(8, 16)).astype(ml_dtypes.bfloat16), "w1"),
        numpy_helper.from_array(rng.normal(1.0, 0.2, size=16).astype(np.float32), "gain"),
        numpy_helper.from_array(rng.normal(size=(16, 8)).astype(ml_dtypes.bfloat16), "w2"),
    ]
    nodes = [
        helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
        helper.make_node("MatMul", ["xb", "w1"], ["h"]),
        helper.make_node("Cast", ["h"], ["hf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["hf", "gain"], ["g"]),
        helper.make_node("Tanh", ["g"], ["t"]),
        helper.make_node("Cast", ["t"], ["tb"], to=TensorProto.BFLOAT16),
        helper.make_node("MatMul", ["tb", "w2"], ["yb"]),
        helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "mixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("zero", [[], [0]], ids=["all-reduce", "zero-1"])
def test_bf16_weights_beside_fp32_ones_train_on_two_replicas_in_their_own_dtypes(
    tmp_path: Path, zero
) -> None:
    """Gradients and ZeRO shards are flat buffers of one dtype each: bf16 weights and an fp32 gain
    each keep their dtype (a buffer of the first weight's dtype failed the backward, or silently
    rounded the gain to bf16) and train as one process does, to bf16's rounding."""
    import ml_dtypes

    path = tmp_path / "mixed.onnx"
    graph = save_model(_mixed_dtype_mlp(), path)
    plan = make_plan(graph, [(graph.order, ["d0", "d1"], 2)], 4, zero=zero)
    options = TrainOptions(steps=3, lr=0.05, seed=1, loss="mse")
    run = run_gpp_plan(plan, graph, str(path), options, LaunchOptions(timeout_s=60), return_weights=True)
    ref = train_reference(graph, options.steps, 4, options=options)
    assert {n: w.dtype for n, w in run.weights.items()} == {
        "w1": ml_dtypes.bfloat16, "gain": np.float32, "w2": ml_dtypes.bfloat16,
    }  # fmt: skip
    start = onnx.numpy_helper.to_array(_mixed_dtype_mlp().graph.initializer[1])
    assert start.dtype == np.float32 and not np.allclose(run.weights["gain"], start)  # trained
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-2)
    for name, want in ref.weights.items():  # the replicas' bf16 gradients summed: a rounding more
        np.testing.assert_allclose(
            run.weights[name].astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-2, err_msg=name
        )
    # the gain's update is fp32's: only bf16's rounding of what flows into it parts it from one process
    np.testing.assert_allclose(run.weights["gain"], ref.weights["gain"], rtol=1e-2)
