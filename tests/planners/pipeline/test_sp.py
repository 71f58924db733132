from __future__ import annotations

from planners.pipeline.gpp_graphs import chain, n_shaped

from tessera.core.graph import load_graph
from tessera.models import build
from tessera.planners.pipeline.sp import decompose


def _covers(graph, tree) -> None:
    assert sorted(n for u in tree.units for n in u) == sorted(graph.order)
    assert set(tree.unit_of) == set(graph.order)


def test_multi_branch_model_has_a_parallel_block() -> None:
    g = load_graph(build("mmt", "tiny"))
    tree = decompose(g, max_units=1000)
    _covers(g, tree)
    assert tree.root.kind == "series"
    assert tree.root.children[0].kind == "parallel"
    assert len(tree.root.children[0].children) == 2
    assert tree.converted == 0


def test_coarsening_bounds_units_and_keeps_costs() -> None:
    g = load_graph(build("mmt", "paper"))
    fine = decompose(g, max_units=10_000)
    coarse = decompose(g, max_units=64)
    assert coarse.num_units <= 64 < fine.num_units
    assert abs(coarse.root.cost - fine.root.cost) < 1e-6 * fine.root.cost
    _covers(g, coarse)


def test_non_series_parallel_graph_is_linearized() -> None:
    g = n_shaped()
    tree = decompose(g, max_units=100)
    _covers(g, tree)
    assert tree.converted == 1
    # The units' depth-first order is topological.
    pos = {n: i for i, u in enumerate(tree.units) for n in u}
    assert all(pos[u] <= pos[v] for u, v in g.dag.edges)


def test_chain_is_one_series_and_constants_are_attached() -> None:
    g = chain(4)
    tree = decompose(g, max_units=100)
    assert tree.root.kind == "series"
    gpt = load_graph(build("gpt", "tiny"))
    tree = decompose(gpt, max_units=50)
    _covers(gpt, tree)


def test_a_model_with_nothing_to_pipeline_is_bad_input() -> None:
    """A Constant-only model loads (``inspect`` shows it) but has no operator on an activation:
    an InputError naming the model (exit 2), not a ValueError (an internal error, exit 1)."""
    import numpy as np
    import onnx
    import pytest
    from onnx import TensorProto, helper, numpy_helper

    from tessera.core.errors import InputError

    value = numpy_helper.from_array(np.ones((2, 2), np.float32))
    node = helper.make_node("Constant", [], ["y"], value=value, name="c")
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
    model = helper.make_model(
        helper.make_graph([node], "g", [], [out]), opset_imports=[helper.make_opsetid("", 17)]
    )
    onnx.checker.check_model(model)
    with pytest.raises(InputError, match="nothing to pipeline"):
        decompose(load_graph(model))


def test_a_stage_edge_of_shapes_and_masks_takes_no_gradient(tmp_path) -> None:
    """Stage 0 sends stage 2 an int64 Shape and a bool mask, and stage 1 an fp32 activation: only
    the edges with a floating tensor bring a gradient back (as the stage workers send one)."""
    from onnx_builders import shape_passing_chain

    from tessera.core.cost import CostModel
    from tessera.core.specs import load_cluster
    from tessera.planners.pipeline.links import stage_edges

    path = tmp_path / "shapes.onnx"
    path.write_bytes(shape_passing_chain().SerializeToString())
    graph = load_graph(str(path), input_shapes={"x": (4, 8)})
    tree = decompose(graph, max_units=100)
    stage_of = {"matmul0": 0, "tanh0": 0, "shape": 0, "greater": 0, "matmul1": 1}
    unit_stage = {tree.unit_of[op]: stage_of.get(op, 2) for op in graph.order}
    cost = CostModel.for_device(load_cluster("local-cpu-split").devices()[0].type)
    edges = {(e.src, e.dst): e for e in stage_edges(graph, tree, unit_stage, cost)}
    assert {k: sorted(t for t, _ in e.tensors) for k, e in edges.items()} == {
        (0, 1): ["h0"],
        (0, 2): ["mask", "shape"],
        (1, 2): ["m1"],
    }
    assert {k: e.grads for k, e in edges.items()} == {(0, 1): True, (0, 2): False, (1, 2): True}


def test_a_tensor_of_a_length_the_data_chose_never_crosses_a_stage_boundary() -> None:
    """NonZero → Transpose → GatherND → ReduceSum carry tensors no shape inference resolves: a stage
    could not size a buffer to receive one, so the four (and whatever lies on a path between them)
    are one unit however finely the model is cut."""
    from onnx_builders import routed_chain

    graph = load_graph(routed_chain(), input_shapes={"x": (4, 8)})
    assert graph.tensors["picked"].shape is None
    tree = decompose(graph, max_units=100)
    _covers(graph, tree)
    routed = {tree.unit_of[op] for op in ("nonzero", "transpose", "gathernd", "reducesum")}
    assert len(routed) == 1
    assert len(tree.units) >= 5  # the rest is still cut operator by operator
    assert tree.unit_of["matmul0"] not in routed and tree.unit_of["matmul1"] not in routed
