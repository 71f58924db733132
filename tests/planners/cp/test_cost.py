"""The CP/TP/DP cost model: thesis §4.4 volumes (Fig. 4.1), memory feasibility, the DP straggler."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tessera.core.specs import ClusterSpec, load_cluster
from tessera.executor.cp_memory import weight_elements
from tessera.planners.cp.cost import (
    CostParams,
    TpLaunch,
    cp_comm_elements,
    degrees,
    dp_replica_steps,
    estimate,
    estimate_all,
    tp_comm_elements,
)
from tessera.planners.cp.llm import load_llm_config
from tessera.planners.cp.workload import OutputLengths, Workload, parse_output_lengths

# Thesis Fig. 4.1: Llama-7B, E = 4096, H = 32; per-GPU volume per layer in elements (1 byte each),
# worked out by hand from §4.4:  CP = (N-1)·3BE/N + (N-1)·B(E+2H)/2,  TP = 4(N-1)BE.
# e.g. N=4, B=32: CP = 3·3·32·4096/4 + 3·32·4160/2 = 294912 + 199680 = 494592; TP = 4·3·32·4096.
FIG_4_1 = {
    2: {32: (263168, 524288), 64: (526336, 1048576), 128: (1052672, 2097152),
        256: (2105344, 4194304), 512: (4210688, 8388608)},
    4: {32: (494592, 1572864), 64: (989184, 3145728), 128: (1978368, 6291456),
        256: (3956736, 12582912), 512: (7913472, 25165824)},
    8: {32: (809984, 3670016), 64: (1619968, 7340032), 128: (3239936, 14680064),
        256: (6479872, 29360128), 512: (12959744, 58720256)},
}  # fmt: skip


@pytest.mark.parametrize("n", sorted(FIG_4_1))
@pytest.mark.parametrize("batch", [32, 64, 128, 256, 512])
def test_comm_volume_matches_thesis_fig_4_1(n: int, batch: int) -> None:
    cp_expected, tp_expected = FIG_4_1[n][batch]
    gather, exchange = cp_comm_elements(n, batch, 4096, 32)
    assert gather + exchange == cp_expected
    assert tp_comm_elements(n, batch, 4096) == tp_expected
    assert gather + exchange < tp_comm_elements(n, batch, 4096)  # CP moves less than TP


def test_cp_all_gather_generalizes_to_grouped_query_attention() -> None:
    # kv_dim = E is the thesis's multi-head case; fewer KV heads shrink only the K/V part.
    assert cp_comm_elements(4, 32, 4096, 32, kv_dim=4096) == cp_comm_elements(4, 32, 4096, 32)
    gather, _ = cp_comm_elements(4, 32, 4096, 32, kv_dim=1024)
    assert gather == 3 * 32 * (4096 + 2 * 1024) / 4


def test_plan_collective_bytes_are_the_formula_times_dtype_bytes() -> None:
    llm, _ = load_llm_config("llama-7b")
    cluster = load_cluster("a5000-4x")
    work = Workload(32, 4096)
    cp = estimate(llm, cluster, work, "cp", 4, layers=1)
    tp = estimate(llm, cluster, work, "tp", 4, layers=1)
    assert [c.op for c in cp.collectives] == ["all_gather", "all_to_all"]
    assert sum(c.bytes for c in cp.collectives) == 494592 * 2  # fp16
    assert [c.op for c in tp.collectives] == ["all_reduce", "all_reduce"]
    assert sum(c.bytes for c in tp.collectives) == 1572864 * 2
    link = cluster.links.intra_node
    assert cp.collectives[0].time_s == pytest.approx(
        3 * link.latency + cp.collectives[0].bytes / link.bandwidth
    )
    assert estimate(llm, cluster, work, "dp", 4, layers=1).collectives == ()


def test_degrees_divide_the_device_count() -> None:
    assert degrees(4) == [1, 2, 4]
    assert degrees(8) == [1, 2, 4, 8]
    assert degrees(1) == [1]


def test_memory_feasibility() -> None:
    llm, _ = load_llm_config("llama-7b")
    cluster = load_cluster("a5000-4x")  # 24 GiB per device
    work = Workload(1, 32 * 1024, OutputLengths("fixed", 256, 256))
    # Whole model: 13.5 GB of fp16 weights plus 32.3K tokens x 512 KiB of KV do not fit on one A5000 …
    dp = estimate(llm, cluster, work, "dp", 1)
    assert not dp.feasible and "GiB" in (dp.reason or "")
    assert dp.memory_bytes > dp.capacity_bytes
    # … nor does CP or DP over 4 (weights replicated; DP needs 4 requests anyway) but TP over 4 does.
    assert not estimate(llm, cluster, work, "dp", 4).feasible
    tp = estimate(llm, cluster, work, "tp", 4)
    assert tp.feasible and tp.weights_bytes == pytest.approx(llm.params * 2 / 4, abs=1)
    assert tp.kv_cache_bytes == (32 * 1024 + 256) * llm.kv_bytes_per_token() // 4
    cp = estimate(llm, cluster, work, "cp", 4)
    assert cp.kv_cache_bytes < dp.kv_cache_bytes and cp.weights_bytes == dp.weights_bytes


def test_tensor_parallelism_needs_heads_divisible_by_degree() -> None:
    llm, _ = load_llm_config("gpt2")  # 12 heads
    cluster = load_cluster("dgx-a100")
    work = Workload(8, 1024)
    assert estimate(llm, cluster, work, "tp", 4).feasible
    bad = estimate(llm, cluster, work, "tp", 8)
    assert not bad.feasible and "heads" in (bad.reason or "")


def test_dp_straggler_is_at_least_the_mean_and_deterministic() -> None:
    output = parse_output_lengths("uniform:1-1024")
    steps = dp_replica_steps(output, 32, 4, trials=512, seed=3)
    assert steps.shape == (512, 4)
    assert np.all(steps.max(axis=1) >= steps.mean(axis=1))
    assert steps.max(axis=1).mean() > steps.mean()  # variance in outputs makes a straggler
    again = dp_replica_steps(output, 32, 4, trials=512, seed=3)
    assert np.array_equal(steps, again)
    # Without variance and with an even split there is no straggler.
    fixed = dp_replica_steps(OutputLengths("fixed", 100, 100), 32, 4)
    assert np.all(fixed == 100)


def test_dp_throughput_pays_for_the_straggler() -> None:
    llm, _ = load_llm_config("llama-7b")
    cluster = load_cluster("a5000-4x")
    fixed = estimate(llm, cluster, Workload(32, 8192, OutputLengths("fixed", 512, 512)), "dp", 4, layers=1)
    varied = estimate(
        llm, cluster, Workload(32, 8192, parse_output_lengths("uniform:1-1024")), "dp", 4, layers=1
    )
    assert fixed.dp_straggler == 1.0
    assert varied.dp_straggler > 1.1
    assert fixed.tokens_per_s == pytest.approx(32 / fixed.step_time_s)
    assert varied.tokens_per_s < 32 / varied.step_time_s


def test_decode_is_memory_bound_and_cp_splits_the_kv_read() -> None:
    llm, _ = load_llm_config("llama-7b")
    cluster = load_cluster("a5000-4x")
    work = Workload(32, 64 * 1024, OutputLengths("fixed", 1, 1))
    one = estimate(llm, cluster, work, "cp", 1, layers=1, params=CostParams(block_table_entry_s=0))
    four = estimate(llm, cluster, work, "cp", 4, layers=1, params=CostParams(block_table_entry_s=0))
    kv_read = 32 * 64 * 1024 * llm.kv_bytes_per_token(1) / cluster.devices()[0].type.memory_bandwidth
    assert one.compute_s == pytest.approx(kv_read + llm.layer_params * 2 / 768e9, rel=0.01)
    assert four.compute_s == pytest.approx(kv_read / 4 + llm.layer_params * 2 / 768e9, rel=0.01)


def test_a_group_of_mixed_device_types_runs_at_its_slowest_and_fits_its_smallest() -> None:
    # a5000-4x with its last two devices replaced by a type of half the memory bandwidth and
    # memory: a CP group over all four decodes (memory-bound) at the slow pair's pace.
    data = load_cluster("a5000-4x").to_json_dict()
    slow = {**data["device_types"]["a5000"], "memory_bandwidth": 384e9, "memory": 12 * 2**30}
    data["device_types"]["slow"] = slow
    data["nodes"][0]["devices"] = [{"type": "a5000", "count": 2}, {"type": "slow", "count": 2}]
    mixed = ClusterSpec.from_json_dict(data)
    same = load_cluster("a5000-4x")
    llm, _ = load_llm_config("llama-7b")
    work = Workload(32, 64 * 1024, OutputLengths("fixed", 1, 1))
    params = CostParams(block_table_entry_s=0)
    fast2, fast4 = (estimate(llm, same, work, "cp", n, layers=1, params=params) for n in (2, 4))
    mixed2, mixed4 = (estimate(llm, mixed, work, "cp", n, layers=1, params=params) for n in (2, 4))
    assert mixed2.compute_s == pytest.approx(fast2.compute_s)  # the first two are A5000s
    assert mixed4.compute_s == pytest.approx(2 * fast4.compute_s)  # half the bandwidth
    assert (mixed2.capacity_bytes, mixed4.capacity_bytes) == (same.devices()[0].type.memory, 12 * 2**30)


def test_estimate_all_covers_every_strategy_and_degree() -> None:
    llm, _ = load_llm_config("gpt2")
    estimates = estimate_all(llm, load_cluster("a5000-4x"), Workload(8, 2048))
    assert [(e.strategy, e.degree) for e in estimates] == [
        (s, d) for s in ("tp", "cp", "dp") for d in (1, 2, 4)
    ]


def test_a_mixture_of_experts_holds_every_expert_and_reads_those_its_tokens_are_routed_to() -> None:
    """Mixtral 8x7B: 46.7 B parameters held, 12.9 B used per token (its paper's counts); a decode
    step of one token reads 2 of 8 experts, a step of 64 tokens nearly all 8."""
    llm, _ = load_llm_config("mixtral-8x7b")
    assert llm.params == pytest.approx(46.7e9, rel=0.01)
    active = (
        llm.layers * (llm.attention_params + llm.active_ffn_params + 4 * llm.hidden) + llm.embedding_params
    )
    assert active == pytest.approx(12.9e9, rel=0.02)
    assert llm.ffn_read_params(1) == pytest.approx(2 * llm.expert_params + llm.every_token_params)
    assert llm.ffn_read_params(64) == pytest.approx(8 * llm.expert_params + llm.every_token_params, rel=1e-6)
    dense = llm.model_copy(update={"experts": 1, "experts_per_token": 1})
    cluster = load_cluster("a5000-4x")
    work = Workload(1, 128, OutputLengths("fixed", 1, 1))
    params = CostParams(block_table_entry_s=0)
    moe, one = (estimate(m, cluster, work, "tp", 4, params=params) for m in (llm, dense))
    assert moe.weights_bytes == pytest.approx(llm.params * 2 / 4, rel=0.01)  # every expert held
    # one token: the step reads 2 experts where the dense model reads its one FFN
    layer_read = (llm.layer_read_params(1) - dense.layer_read_params(1)) * llm.layers * 2 / 4
    assert moe.compute_s - one.compute_s == pytest.approx(layer_read / 768e9, rel=0.01)


def test_layers_with_a_dense_ffn_beside_the_experts_count_their_own_weights() -> None:
    """Mixtral's sizes with its first 2 of 32 layers dense (14336 wide), as DeepSeek's first layers
    are: those layers hold and read one dense FFN, the others their experts; the executor's weight
    estimate counts the same layers."""
    moe, _ = load_llm_config("mixtral-8x7b")
    llm = moe.model_validate({**moe.model_dump(), "dense_layers": 2, "dense_ffn": 14336})
    dense_ffn = 3 * llm.hidden * 14336
    layer = llm.attention_params + 4 * llm.hidden
    want = 32 * layer + 30 * moe.ffn_params + 2 * dense_ffn + llm.embedding_params
    assert llm.params == want
    assert llm.layers * llm.ffn_read_params(1) == pytest.approx(30 * moe.ffn_read_params(1) + 2 * dense_ffn)
    assert llm.layers * llm.active_ffn_params == pytest.approx(30 * moe.active_ffn_params + 2 * dense_ffn)
    h, f, fd = llm.hidden, llm.ffn, 14336
    experts_layer, dense_layer = 8 * (3 * h * f + 2 * f) + h * 8, 3 * h * fd + 2 * fd  # with biases
    assert weight_elements(moe.to_json(), None) - weight_elements(llm.to_json(), None) == 2 * (
        experts_layer - dense_layer
    )
    for bad in (
        {"dense_layers": 32},  # every layer dense: no mixture
        {"dense_ffn": 0},
        {"experts": 1, "experts_per_token": 1},
    ):
        with pytest.raises(ValueError, match="dense_layers"):
            llm.model_validate({**llm.model_dump(), **bad})


def test_experts_per_token_cannot_exceed_the_experts() -> None:
    llm, _ = load_llm_config("mixtral-8x7b")
    with pytest.raises(ValueError, match="experts_per_token"):
        llm.model_validate({**llm.model_dump(), "experts_per_token": 9})


def test_a_compiled_step_is_charged_the_compiled_overhead_per_operation() -> None:
    llm, _ = load_llm_config("gpt2")
    data = load_cluster("local-cpu-split").to_json_dict()
    cluster = ClusterSpec.from_json_dict(data)
    (kind,) = cluster.device_types.values()
    work = Workload(1, 128, OutputLengths("fixed", 1, 1))
    traced = estimate(llm, cluster, work, "dp", 1, params=CostParams(step_operations=200))
    compiled = estimate(llm, cluster, work, "dp", 1, params=CostParams(step_operations=200, compiled=True))
    assert (kind.decode_op_overhead, kind.decode_compiled_op_overhead) == (2.9e-6, 1.9e-6)
    assert traced.host_s - compiled.host_s == pytest.approx(200 * (2.9e-6 - 1.9e-6))
    assert compiled.compute_s == traced.compute_s
    # a device without a compiled overhead: the traced one, not a silent zero
    for t in data["device_types"].values():
        del t["decode_compiled_op_overhead"]
    bare = estimate(llm, ClusterSpec.from_json_dict(data), work, "dp", 1,
                    params=CostParams(step_operations=200, compiled=True))  # fmt: skip
    assert bare.host_s == pytest.approx(traced.host_s)
    assert (
        CostParams(compiled=True).to_json()["compiled"] is True and "compiled" not in CostParams().to_json()
    )


@pytest.mark.parametrize(
    ("strategy", "split"),
    [("cp", None), ("tp", TpLaunch(2, whole=1.0, gathered=1.0, reduces=0.0))],
)
def test_the_launch_step_runs_the_dense_part_on_every_rank_and_gathers_once_a_layer(
    strategy: str, split: TpLaunch | None
) -> None:
    """tessera's launch runs the dense part whole on cp ranks (and on tp ranks where the model's
    split reaches nothing) and gathers the attention outputs once a layer: the estimate's ``launch``
    step charges exactly that (the thesis's split dense part and its collectives stay the
    estimate), and dp, which launches as estimated, has none."""
    llm, _ = load_llm_config("gpt2")
    cluster = load_cluster("local-cpu-split")
    work = Workload(8, 512, OutputLengths("fixed", 1, 1))
    params = CostParams(step_operations=300, gather_operations=(6, 24), tp_launch=(split,) if split else ())
    two = estimate(llm, cluster, work, strategy, 2, params=params)
    launch = two.launch
    assert launch["compute_s"] > two.compute_s  # the dense part is not split
    [gather] = launch["collectives"]
    assert gather["op"] == "all_gather"
    assert launch["communication_s"] == pytest.approx(llm.layers * gather["time_s"], rel=1e-4)
    per_rank = 8 * (llm.heads // 2 * llm.head_dim if strategy == "tp" else llm.heads * (llm.head_dim + 1)) * 4
    assert gather["bytes"] == per_rank  # fp32, one other rank's part received
    added = (6 if strategy == "tp" else 24) * llm.layers * 2.9e-6
    assert launch["host_s"] == pytest.approx(two.host_s + added, rel=1e-4)
    assert launch["step_time_s"] == pytest.approx(
        launch["compute_s"] + launch["host_s"] + launch["communication_s"], rel=1e-4
    )
    assert two.summary()["launch"] == launch and "gather_operations" in params.to_json()
    assert not estimate(llm, cluster, work, "dp", 2, params=params).launch
    assert not estimate(llm, cluster, work, strategy, 1, params=params).launch


def test_a_sharded_tp_launch_splits_the_layers_and_all_reduces_twice_a_layer() -> None:
    """Where the model's split reaches every projection, a tp rank of tessera's launch holds its
    shard of the layers (the LM head whole) and sums partial sums twice a layer: its compute lies
    between the thesis's split step and the whole model's, its communication is the two exchanges,
    each charged its operations; a split that keeps part of the layers whole costs more compute."""
    llm, _ = load_llm_config("gpt2")
    cluster = load_cluster("local-cpu-split")
    work = Workload(1, 512, OutputLengths("fixed", 1, 1))
    params = CostParams(step_operations=300, gather_operations=(6, 24), reduce_operations=5)
    two = estimate(llm, cluster, work, "tp", 2, params=params)
    whole = estimate(llm, cluster, work, "tp", 2, params=dataclasses.replace(
        params, tp_launch=(TpLaunch(2, whole=1.0, gathered=1.0, reduces=0.0),)))  # fmt: skip
    half = estimate(llm, cluster, work, "tp", 2, params=dataclasses.replace(
        params, tp_launch=(TpLaunch(2, whole=0.5, gathered=0.0, reduces=1.0),)))  # fmt: skip
    launch = two.launch
    assert two.compute_s < launch["compute_s"] < whole.launch["compute_s"]
    assert launch["compute_s"] < half.launch["compute_s"] < whole.launch["compute_s"]
    [reduce] = launch["collectives"]
    assert reduce["bytes"] == llm.hidden * 4 and "partial sums" in reduce["what"]
    assert launch["communication_s"] == pytest.approx(2 * llm.layers * reduce["time_s"], rel=1e-4)
    assert launch["host_s"] == pytest.approx(two.host_s + 2 * 5 * llm.layers * 2.9e-6, rel=1e-4)
    assert launch["weights_whole"] == 0.0 and half.launch["weights_whole"] == 0.5
    assert params.to_json()["reduce_operations"] == 5
    assert dataclasses.replace(params, tp_launch=(TpLaunch(2, 0.5),)).to_json()["tp_launch"] == [
        {"t": 2, "whole": 0.5, "gathered": 0.0, "reduces": 2.0}
    ]


@pytest.mark.parametrize("strategy", ["cp", "tp"])
def test_a_launch_on_one_host_exchanges_at_the_measured_decode_exchange(strategy: str) -> None:
    """Ranks of one host exchange through shared memory: where the spec measured that exchange
    (``decode_exchange_overhead``, calibrate), each of the launch's collectives costs it plus its
    bytes at the memory bandwidth, not the pipeline link's latency; without it, the link's."""
    llm, _ = load_llm_config("gpt2")
    data = load_cluster("local-cpu-split").to_json_dict()
    work = Workload(1, 512, OutputLengths("fixed", 1, 1))
    params = CostParams(step_operations=300, gather_operations=(6, 24), reduce_operations=5)
    linked = estimate(llm, ClusterSpec.from_json_dict(data), work, strategy, 2, params=params).launch
    for t in data["device_types"].values():
        t["decode_exchange_overhead"] = 20e-6
    cluster = ClusterSpec.from_json_dict(data)
    (kind,) = cluster.device_types.values()
    shm = estimate(llm, cluster, work, strategy, 2, params=params).launch
    [c] = shm["collectives"]
    assert c["time_s"] == pytest.approx(20e-6 + c["bytes"] / kind.memory_bandwidth, rel=1e-3)
    assert [x["bytes"] for x in linked["collectives"]] == [c["bytes"]]
    assert linked["collectives"][0]["time_s"] != pytest.approx(c["time_s"], rel=1e-2)
    assert shm["compute_s"] == linked["compute_s"] and shm["host_s"] == linked["host_s"]
    assert ClusterSpec.from_json_dict(cluster.to_json_dict()) == cluster  # the field round-trips


@pytest.mark.parametrize("strategy", ["cp", "tp"])
def test_ranks_of_one_host_that_exchange_every_layer_run_at_the_slowest_ones_pace(strategy: str) -> None:
    """``decode_rank_skew`` (calibrate): a launch's ranks on one host meet at every exchange, so the
    step's own work (compute and host) takes that fraction longer; its exchanges do not. Ranks on
    two nodes exchange over the link and are not charged it."""
    llm, _ = load_llm_config("gpt2")
    data = load_cluster("local-cpu-split").to_json_dict()
    work = Workload(1, 512, OutputLengths("fixed", 1, 1))
    params = CostParams(step_operations=300, gather_operations=(6, 24), reduce_operations=5)
    (kind,) = data["device_types"].values()
    kind["decode_exchange_overhead"] = 12e-6
    even = estimate(llm, ClusterSpec.from_json_dict(data), work, strategy, 2, params=params).launch
    kind["decode_rank_skew"] = 0.25
    cluster = ClusterSpec.from_json_dict(data)
    skewed = estimate(llm, cluster, work, strategy, 2, params=params).launch
    assert even["step_time_s"] == pytest.approx(
        even["compute_s"] + even["host_s"] + even["communication_s"], rel=1e-4
    )
    own = skewed["compute_s"] + skewed["host_s"]
    assert skewed["step_time_s"] == pytest.approx(1.25 * own + skewed["communication_s"], rel=1e-4)
    assert {k: v for k, v in skewed.items() if k != "step_time_s"} == {
        k: v for k, v in even.items() if k != "step_time_s"
    }
    assert ClusterSpec.from_json_dict(cluster.to_json_dict()) == cluster  # the field round-trips
    data["nodes"] = [{"name": "local", "count": 2, "devices": [{"type": "cpu-core", "count": 1}]}]
    data["links"]["inter_node"] = data["links"]["intra_node"]
    two_nodes = estimate(llm, ClusterSpec.from_json_dict(data), work, strategy, 2, params=params).launch
    assert two_nodes["step_time_s"] == pytest.approx(
        two_nodes["compute_s"] + two_nodes["host_s"] + two_nodes["communication_s"], rel=1e-4
    )
