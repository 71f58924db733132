from __future__ import annotations

from tessera.core.cost import CostModel
from tessera.planners.pipeline.search import build_tree
from tessera.planners.pipeline.spp import piper_ideals, plan_spp
from tessera.planners.pipeline.types import PartitionOptions


def test_spp_is_a_chain_of_contiguous_stages(v100, zoo_graph) -> None:
    g = zoo_graph("mmt")
    pipe = plan_spp(g, v100, PartitionOptions(mini_batch=32, num_devices=4))
    assert pipe.kind == "spp"
    assert pipe.pipeline_depth == len(pipe.stages)
    assert all(e.dst > e.src for e in pipe.edges)


def test_piper_search_space_grows_with_branches(v100, zoo_graph) -> None:
    cost = CostModel.for_device(v100.devices()[0].type)
    chain_like = build_tree(zoo_graph("gpt"), cost, 64)
    branchy = build_tree(zoo_graph("dlrm", "paper"), cost, 64)
    assert piper_ideals(chain_like) < 10 * chain_like.num_units
    assert piper_ideals(branchy) > 10**6


def test_spp_finds_the_sequential_plan_gpp_finds_under_a_tight_memory_limit(v100, zoo_graph) -> None:
    # GPT-2 small is a chain: at 2 GiB per device the only plans are four one-device stages whose
    # first stages are short (they hold the most micro-batches). The SPP DP tries a few split
    # points per stage for time; it used to try the longest ones only, which leave no plan here.
    g = zoo_graph("gpt", "paper")
    opts = PartitionOptions(mini_batch=8, num_devices=4, memory_limit=2 * 2**30)
    pipe = plan_spp(g, v100, opts)
    assert len(pipe.stages) == 4
    assert all(st.memory is not None and st.memory.peak <= 2 * 2**30 for st in pipe.stages)
