"""Pattern rules and the pattern generator, for backends whose fusion engine is too rich to enumerate.

A :class:`PatternRule` gives an operator checker ``op_rule(op)`` and a fusion checker
``fusion_rule(group_kind, src, sink)``; :func:`generate_groups` grows a group from every accepted seed
operator to its successive post-dominators while both hold. Operators are classified by :class:`OpKind`
(TVM's operator pattern kinds); a group's kind is the largest among its operators.

References: Collage paper §3, Listing 1 ("Method 2"); thesis Fig. 2.4. Details: docs/backends.md.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from functools import cached_property

import networkx as nx

from tessera.backends.patterns import is_convex
from tessera.core.graph import Graph, OpNode

__all__ = [
    "ElementwiseFusionRule",
    "GraphCompilerRule",
    "OpKind",
    "PatternRule",
    "RuleNode",
    "SingleOpRule",
    "check_path",
    "generate_groups",
    "immediate_post_dominators",
    "op_kind",
]


class OpKind(enum.IntEnum):
    """TVM's operator pattern kinds (``relay/op/op_attr_types.h``), ordered by fusion difficulty."""

    ELEMWISE = 0
    BROADCAST = 1
    INJECTIVE = 2
    COMM_REDUCE = 3
    OUT_ELEMWISE_FUSABLE = 4  # conv, matmul: can absorb elementwise operators after them
    TUPLE = 7
    OPAQUE = 8


ELEMWISE_OPS = frozenset(
    {
        "Relu", "Sigmoid", "Tanh", "Erf", "Exp", "Log", "Sqrt", "Reciprocal", "Neg", "Abs", "Ceil",
        "Floor", "Round", "Sign", "Sin", "Cos", "Softplus", "Softsign", "Elu", "Selu", "LeakyRelu",
        "HardSigmoid", "HardSwish", "Gelu", "Mish", "Not", "IsNaN", "IsInf", "Clip", "Cast", "Identity",
    }
)  # fmt: skip
BROADCAST_OPS = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "PRelu", "Where", "Equal",
     "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Mod", "BatchNormalization"}
)  # fmt: skip
INJECTIVE_OPS = frozenset(
    {"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Slice", "Gather", "Concat",
     "Split", "Tile", "Pad", "DepthToSpace", "SpaceToDepth", "Trilu", "ConstantOfShape", "Constant",
     "Resize", "Shape", "Range"}
)  # fmt: skip
REDUCE_OPS = frozenset(
    {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceLogSumExp",
     "ArgMax", "ArgMin", "GlobalAveragePool", "GlobalMaxPool", "Softmax", "LogSoftmax",
     "LayerNormalization", "MaxPool", "AveragePool"}
)  # fmt: skip
FUSABLE_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum"})


def op_kind(op: OpNode) -> OpKind:
    """The default kind of an ONNX operator (TVM's classification of the equivalent Relay op)."""
    t = op.op_type
    if t in ELEMWISE_OPS:
        return OpKind.ELEMWISE
    if t in BROADCAST_OPS:
        return OpKind.BROADCAST
    if t in INJECTIVE_OPS:
        return OpKind.INJECTIVE
    if t in REDUCE_OPS:
        return OpKind.COMM_REDUCE
    if t in FUSABLE_OPS:
        return OpKind.OUT_ELEMWISE_FUSABLE
    return OpKind.OPAQUE


@dataclass(frozen=True)
class RuleNode:
    """A node as a rule sees it: the operator, its kind under the rule, and the graph around it."""

    name: str
    graph: Graph
    rule: PatternRule

    @property
    def op(self) -> OpNode:
        return self.graph.op(self.name)

    @property
    def op_type(self) -> str:
        return self.op.op_type

    @property
    def kind(self) -> Hashable:
        return self.rule.op_kind(self.op)


class PatternRule:
    """Base of pattern rules (Listing 1's ``BasePatternRule``): override the three checks.

    ``op_rule(op)``: can the backend run this operator at all? ``op_kind(op)``: the operator's
    class under this rule. ``fusion_rule(group_kind, src, sink)``: may the group seeded at ``src``,
    whose kind so far is ``group_kind``, grow to ``sink`` (``src``'s next post-dominator)?
    ``merge_kind`` gives the kind of the grown group. ``max_ops`` caps a group's size (0: no cap).
    """

    name: str = "rule"
    max_ops: int = 0

    def op_rule(self, op: OpNode) -> bool:
        return False

    def op_kind(self, op: OpNode) -> Hashable:
        return op_kind(op)

    def fusion_rule(self, group_kind: Hashable, src: RuleNode, sink: RuleNode) -> bool:
        return False

    def merge_kind(self, group_kind: Hashable, members: Iterable[RuleNode]) -> Hashable:
        kinds = [group_kind, *(m.kind for m in members)]
        try:
            return max(kinds)  # type: ignore[type-var]
        except TypeError:
            return group_kind

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def check_path(src: RuleNode, sink: RuleNode, fchecker: Callable[[Hashable], bool]) -> bool:
    """Whether ``fchecker(kind)`` holds for every operator on a path from ``src`` to ``sink``.

    ``src`` itself is excluded, ``sink`` included (Listing 1's ``collage.check_path``).
    """
    return all(
        fchecker(RuleNode(n, src.graph, src.rule).kind) for n in nodes_between(src.graph, src.name, sink.name)
    )


def nodes_between(graph: Graph, src: str, sink: str) -> list[str]:
    """Operators on some path ``src`` → ``sink``, ``src`` excluded and ``sink`` included, in order."""
    between = (nx.descendants(graph.dag, src) & nx.ancestors(graph.dag, sink)) | {sink}
    return [n for n in graph.order if n in between]


class SingleOpRule(PatternRule):
    """One operator per group: for operator libraries (or runtimes measured op by op)."""

    def __init__(self, ops: Iterable[str] | None = None, *, name: str = "single-op") -> None:
        self.ops = frozenset(ops) if ops is not None else None
        self.name = name

    def op_rule(self, op: OpNode) -> bool:
        return self.ops is None or op.op_type in self.ops


class ElementwiseFusionRule(PatternRule):
    """Listing 1's rule: a group with a conv/matmul (kFusable) absorbs the elementwise and
    broadcast operators up to its post-dominator; elementwise groups fuse with each other."""

    def __init__(
        self, ops: Iterable[str] | None = None, *, name: str = "elementwise-fusion", max_ops: int = 0
    ):
        self.ops = frozenset(ops) if ops is not None else None
        self.name = name
        self.max_ops = max_ops

    def op_rule(self, op: OpNode) -> bool:
        return self.ops is None or op.op_type in self.ops

    def fusion_rule(self, group_kind: Hashable, src: RuleNode, sink: RuleNode) -> bool:
        def fchecker(kind: Hashable) -> bool:
            return kind in (OpKind.ELEMWISE, OpKind.BROADCAST)

        if group_kind in (OpKind.OUT_ELEMWISE_FUSABLE, OpKind.ELEMWISE, OpKind.BROADCAST):
            return check_path(src, sink, fchecker)
        return False


class GraphCompilerRule(PatternRule):
    """A graph compiler (TVM, OpenVINO, TensorRT): any region of supported operators between a seed
    and its post-dominators is one candidate, up to ``max_ops`` operators."""

    def __init__(self, ops: Iterable[str] | None = None, *, name: str = "graph-compiler", max_ops: int = 64):
        self.ops = frozenset(ops) if ops is not None else None
        self.name = name
        self.max_ops = max_ops

    def op_rule(self, op: OpNode) -> bool:
        return self.ops is None or op.op_type in self.ops

    def fusion_rule(self, group_kind: Hashable, src: RuleNode, sink: RuleNode) -> bool:
        return True


# --- the generator ---------------------------------------------------------------------------

VIRTUAL_SINK = "__tessera_virtual_sink__"


def immediate_post_dominators(graph: Graph) -> dict[str, str | None]:
    """Each operator's immediate post-dominator (``None`` when only the virtual sink post-dominates it).

    Immediate dominators of the reversed DAG rooted at a virtual sink; operators that produce a graph
    output or have no successor feed the sink.
    """
    rev = graph.dag.reverse(copy=True)
    rev.add_node(VIRTUAL_SINK)
    for name in graph.dag.nodes:
        op = graph.op(name)
        if graph.dag.out_degree(name) == 0 or any(t in graph.outputs for t in op.outputs):
            rev.add_edge(VIRTUAL_SINK, name)
    idom = nx.immediate_dominators(rev, VIRTUAL_SINK)
    return {n: (None if idom.get(n) in (None, VIRTUAL_SINK) else idom[n]) for n in graph.dag.nodes}


@dataclass(frozen=True)
class Group:
    """A group the generator found: its operators, the seed and sink, and its kind."""

    nodes: frozenset[str]
    seed: str
    sink: str
    kind: Hashable


class _Generator:
    def __init__(self, graph: Graph, rule: PatternRule) -> None:
        self.graph = graph
        self.rule = rule

    @cached_property
    def post_dominator(self) -> dict[str, str | None]:
        return immediate_post_dominators(self.graph)

    def node(self, name: str) -> RuleNode:
        return RuleNode(name, self.graph, self.rule)

    def groups_from(self, seed: str) -> list[Group]:
        rule = self.rule
        if not rule.op_rule(self.graph.op(seed)):
            return []
        kind = rule.op_kind(self.graph.op(seed))
        members = {seed}
        found = [Group(frozenset(members), seed, seed, kind)]
        current = seed
        while (sink := self.post_dominator.get(current)) is not None:
            added = [n for n in nodes_between(self.graph, current, sink) if n not in members]
            grown = members | set(added)
            if rule.max_ops and len(grown) > rule.max_ops:
                break
            if not all(rule.op_rule(self.graph.op(n)) for n in added):
                break
            if not rule.fusion_rule(kind, self.node(seed), self.node(sink)):
                break
            if not is_convex(self.graph, grown):  # holds by post-dominance; checked for safety
                break
            kind = rule.merge_kind(kind, [self.node(n) for n in added])
            members = grown
            found.append(Group(frozenset(members), seed, sink, kind))
            current = sink
        return found


def generate_groups(graph: Graph, rule: PatternRule) -> list[Group]:
    """Every valid group ``rule`` admits on ``graph`` (Collage Fig. 2.4), deduplicated, in seed order."""
    gen = _Generator(graph, rule)
    seen: set[frozenset[str]] = set()
    out: list[Group] = []
    for seed in graph.order:
        for group in gen.groups_from(seed):
            if group.nodes not in seen:
                seen.add(group.nodes)
                out.append(group)
    return out
