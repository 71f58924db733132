"""GPP executor pieces that need no processes: data, loss, reference training, routing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from executor.plans import candle_dag, make_plan, save_model
from onnx_builders import head_major_chain

from tessera.core.errors import InputError, LaunchError
from tessera.core.graph import load_graph
from tessera.executor.routing import Layout, Unit, build_routing, tensor_layouts
from tessera.executor.training import TrainingData, loss_term, train_reference
from tessera.models import build


@pytest.fixture(scope="module")
def candle(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("candle") / "candle.onnx"
    return save_model(build("candle_uno", "tiny", 0), path), str(path)


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gpt") / "gpt.onnx"
    return save_model(build("gpt", "tiny", 0), path), str(path)


def test_synthetic_data_is_seeded_and_ids_stay_in_their_tables() -> None:
    graph = load_graph(build("dlrm", "tiny", 0))
    a, _ = TrainingData(graph, 4, seed=3).batch(1)
    b, _ = TrainingData(graph, 4, seed=3).batch(1)
    c, _ = TrainingData(graph, 4, seed=3).batch(2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["dense0"], c["dense0"])
    rows = graph.initializers["sparse_branch0/table/weight"].shape[0]
    assert a["sparse0"].dtype == np.int64 and a["sparse0"].shape == (4, 4)
    assert 0 <= a["sparse0"].min() and a["sparse0"].max() < rows
    assert a["dense0"].shape == (4, 16) and a["dense0"].dtype == np.float32


def test_npz_data_with_targets(tmp_path: Path, candle) -> None:
    graph, _ = candle
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal((8, 16)).astype(np.float32) for n in graph.inputs}
    arrays["target:growth"] = np.ones((8, 1), np.float32)
    np.savez(tmp_path / "d.npz", **arrays)
    data = TrainingData(graph, 4, path=str(tmp_path / "d.npz"))
    inputs, targets = data.batch(1)
    assert np.array_equal(inputs["feature0"], arrays["feature0"][4:8])
    assert np.array_equal(targets["growth"], np.ones((4, 1), np.float32))
    assert np.array_equal(data.batch(2)[0]["feature0"], arrays["feature0"][:4])  # wraps around
    np.savez(tmp_path / "bad.npz", feature0=arrays["feature0"][:6])
    with pytest.raises(InputError, match="no array for model input"):
        TrainingData(graph, 4, path=str(tmp_path / "bad.npz"))


def test_loss_terms_of_the_pieces_sum_to_the_mean() -> None:
    out = torch.randn(8, 3, 5)
    whole = (out * out).mean()
    pieces = sum(loss_term(p, None, p.shape[0], 8) for p in out.split([2, 1, 5]))
    assert torch.allclose(whole, pieces, rtol=1e-6)


def test_reference_training_is_deterministic_and_learns(tmp_path: Path, candle) -> None:
    graph, _ = candle
    a = train_reference(graph, steps=3, mini_batch=8, seed=0, lr=0.05)
    b = train_reference(graph, steps=3, mini_batch=8, seed=0, lr=0.05)
    assert a.losses == b.losses
    assert all(np.array_equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert len(a.weights) == 66
    # On one fixed mini-batch (a data file of exactly one batch), SGD brings the loss down.
    inputs, _ = TrainingData(graph, 8, seed=0).batch(0)
    np.savez(tmp_path / "one.npz", **inputs)
    fixed = train_reference(graph, steps=5, mini_batch=8, lr=0.05, data=str(tmp_path / "one.npz"))
    assert fixed.losses[-1] < fixed.losses[0]
    assert fixed.losses[0] == pytest.approx(a.losses[0])


def test_layouts_find_batched_and_batchless_tensors(gpt) -> None:
    graph, path = gpt
    layouts = tensor_layouts(graph, path)
    assert layouts["input_ids"] == Layout(1, (16,), "int64")
    assert layouts["embed/token/gather"].rows_per_sample == 1
    assert layouts["embed/position/gather"] == Layout(None, (16, 32), "float32")  # constant positions
    assert layouts["layer0/attn/causal_mask"].rows_per_sample is None


def test_layouts_find_the_axis_that_holds_the_samples(tmp_path: Path) -> None:
    graph = save_model(head_major_chain(width=8, heads=2), tmp_path / "heads.onnx")
    layouts = tensor_layouts(graph, str(tmp_path / "heads.onnx"))
    assert layouts["heads"] == Layout(1, (2, 4), "float32", axis=1)
    assert layouts["heads"].shape(3) == (2, 3, 4)
    assert layouts["bhd"] == Layout(1, (2, 4), "float32")


def _coverage(routing, stage: int) -> dict[tuple[str, int], list[int]]:
    """For every (tensor, sample) a stage receives: how many messages bring it."""
    seen: dict[tuple[str, int], list[int]] = {}
    for unit, msgs in routing.incoming.items():
        if unit.stage != stage:
            continue
        lo, _ = routing.ranges[stage][unit.micro_batch][unit.replica]
        for m in msgs:
            a, z = m.dst_rows
            for s in range(lo + a, lo + z):
                seen.setdefault((m.tensor, s), []).append(m.id)
    return seen


def test_routing_splits_and_concatenates_across_micro_batch_sizes_and_replicas(candle) -> None:
    graph, path = candle
    a, b, c = candle_dag(graph)
    plan = make_plan(graph, [(a, ["d0"], 2), (b, ["d1"], 4), (c, ["d2", "d3", "d4"], 8)], 16)
    routing = build_routing(plan, graph, tensor_layouts(graph, path))
    assert routing.world_size == 5
    assert routing.ranges[2][0] == [(0, 3), (3, 6), (6, 8)]
    assert routing.ranges[2][1] == [(8, 11), (11, 14), (14, 16)]
    seen = _coverage(routing, 2)
    crossing = [t for t in routing.stage_inputs[2] if t not in graph.inputs]
    assert len(crossing) == 7
    assert set(seen) == {(t, s) for t in crossing for s in range(16)}
    assert all(len(ids) == 1 for ids in seen.values())  # every sample arrives exactly once
    # replica 0 of micro-batch 0 of the merge (samples 0–2) takes stage 0's micro-batches 0 and 1
    srcs = {(m.src.stage, m.src.micro_batch) for m in routing.incoming[Unit(2, 0, 0)]}
    assert srcs == {(0, 0), (0, 1), (1, 0)}
    assert routing.loss_outputs == {0: [], 1: [], 2: ["growth"]}
    for msgs in routing.outgoing.values():
        assert all(m.grad for m in msgs)


def test_batchless_tensor_travels_whole_once_per_consumer_micro_batch(gpt) -> None:
    graph, path = gpt
    cut = graph.order.index("embed/position/gather") + 1  # the [seq, hidden] positions go to stage 1
    plan = make_plan(graph, [(graph.order[:cut], ["d0"], 2), (graph.order[cut:], ["d1"], 4)], 8)
    routing = build_routing(plan, graph, tensor_layouts(graph, path))
    pos = [m for msgs in routing.incoming.values() for m in msgs if m.tensor == "embed/position/gather"]
    assert len(pos) == 2 and all(m.src_rows is None and m.grad for m in pos)
    assert [m.src.micro_batch for m in pos] == [0, 2]  # the producer micro-batch holding the first sample


def test_plans_the_executor_refuses(candle) -> None:
    graph, path = candle
    layouts = tensor_layouts(graph, path)
    a, b, c = candle_dag(graph)
    too_many = make_plan(graph, [(a, ["d0"], 2), (b, ["d1"], 2), (c, ["d2", "d3", "d4"], 2)], 4)
    with pytest.raises(LaunchError, match="smaller than its 3 data-parallel replicas"):
        build_routing(too_many, graph, layouts)
    plan = make_plan(graph, [(a, ["d0"], 2), (b, ["d1"], 2), (c, ["d2"], 2)], 4)
    no_edge = plan.model_copy(update={"edges": plan.edges[1:]})
    with pytest.raises(InputError, match="no edge"):
        build_routing(no_edge, graph, layouts)
    st = plan.stages[0]
    bad = st.model_copy(
        update={"schedule": st.schedule.model_copy(update={"actions": ["B0", "F0", "F1", "B1"]})}
    )
    with pytest.raises(InputError, match="stage 0: schedule: B0 before F0"):
        build_routing(plan.model_copy(update={"stages": [bad, *plan.stages[1:]]}), graph, layouts)
    # Forwards out of order: refused by the one rule validate applies (the executor used to run them).
    swapped = st.model_copy(
        update={"schedule": st.schedule.model_copy(update={"actions": ["F1", "F0", "B0", "B1"]})}
    )
    with pytest.raises(InputError, match="forwards are not F0..F1 in order"):
        build_routing(plan.model_copy(update={"stages": [swapped, *plan.stages[1:]]}), graph, layouts)
