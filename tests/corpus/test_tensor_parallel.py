"""Tensor-parallel stages on the corpus's real exports: the split found by dataflow
(tessera.core.tensor_parallel) covers attention and MLPs of every exporter's form, and t ranks
running their blocks (executor.tensor_parallel) compute what one process computes — outputs, input
gradients, weight gradients — at any micro-batch; a plan of 2 stages × 2 tensor-parallel ranks,
and one of 2 replicas × 2 with ZeRO-1, train exactly as one process."""

from __future__ import annotations

import pytest
from corpus.exports import Corpus
from corpus.tp_ranks import tp_errors
from executor.plans import make_plan

from tessera.core.graph import load_graph
from tessera.core.tensor_parallel import tensor_parallel
from tessera.executor.gpp_run import run_gpp_plan
from tessera.executor.launcher import LaunchOptions
from tessera.executor.training import TrainOptions, train_reference
from tessera.planners.pipeline.checks import check_gpp_plan

pytestmark = [pytest.mark.corpus]

LLAMA = ("llama-gqa", "dynamo", "dynamic")  # 8 heads, 2 KV heads, SwiGLU; tied embedding
SHAPES = {"input_ids": (4, 16)}


def _graph(corpus: Corpus, key):
    return load_graph(corpus.paths[key], input_shapes=SHAPES)


def test_attention_and_mlp_of_every_layer_split(corpus: Corpus) -> None:
    graph = _graph(corpus, LLAMA)
    split = tensor_parallel(graph, 2)
    assert len(split.regions) == 4  # 2 layers × (attention, MLP)
    attention, mlp = split.regions[:2]
    assert (len(attention.columns), len(attention.rows)) == (3, 1)  # Q, K, V → O
    assert (len(mlp.columns), len(mlp.rows)) == (2, 1)  # gate, up → down
    lm_head = [n for n in graph.order if graph.op(n).op_type == "MatMul"][-1]
    assert lm_head not in split.nodes  # its split output would leave the graph


def test_grouped_kv_heads_stay_whole_where_t_exceeds_them(corpus: Corpus) -> None:
    attention = tensor_parallel(_graph(corpus, LLAMA), 4).regions[0]
    assert len(attention.columns) == 1  # Q only: 2 KV heads do not split 4 ways
    cut = [v for v in attention.operands.values() if v is not None]
    assert len(cut) == 2  # K and V, expanded to 8 heads, cut to the rank's 2 at run time


def test_a_fused_qkv_projection_splits_each_part(corpus: Corpus) -> None:
    graph = _graph(corpus, ("gpt2", "legacy", "dynamic"))
    attention = tensor_parallel(graph, 2).regions[0]
    fused = next(w for w, (axis, parts) in attention.weights.items() if parts == 3)
    assert graph.initializers[fused].shape[1] == 3 * graph.initializers[fused].shape[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "t", "tolerance"),
    [
        (LLAMA, 2, 2e-5),
        (LLAMA, 4, 2e-5),  # K and V whole, cut per rank
        (("gpt2", "legacy", "dynamic"), 2, 2e-5),  # fused QKV, Gemm with biases
        # batch × heads merged; ALiBi bias cut per rank. Its weights are drawn at std 1.0: another
        # summation order (the all-reduce's) moves its gradients by up to 1e-4 of their largest.
        (("bloom-alibi", "dynamo", "dynamic"), 2, 2e-4),
        (("bert", "ort", "dynamic"), 2, 2e-5),  # onnxruntime's optimizer's form
    ],
    ids=["llama-2", "llama-4", "gpt2-legacy-2", "bloom-2", "bert-ort-2"],
)
def test_tensor_parallel_ranks_compute_what_one_process_computes(corpus: Corpus, key, t, tolerance) -> None:
    path = str(corpus.paths[key])
    errors = tp_errors(path, t, SHAPES, run_batch=2)  # loaded at batch 4, run at 2
    assert all(regions >= 2 for _, regions, _ in errors)
    assert max(e for _, _, e in errors) < tolerance, errors


@pytest.mark.slow
@pytest.mark.parametrize("drop", ["TpCopy", "TpReduce"])
def test_without_its_collectives_a_split_stage_is_wrong(corpus: Corpus, drop: str) -> None:
    errors = tp_errors(str(corpus.paths[LLAMA]), 2, SHAPES, run_batch=2, drop=drop)
    assert max(e for _, _, e in errors) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["2-stages-x-tp2", "2-replicas-x-tp2-zero"])
def test_a_tensor_parallel_plan_trains_as_one_process(corpus: Corpus, layout: str) -> None:
    """4 ranks: two stages (the tied embedding and LM head on both) of 2 tensor-parallel ranks, or
    one stage on 2 data-parallel replicas of 2 with ZeRO-1; SGD with momentum and a global clip
    that binds (counted once per weight, a split weight's blocks on every rank)."""
    path = str(corpus.paths[LLAMA])
    graph = load_graph(path, input_shapes=SHAPES)
    order = list(graph.order)
    if layout == "2-stages-x-tp2":
        stages = [(order[: len(order) // 2], ["d0", "d1"], 2), (order[len(order) // 2 :], ["d2", "d3"], 2)]
        plan = make_plan(graph, stages, 4, tensor_parallel=2)
    else:
        plan = make_plan(graph, [(order, ["d0", "d1", "d2", "d3"], 4)], 4, tensor_parallel=2, zero=[0])
    assert check_gpp_plan(plan, graph) == []  # validate: C1–C5, memory counted per tensor-parallel rank
    options = TrainOptions(steps=4, lr=0.05, seed=3, momentum=0.9, max_grad_norm=0.5)
    run = run_gpp_plan(plan, graph, path, options, LaunchOptions(timeout_s=120), return_weights=True)
    ref = train_reference(graph, options.steps, 4, options=options)
    assert run.world_size == 4
    assert run.losses == pytest.approx(ref.losses, rel=1e-5)
    assert set(run.weights) == set(ref.weights)  # the split weights gathered whole
    for name, want in ref.weights.items():
        assert abs(run.weights[name] - want).max() <= 1e-5 * (abs(want).max() + 1e-6), name


def test_a_tensor_parallel_stage_counts_a_ranks_share_of_memory(corpus: Corpus) -> None:
    """validate's count: each rank keeps 1/t of the split weights (with their gradients and
    optimizer state) and of the split activations; a replica's devices must share a node."""
    graph = _graph(corpus, LLAMA)
    order = list(graph.order)
    whole = make_plan(graph, [(order, ["d0"], 4)], 4)  # one replica, as the tensor-parallel pair is
    split = make_plan(graph, [(order, ["d0", "d1"], 4)], 4, tensor_parallel=2)
    params = sum(graph.initializers[w].numel for r in tensor_parallel(graph, 2).regions for w in r.weights)
    assert whole.stages[0].memory.weights - split.stages[0].memory.weights == params * 2 // 2  # fp16, half
    assert split.stages[0].memory.activations < whole.stages[0].memory.activations
    assert check_gpp_plan(split, graph) == []
    stage = split.stages[0].model_copy(update={"memory": whole.stages[0].memory})  # the whole stage's
    cheat = split.model_copy(update={"stages": [stage]})
    assert any("records" in p for p in check_gpp_plan(cheat, graph))
    with pytest.raises(ValueError, match="do not make replicas"):
        type(split.stages[0]).model_validate({**split.stages[0].model_dump(), "tensor_parallel": 3})


@pytest.mark.slow
def test_a_tensor_parallel_run_resumes_exactly(corpus: Corpus, tmp_path) -> None:
    """Each rank checkpoints its blocks (``name/tp<i>``) and their momentum; the resumed run's
    losses and weights are the whole run's, bit for bit."""
    import shutil
    from dataclasses import replace

    import numpy as np

    path = str(corpus.paths[LLAMA])
    graph = load_graph(path, input_shapes=SHAPES)
    plan = make_plan(graph, [(list(graph.order), ["d0", "d1"], 4)], 4, tensor_parallel=2)
    folder = tmp_path / "ckpt"
    options = TrainOptions(steps=4, lr=0.05, seed=3, momentum=0.9, checkpoint=str(folder), checkpoint_every=2)
    whole = run_gpp_plan(plan, graph, path, options, LaunchOptions(timeout_s=120), return_weights=True)
    shutil.rmtree(folder / "step-4")
    resumed = run_gpp_plan(
        plan, graph, path, replace(options, resume=True), LaunchOptions(timeout_s=120), return_weights=True
    )
    assert resumed.losses == whole.losses[2:]
    for name, want in whole.weights.items():
        np.testing.assert_array_equal(resumed.weights[name], want, err_msg=name)
