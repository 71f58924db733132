"""Exactness: k steps of a GPP plan on gloo ranks give the loss and weights of single-process training.

Tolerance (fp32): losses and weights within rtol 1e-5, weights also atol 1e-6 (zero-initialized
biases move by ~1e-4; summing micro-batch gradients in another order changes the last bits).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from executor.plans import candle_dag, make_plan, save_model
from onnx_builders import head_major_chain, shape_passing_chain, tied_chain

from tessera.cli.launch_cmd import _summary
from tessera.core.graph import load_graph
from tessera.core.plans import TrainingSetup
from tessera.executor.gpp_run import run_gpp_plan
from tessera.executor.launcher import LaunchOptions
from tessera.executor.training import TrainOptions, train_reference
from tessera.models import build

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-5, 1e-6


def _check_exact(plan, graph, path: Path, options: TrainOptions, atol: float = ATOL):
    run = run_gpp_plan(plan, graph, str(path), options, LaunchOptions(timeout_s=60), return_weights=True)
    ref = train_reference(
        graph, options.steps, plan.mini_batch_size, seed=options.seed, lr=options.lr, options=options
    )
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
    assert run.losses[-1] != run.losses[0]  # the weights moved
    assert set(run.weights) == set(ref.weights)
    for name, want in ref.weights.items():
        np.testing.assert_allclose(run.weights[name], want, rtol=RTOL, atol=atol, err_msg=name)
    report = run.to_json()
    assert [s["step"] for s in report["steps"]] == list(range(options.steps))
    assert len(report["stages"]) == len(plan.stages)
    for st in report["stages"]:
        assert st["busy_s"] > 0 and st["peak_rss_bytes"] > 0 and st["busy_ratio"] > 0
    assert report["ratio"]["iteration_time"] > 0
    return run


def test_multi_branch_dag_with_data_parallel_merge_and_mixed_micro_batches(tmp_path: Path) -> None:
    """candle_uno: branches 0–3 (micro-batch 2) and 4–6 (micro-batch 4) feed the merge stage, which
    runs on 2 data-parallel replicas with micro-batch 2: 4 gloo ranks."""
    path = tmp_path / "candle.onnx"
    graph = save_model(build("candle_uno", "tiny", 0), path)
    a, b, c = candle_dag(graph)
    plan = make_plan(graph, [(a, ["d0"], 2), (b, ["d1"], 4), (c, ["d2", "d3"], 2)], 8)
    _check_exact(plan, graph, path, TrainOptions(steps=3, lr=0.05, seed=1))


def test_chain_with_a_batchless_tensor_and_mixed_micro_batches(tmp_path: Path) -> None:
    """gpt: the embedding gathers | the decoder (2 gloo ranks); the position embedding crosses
    the cut as one batch-less tensor, and the micro-batches are 2 and 4."""
    path = tmp_path / "gpt.onnx"
    graph = save_model(build("gpt", "tiny", 0), path)
    plan = make_plan(graph, [(graph.order[:2], ["d0"], 2), (graph.order[2:], ["d1"], 4)], 8)
    _check_exact(plan, graph, path, TrainOptions(steps=3, lr=0.05, seed=2))


@pytest.mark.parametrize("micro_batches", [(2, 8), (4, 2)], ids=["joined", "split"])
def test_a_tensor_with_its_batch_on_axis_1_crosses_the_cut(
    tmp_path: Path, micro_batches: tuple[int, int]
) -> None:
    """A head-major ``[heads, batch, d]`` tensor (Falcon's fused QKV split by head) crosses to 2
    data-parallel replicas: its messages carry rows of axis 1, joined from several micro-batches
    or split between replicas, and its gradients go back into those rows."""
    path = tmp_path / "heads.onnx"
    graph = save_model(head_major_chain(), path)
    first, second = micro_batches
    plan = make_plan(graph, [(graph.order[:4], ["d0"], first), (graph.order[4:], ["d1", "d2"], second)], 8)
    _check_exact(plan, graph, path, TrainOptions(steps=3, lr=0.05, seed=3))


def test_recomputed_activations_train_exactly_and_keep_less(tmp_path: Path) -> None:
    """A plan whose stages 0 and 2 recompute their activations (as ``--recompute auto`` chooses
    per stage): those ranks' forwards keep only their inputs and outputs and run again in the
    backward (torch.utils.checkpoint); the losses and weights are single-process training's, the
    recomputing stages keep fewer activation bytes and stage 1 keeps as many as before."""
    path = tmp_path / "candle.onnx"
    graph = save_model(build("candle_uno", "tiny", 0), path)
    a, b, c = candle_dag(graph)
    plan = make_plan(graph, [(a, ["d0"], 2), (b, ["d1"], 4), (c, ["d2"], 2)], 8)
    again = plan.model_copy(
        update={
            "training": TrainingSetup(recompute="auto"),
            "stages": [st.model_copy(update={"recompute": st.id != 1}) for st in plan.stages],
        }
    )
    options = TrainOptions(steps=2, lr=0.05, seed=3)
    runs = [
        run_gpp_plan(p, graph, str(path), options, LaunchOptions(timeout_s=60), return_weights=True)
        for p in (plan, again)
    ]
    ref = train_reference(
        graph, options.steps, plan.mini_batch_size, seed=options.seed, lr=options.lr, options=options
    )
    for run in runs:
        np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)
        for name, want in ref.weights.items():
            np.testing.assert_allclose(run.weights[name], want, rtol=RTOL, atol=ATOL, err_msg=name)
    assert [st["recompute"] for st in runs[1].to_json()["stages"]] == [True, False, True]
    text = _summary(runs[1].to_json()).splitlines()  # what launch prints without --json
    header = next(i for i, line in enumerate(text) if line.lstrip().startswith("stage"))
    assert text[header].endswith("recompute")
    assert [line.split()[-1] for line in text[header + 1 : header + 4]] == ["yes", "no", "yes"]
    assert "recompute" not in _summary(runs[0].to_json())  # no column where no stage recomputes
    kept = [[st["peak_activation_bytes"] for st in run.to_json()["stages"]] for run in runs]
    assert kept[1][0] < kept[0][0] and kept[1][2] < kept[0][2] and kept[1][1] == kept[0][1], kept


def test_a_plan_on_the_rewritten_model_trains_the_model_it_was_rewritten_from(tmp_path: Path) -> None:
    """``--rewrite concat-matmul``: the merge layer's per-branch parts run on the branches' stages
    (two gloo ranks), the Sum and the top MLP on a third. The workers rewrite the model file as the
    plan records; losses are single-process training's of the original model, and each part's
    trained weight is its columns of the original layer's trained weight."""
    path = tmp_path / "candle.onnx"
    save_model(build("candle_uno", "tiny", 0), path)
    graph = load_graph(path, rewrites=["concat-matmul"])
    parts = [n for n in graph.order if "/part" in n]
    a = [n for n in graph.order if n.startswith(("branch0/", "branch1/", "branch2/", "branch3/"))] + parts[:4]
    b = [n for n in graph.order if n.startswith(("branch4/", "branch5/", "branch6/"))] + parts[4:]
    rest = [n for n in graph.order if n not in set(a) | set(b)]
    plan = make_plan(graph, [(a, ["d0"], 2), (b, ["d1"], 4), (rest, ["d2"], 2)], 8)
    assert plan.model.rewrites == ["concat-matmul"]
    options = TrainOptions(steps=3, lr=0.05, seed=1)
    run = _check_exact(plan, graph, path, options)
    original = train_reference(load_graph(path), options.steps, 8, seed=options.seed, lr=options.lr)
    np.testing.assert_allclose(run.losses, original.losses, rtol=RTOL)
    weight = "top/layer0/fc/weight"
    cut = np.concatenate([run.weights[f"{weight}/part{i}"] for i in range(7)], axis=1)
    np.testing.assert_allclose(cut, original.weights[weight], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("replicas", [1, 2], ids=["2-stages", "2-stages-dp2"])
def test_a_weight_read_by_two_stages_trains_as_one(tmp_path: Path, replicas: int) -> None:
    """The tied weight's copies in stage 0 and stage 1 (and its data-parallel replicas) get the
    sum of all their gradients: losses and weights equal single-process training."""
    path = tmp_path / "tied.onnx"
    graph = save_model(tied_chain(), path)
    assert graph.shared_weights([graph.order[:6], graph.order[6:]]) == {"tied": [0, 1]}
    second = ["d1", "d2"][:replicas]
    plan = make_plan(graph, [(graph.order[:6], ["d0"], 2), (graph.order[6:], second, 2)], 8)
    _check_exact(plan, graph, path, TrainOptions(steps=4, lr=0.1, seed=2))


@pytest.mark.parametrize("replicas", [1, 2], ids=["2-stages", "2-stages-dp2"])
def test_adamw_with_a_schedule_and_global_clipping_trains_as_one_process(
    tmp_path: Path, replicas: int
) -> None:
    """AdamW, linear warm-up then cosine decay, gradients clipped to a global norm that binds: the
    norm counts every weight once (a weight two stages hold, a stage's data-parallel replicas), so
    20 steps of the plan give single-process training's losses and weights."""
    path = tmp_path / "tied.onnx"
    graph = save_model(tied_chain(), path)
    second = ["d1", "d2"][:replicas]
    plan = make_plan(graph, [(graph.order[:6], ["d0"], 2), (graph.order[6:], second, 2)], 8)
    options = TrainOptions(
        steps=20, lr=0.05, seed=3, optimizer="adamw", weight_decay=0.1, lr_schedule="cosine",
        warmup_steps=3, max_grad_norm=0.05,
    )  # fmt: skip
    run = _check_exact(plan, graph, path, options)
    unclipped = train_reference(graph, 20, 8, seed=3, options=replace(options, max_grad_norm=None))
    assert not np.allclose(run.losses, unclipped.losses, rtol=1e-3)  # the clipping binds
    assert (
        run.to_json()["training"]["optimizer"]
        == "AdamW(lr=0.05, weight_decay=0.1, cosine, warmup 3, clip 0.05)"
    )


def test_a_decoder_trains_on_a_token_file_with_cross_entropy_as_one_process(tmp_path: Path) -> None:
    """The zoo GPT over 2 stages (micro-batches 2 and 4) on windows of a token file, next-token
    cross-entropy, AdamW with warm-up, cosine decay and clipping: one process's losses and weights,
    and the loss falls. Weights to 1e-5 absolute: Adam normalizes a gradient that is only rounding
    noise (the K projection's bias: softmax ignores a shift common to all keys) to steps of 1e-6."""
    path = tmp_path / "gpt.onnx"
    graph = save_model(build("gpt", "tiny", 0), path)
    tokens = tmp_path / "text.npy"
    text = Path(__file__).read_bytes()[:8000]
    np.save(tokens, np.frombuffer(text, dtype=np.uint8).astype(np.int64) % 128)
    plan = make_plan(graph, [(graph.order[:2], ["d0"], 2), (graph.order[2:], ["d1"], 4)], 8)
    options = TrainOptions(
        steps=12, lr=3e-3, seed=2, data=str(tokens), loss="ce", optimizer="adamw", lr_schedule="cosine",
        warmup_steps=3, max_grad_norm=1.0,
    )  # fmt: skip
    run = _check_exact(plan, graph, path, options, atol=1e-5)
    assert run.losses[-1] < run.losses[0] - 0.3


def test_cross_entropy_labels_with_ignored_positions_average_over_the_labelled(tmp_path: Path) -> None:
    path = tmp_path / "gpt.onnx"
    graph = save_model(build("gpt", "tiny", 0), path)
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 128, size=(16, 16))
    labels[rng.random(labels.shape) < 0.3] = -100
    data = tmp_path / "data.npz"
    np.savez(data, input_ids=rng.integers(0, 128, size=(16, 16)), **{"target:logits": labels})
    plan = make_plan(graph, [(graph.order[:2], ["d0"], 2), (graph.order[2:], ["d1"], 4)], 8)
    _check_exact(plan, graph, path, TrainOptions(steps=4, lr=0.01, seed=0, data=str(data), loss="ce"))


def test_sgd_with_momentum_on_a_dag_trains_as_one_process(tmp_path: Path) -> None:
    path = tmp_path / "candle.onnx"
    graph = save_model(build("candle_uno", "tiny", 0), path)
    a, b, c = candle_dag(graph)
    plan = make_plan(graph, [(a, ["d0"], 2), (b, ["d1"], 4), (c, ["d2", "d3"], 2)], 8)
    options = TrainOptions(steps=6, lr=0.02, seed=1, momentum=0.9, lr_schedule="linear", max_grad_norm=1.0)
    _check_exact(plan, graph, path, options)


def test_tensors_of_three_dtypes_cross_to_a_peer_in_one_message(tmp_path: Path) -> None:
    """A Shape (int64), a mask (bool) and an activation (fp32) cross the cut: each micro-batch's
    forward sends them in one message of bytes, and the step trains exactly."""
    path = tmp_path / "shapes.onnx"
    graph = save_model(shape_passing_chain(), path)
    first = ["matmul0", "tanh0", "shape", "greater"]
    plan = make_plan(graph, [(first, ["d0"], 2), ([n for n in graph.order if n not in first], ["d1"], 2)], 8)
    assert {t.name for t in plan.edges[0].tensors} == {"h0", "shape", "mask"}
    run = _check_exact(plan, graph, path, TrainOptions(steps=3, lr=0.1, seed=4))
    # 4 micro-batches: stage 0 sends 4 messages and receives 4 gradients (of h0 alone).
    assert [steps[0]["messages"] for _, steps in sorted(run.rank_steps.items())] == [8, 8]


def _graph_loss_model() -> onnx.ModelProto:
    """A regression training graph: ``pred = relu(x·W1)·W2`` and its own ``loss = mean((pred − y)²)``,
    the labels ``y`` an input, as a training export writes it."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    w1 = numpy_helper.from_array(rng.standard_normal((6, 8)).astype(np.float32) * 0.5, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32) * 0.5, "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["a"], name="act"),
        helper.make_node("MatMul", ["a", "w2"], ["pred"], name="fc2"),
        helper.make_node("Sub", ["pred", "y"], ["d"], name="diff"),
        helper.make_node("Mul", ["d", "d"], ["sq"], name="square"),
        helper.make_node("ReduceMean", ["sq"], ["loss"], name="mean", keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "regression",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [w1, w2],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_models_own_loss_trains_as_one_process_and_as_mse_would(tmp_path: Path) -> None:
    """``--loss graph``: the scalar the model computes is the objective, each micro-batch's mean
    weighted by its share: on 2 stages (the second data-parallel) it trains as one process does, and
    as ``--loss mse`` trains the same model without its loss head against the same labels."""
    path = tmp_path / "train.onnx"
    graph = save_model(_graph_loss_model(), path)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 6)).astype(np.float32), rng.standard_normal((16, 3)).astype(np.float32)
    data = tmp_path / "data.npz"
    np.savez(data, x=x, y=y)
    plan = make_plan(graph, [(graph.order[:3], ["d0"], 2), (graph.order[3:], ["d1", "d2"], 2)], 8)
    options = TrainOptions(steps=5, lr=0.05, seed=0, data=str(data), loss="graph", optimizer="adamw")
    run = _check_exact(plan, graph, path, options)

    head = onnx.load(path)  # the same model, its output the prediction: mse against y
    head.graph.node.pop()
    head.graph.node.pop()
    head.graph.node.pop()
    del head.graph.output[:]
    head.graph.output.append(onnx.helper.make_tensor_value_info("pred", onnx.TensorProto.FLOAT, ["batch", 3]))
    del head.graph.input[1]
    plain = save_model(head, tmp_path / "pred.onnx")
    np.savez(tmp_path / "mse.npz", x=x, **{"target:pred": y})
    mse = replace(options, data=str(tmp_path / "mse.npz"), loss="mse")
    ref = train_reference(plain, 5, 8, seed=0, lr=0.05, options=mse)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=RTOL)


def test_graph_loss_needs_one_scalar_output(tmp_path: Path) -> None:
    from tessera.core.data import TrainingData
    from tessera.core.errors import InputError

    graph = save_model(build("candle_uno", "tiny", 0), tmp_path / "candle.onnx")
    with pytest.raises(
        InputError, match=r"--loss graph trains on the model's own loss, one scalar float output; it has 0"
    ):
        TrainingData(graph, 4, loss="graph")


def test_bf16_products_train_as_one_process_in_bf16(tmp_path: Path) -> None:
    """--precision bf16 on the zoo GPT over 2 stages: with whole mini-batches the plan computes one
    process's bf16 training exactly (the stage boundary carries fp32, so the cut changes nothing),
    which is not fp32's; with micro-batches of 2 and 4 the gradients round per micro-batch, within
    1e-4 of it."""
    path = tmp_path / "gpt.onnx"
    graph = save_model(build("gpt", "tiny", 0), path)
    tokens = tmp_path / "text.npy"
    np.save(tokens, np.frombuffer(Path(__file__).read_bytes()[:8000], dtype=np.uint8).astype(np.int64) % 128)
    half = len(graph.order) // 2
    options = TrainOptions(
        steps=8, lr=3e-3, seed=2, data=str(tokens), loss="ce", optimizer="adamw", warmup_steps=2,
        max_grad_norm=1.0, precision="bf16",
    )  # fmt: skip
    ref = train_reference(graph, 8, 8, options=options)
    fp32 = train_reference(graph, 8, 8, options=replace(options, precision="fp32"))
    assert np.abs(np.array(ref.losses) / fp32.losses - 1).max() > 1e-5  # bf16 rounds
    whole = make_plan(graph, [(graph.order[:half], ["d0"], 8), (graph.order[half:], ["d1"], 8)], 8)
    run = run_gpp_plan(whole, graph, str(path), options, LaunchOptions(timeout_s=60), return_weights=True)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-6)
    for name, want in ref.weights.items():
        np.testing.assert_allclose(run.weights[name], want, rtol=1e-6, atol=1e-6, err_msg=name)
    assert run.to_json()["training"]["precision"].startswith("bf16")
    split = make_plan(graph, [(graph.order[:half], ["d0"], 2), (graph.order[half:], ["d1"], 4)], 8)
    run = run_gpp_plan(split, graph, str(path), options, LaunchOptions(timeout_s=60))
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-4)


def test_a_model_routing_by_its_data_trains_exactly_on_the_planners_two_stages(tmp_path) -> None:
    """NonZero picks a data-dependent number of entries: the planner keeps those tensors inside one
    stage (a stage cannot size a buffer for them), so its 2-stage plan launches and trains exactly."""
    from corpus.train_checks import assert_plans_train_exactly
    from onnx_builders import routed_chain

    path = tmp_path / "routed.onnx"
    graph = save_model(routed_chain(), path)
    assert_plans_train_exactly(graph, str(path))
