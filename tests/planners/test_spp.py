from __future__ import annotations

from tessera.core.cost import CostModel
from tessera.core.graph import load_graph
from tessera.core.specs import load_cluster
from tessera.models import build
from tessera.planners.gpp.partition import PartitionOptions, build_tree
from tessera.planners.spp import piper_ideals, plan_spp


def test_spp_is_a_chain_of_contiguous_stages() -> None:
    cluster = load_cluster("graphpipe-v100")
    g = load_graph(build("mmt", "tiny"))
    pipe = plan_spp(g, cluster, PartitionOptions(mini_batch=32, num_devices=4))
    assert pipe.kind == "spp"
    assert pipe.pipeline_depth == len(pipe.stages)
    assert all(e.dst > e.src for e in pipe.edges)


def test_piper_search_space_grows_with_branches() -> None:
    cluster = load_cluster("graphpipe-v100")
    cost = CostModel.for_device(cluster.devices()[0].type)
    chain_like = build_tree(load_graph(build("gpt", "tiny")), cost, 64)
    branchy = build_tree(load_graph(build("dlrm", "paper")), cost, 64)
    assert piper_ideals(chain_like) < 10 * chain_like.num_units
    assert piper_ideals(branchy) > 10**6
