"""plan_cp and the context sweep: the thesis's qualitative result, determinism, the plan's body."""

from __future__ import annotations

import json

import pytest

from tessera.core.errors import InfeasibleError
from tessera.core.plans import CpPlan, dump_plan, parse_plan
from tessera.core.specs import load_cluster
from tessera.planners.cp.llm import load_llm_config
from tessera.planners.cp.plan import plan_cp, sweep_context
from tessera.planners.cp.workload import Workload


def test_thesis_setup_tp_short_cp_long_dp_last() -> None:
    """Thesis §4.5 on its own setup (4x RTX A5000, one Llama-7B layer, batch 32, unknown output
    lengths): TP is ahead at short context, CP at long context, and DP is last (Fig. 4.2, §4.5.2)."""
    llm, _ = load_llm_config("llama-7b")
    rows = sweep_context(
        llm, load_cluster("a5000-4x"), Workload(32, 1024), [1024, 10 * 1024, 100 * 1024], layers=1
    )
    assert [row.winner for row in rows] == ["tp", "tp", "cp"]
    for row in rows:
        tps = {s: e.tokens_per_s for s, e in row.best.items() if e is not None}
        assert set(tps) == {"tp", "cp", "dp"}, row.context
        assert min(tps, key=tps.__getitem__) == "dp", (row.context, tps)
        assert all(e.degree == 4 for e in row.best.values() if e is not None)


def test_sweep_reports_infeasible_contexts_as_none() -> None:
    llm, _ = load_llm_config("llama-7b")
    rows = sweep_context(llm, load_cluster("a5000-4x"), Workload(32, 1024), [1024 * 1024], layers=1)
    assert rows[0].winner is None and all(e is None for e in rows[0].best.values())


def test_plan_is_deterministic_and_round_trips() -> None:
    llm, source = load_llm_config("llama-7b")
    cluster = load_cluster("a5000-4x")
    work = Workload(32, 32 * 1024)
    first = dump_plan(plan_cp(llm, cluster, work, source=source, layers=1))
    second = dump_plan(plan_cp(llm, cluster, work, source=source, layers=1))
    assert first == second
    plan = parse_plan(json.loads(first), label="plan.json")
    assert isinstance(plan, CpPlan)
    assert plan.model is None and plan.llm_config is not None and plan.llm_config.path == "llama-7b"
    assert plan.strategy == "cp" and plan.degree == 4
    assert dump_plan(plan) == first


def test_plan_body() -> None:
    llm, source = load_llm_config("llama-7b")
    cluster = load_cluster("a5000-4x")
    plan = plan_cp(llm, cluster, Workload(32, 100_000), source=source, layers=1)
    assert plan.strategy == "cp"
    # Block-aligned, contiguous KV ranges covering the prompt.
    shards = plan.kv_shards
    assert [s.device for s in shards] == [d.id for d in cluster.devices()]
    assert shards[0].start == 0 and shards[-1].stop == 100_000
    assert all(a.stop == b.start for a, b in zip(shards[:-1], shards[1:], strict=True))
    assert all(s.start % 16 == 0 for s in shards)
    assert max(s.stop - s.start for s in shards) - min(s.stop - s.start for s in shards) <= 16
    assert [c["op"] for c in plan.collectives] == ["all_gather", "all_to_all"]
    assert all(c["group"] == [s.device for s in shards] for c in plan.collectives)
    p = plan.predicted
    assert p["tokens_per_s"] > 0 and p["per_token_latency_s"] > 0
    assert p["memory_per_device"]["total"] <= p["memory_per_device"]["capacity"]
    assert len(plan.alternatives) == 8  # 3 strategies x 3 degrees, minus the plan
    assert all(a["tokens_per_s"] is None or a["tokens_per_s"] <= p["tokens_per_s"] for a in plan.alternatives)


def test_infeasible_names_the_smallest_memory() -> None:
    llm, source = load_llm_config("llama-7b")
    with pytest.raises(InfeasibleError, match=r"needs at least \d+\.\d+ GiB per device \(tp-4"):
        plan_cp(llm, load_cluster("a5000-4x"), Workload(128, 64 * 1024), source=source, layers=1)
