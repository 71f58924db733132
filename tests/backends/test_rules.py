"""Pattern rules and the generator (Collage Fig. 2.4): exact group sets on hand-built graphs."""

from __future__ import annotations

import pytest

from tessera.backends.patterns import is_convex
from tessera.backends.rules import (
    ElementwiseFusionRule,
    GraphCompilerRule,
    OpKind,
    PatternRule,
    RuleNode,
    SingleOpRule,
    check_path,
    generate_groups,
    immediate_post_dominators,
)
from tessera.core.graph import OpNode


@pytest.fixture(scope="module")
def fig(make_graph):
    """conv → {relu1, tanh} → add → relu2 → dense (the shape of the paper's Fig. 4 example)."""
    return make_graph(
        [
            ("conv", "Conv", ["x", "w"], ["c"], {"kernel_shape": [1, 1]}),
            ("relu1", "Relu", ["c"], ["r1"]),
            ("tanh", "Tanh", ["c"], ["t"]),
            ("add", "Add", ["r1", "t"], ["a"]),
            ("relu2", "Relu", ["a"], ["r2"]),
            ("flat", "Flatten", ["r2"], ["f"]),
            ("dense", "MatMul", ["f", "wd"], ["y"]),
        ],
        {"x": [1, 2, 2, 2]},
        ["y"],
        {"w": [2, 2, 1, 1], "wd": [8, 3]},
    )


def sets(groups) -> list[set[str]]:
    return [set(g.nodes) for g in groups]


def test_post_dominators(fig) -> None:
    assert immediate_post_dominators(fig) == {
        "conv": "add",
        "relu1": "add",
        "tanh": "add",
        "add": "relu2",
        "relu2": "flat",
        "flat": "dense",
        "dense": None,
    }


def test_elementwise_fusion_rule_groups(fig) -> None:
    groups = generate_groups(fig, ElementwiseFusionRule())
    assert sets(groups) == [
        {"conv"},
        {"conv", "relu1", "tanh", "add"},
        {"conv", "relu1", "tanh", "add", "relu2"},
        {"relu1"},
        {"relu1", "add"},
        {"relu1", "add", "relu2"},
        {"tanh"},
        {"tanh", "add"},
        {"tanh", "add", "relu2"},
        {"add"},
        {"add", "relu2"},
        {"relu2"},
        {"flat"},
        {"dense"},
    ]
    assert all(is_convex(fig, g.nodes) for g in groups)
    big = groups[2]
    assert (big.seed, big.sink, big.kind) == ("conv", "relu2", OpKind.OUT_ELEMWISE_FUSABLE)


def test_op_rule_stops_growth(fig) -> None:
    no_tanh = ElementwiseFusionRule(ops={"Conv", "Relu", "Add", "MatMul", "Flatten"})
    assert sets(generate_groups(fig, no_tanh)) == [
        {"conv"},  # growing to add would take tanh in
        {"relu1"},
        {"relu1", "add"},
        {"relu1", "add", "relu2"},
        {"add"},
        {"add", "relu2"},
        {"relu2"},
        {"flat"},
        {"dense"},
    ]


def test_single_op_and_graph_compiler_rules(fig) -> None:
    assert sets(generate_groups(fig, SingleOpRule({"Conv", "MatMul"}))) == [{"conv"}, {"dense"}]
    region = sets(generate_groups(fig, GraphCompilerRule(max_ops=5)))
    assert region[:3] == [
        {"conv"},
        {"conv", "relu1", "tanh", "add"},
        {"conv", "relu1", "tanh", "add", "relu2"},
    ]
    assert {"relu2", "flat", "dense"} in region
    assert all(len(g) <= 5 for g in region)
    everything = sets(generate_groups(fig, GraphCompilerRule(max_ops=0)))
    assert set(fig.order) in everything


class ListingOneRule(PatternRule):
    """The paper's Listing 1, in tessera's terms: dense always, conv only with 1x1 kernels,
    elementwise ops; a kFusable group fuses when everything up to the sink is elementwise."""

    kFusable = 0  # noqa: N815 - the paper's names
    kElemwise = 1  # noqa: N815
    kOpaque = 2  # noqa: N815
    name = "listing-1"

    def op_rule(self, op: OpNode) -> bool:
        if op.op_type == "MatMul":
            return True
        if op.op_type == "Conv":
            return op.attributes["kernel_shape"] == [1, 1]
        return op.op_type in ("Relu", "Tanh", "Add")

    def op_kind(self, op: OpNode) -> int:
        if op.op_type in ("Conv", "MatMul"):
            return self.kFusable
        return self.kElemwise if op.op_type in ("Relu", "Tanh", "Add") else self.kOpaque

    def merge_kind(self, group_kind, members):
        return group_kind  # the seed decides

    def fusion_rule(self, group_kind, src: RuleNode, sink: RuleNode) -> bool:
        if group_kind == self.kFusable:

            def fchecker(node_pattern) -> bool:
                return node_pattern == self.kElemwise

            return check_path(src, sink, fchecker)
        return False


def test_listing_one_rule(fig) -> None:
    assert sets(generate_groups(fig, ListingOneRule())) == [
        {"conv"},
        {"conv", "relu1", "tanh", "add"},
        {"conv", "relu1", "tanh", "add", "relu2"},
        {"relu1"},
        {"tanh"},
        {"add"},
        {"relu2"},
        {"dense"},
    ]


def test_generator_on_a_zoo_model(resnext) -> None:
    groups = generate_groups(resnext, ElementwiseFusionRule())
    nodes = {g.nodes for g in groups}
    assert frozenset({"stem/conv", "stem/bn", "stem/relu"}) in nodes
    assert all(is_convex(resnext, g.nodes) for g in groups)
    assert len(nodes) == len(groups)  # deduplicated
