"""A pattern language over the graph IR, after Collage's extension of the Relay pattern language.

Patterns compose like calls rooted at the group's result, e.g.
``is_op("Relu")(is_op("Add")(is_op("Conv")(wildcard(), wildcard()), wildcard()))``; arguments match the
producers of a node's inputs in ONNX order, trailing inputs are free, commutative binary operators match
either way round. :meth:`Pattern.match` returns the covered operator set or ``None``; a match must be
convex (:func:`is_convex`) to run as one kernel.

References: Collage paper §3, Listing 1 ("Method 1"); thesis §2.3. Details: docs/backends.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from tessera.core.graph import Graph, OpNode, TensorInfo

__all__ = [
    "AltPattern",
    "ConstantPattern",
    "OpPattern",
    "Pattern",
    "WildcardPattern",
    "find_matches",
    "is_constant",
    "is_convex",
    "is_op",
    "wildcard",
]

# Operators whose two inputs may be swapped (Relay's matcher does the same for add/multiply).
COMMUTATIVE_OPS = frozenset({"Add", "Mul", "Max", "Min", "Sum", "Mean", "And", "Or", "Xor", "Equal"})

Shape = Sequence[int | None]


@dataclass(frozen=True)
class _Constraints:
    """Checks on the tensor a pattern produces (shape, dtype) and on its operator (attrs, predicates)."""

    attrs: tuple[tuple[str, Any], ...] = ()
    shape: tuple[int | None, ...] | None = None
    dtype: str | None = None
    predicates: tuple[Callable[[OpNode], bool], ...] = ()

    def tensor_ok(self, info: TensorInfo | None) -> bool:
        if self.dtype is not None and (info is None or info.dtype != self.dtype):
            return False
        if self.shape is not None:
            if info is None or info.shape is None or len(info.shape) != len(self.shape):
                return False
            if any(
                want is not None and want != got for want, got in zip(self.shape, info.shape, strict=True)
            ):
                return False
        return True

    def op_ok(self, op: OpNode | None) -> bool:
        if not self.attrs and not self.predicates:
            return True
        if op is None:
            return False
        for key, want in self.attrs:
            if key not in op.attributes or not _same_value(op.attributes[key], want):
                return False
        return all(pred(op) for pred in self.predicates)


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list | tuple) else value


def _same_value(got: Any, want: Any) -> bool:
    if isinstance(got, list | tuple) and isinstance(want, list | tuple):
        return len(got) == len(want) and all(_same_value(g, w) for g, w in zip(got, want, strict=True))
    return bool(got == want)


@dataclass(frozen=True)
class Pattern:
    """Base of every pattern; immutable, so sub-patterns can be shared and reused."""

    constraints: _Constraints = field(default_factory=_Constraints, kw_only=True)

    # -- building ------------------------------------------------------------------------------

    def has_attr(self, attrs: Mapping[str, Any]) -> Pattern:
        """Require operator attributes (ONNX attribute name → value; lists compare element-wise)."""
        c = self.constraints
        merged = dict(c.attrs) | {k: _frozen(v) for k, v in attrs.items()}
        return self._with(_Constraints(tuple(sorted(merged.items())), c.shape, c.dtype, c.predicates))

    def has_shape(self, shape: Shape) -> Pattern:
        """Require the produced tensor's shape; ``None`` in a position matches any size."""
        c = self.constraints
        return self._with(_Constraints(c.attrs, tuple(shape), c.dtype, c.predicates))

    def has_dtype(self, dtype: str) -> Pattern:
        """Require the produced tensor's dtype (numpy name: ``"float32"``, ``"int64"``, …)."""
        c = self.constraints
        return self._with(_Constraints(c.attrs, c.shape, str(dtype), c.predicates))

    def where(self, predicate: Callable[[OpNode], bool]) -> Pattern:
        """Require ``predicate(op)`` of the matched operator (any Python check)."""
        c = self.constraints
        return self._with(_Constraints(c.attrs, c.shape, c.dtype, (*c.predicates, predicate)))

    def __or__(self, other: Pattern) -> Pattern:
        return AltPattern(alternatives=(self, other))

    def __call__(self, *args: Pattern) -> Pattern:
        raise TypeError(f"{type(self).__name__} cannot be called with arguments")

    def _with(self, constraints: _Constraints) -> Pattern:
        return _replace(self, constraints=constraints)

    # -- matching ------------------------------------------------------------------------------

    def match(self, graph: Graph, root: str) -> frozenset[str] | None:
        """The operator nodes the pattern covers when its outermost call matches ``root``.

        Returns ``None`` when the pattern does not match there, when it covers no operator (a bare
        wildcard), or when the covered set is not convex.
        """
        for nodes in self._match_tensor(graph, _output_of(graph, root), root):
            if nodes and is_convex(graph, nodes):
                return frozenset(nodes)
        return None

    def _match_tensor(self, graph: Graph, tensor: str | None, producer: str | None) -> Iterator[set[str]]:
        """Every way the pattern can produce ``tensor`` (made by ``producer``): the node sets covered."""
        raise NotImplementedError


def _replace(pattern: Pattern, **changes: Any) -> Pattern:
    import dataclasses

    return dataclasses.replace(pattern, **changes)


def _output_of(graph: Graph, node: str) -> str | None:
    outputs = [t for t in graph.op(node).outputs if t]
    return outputs[0] if outputs else None


@dataclass(frozen=True)
class WildcardPattern(Pattern):
    """Matches any tensor; covers no operator."""

    def _match_tensor(self, graph: Graph, tensor: str | None, producer: str | None) -> Iterator[set[str]]:
        info = graph.tensors.get(tensor) if tensor else None
        op = graph.op(producer) if producer else None
        if self.constraints.tensor_ok(info) and self.constraints.op_ok(op):
            yield set()


@dataclass(frozen=True)
class ConstantPattern(Pattern):
    """Matches a weight: an initializer, or the output of an operator that reads no activation."""

    def _match_tensor(self, graph: Graph, tensor: str | None, producer: str | None) -> Iterator[set[str]]:
        constant = tensor in graph.initializers or (producer is not None and producer in graph.constant_nodes)
        if constant and self.constraints.tensor_ok(graph.tensors.get(tensor) if tensor else None):
            yield set()


@dataclass(frozen=True)
class OpPattern(Pattern):
    """Matches an operator of one of ``op_types``; call it with argument patterns to constrain inputs."""

    op_types: frozenset[str] = frozenset()
    args: tuple[Pattern, ...] | None = None

    def __call__(self, *args: Pattern) -> Pattern:
        if self.args is not None:
            raise TypeError("the pattern already has arguments")
        for a in args:
            if not isinstance(a, Pattern):
                raise TypeError(f"pattern arguments must be patterns, not {type(a).__name__}")
        return _replace(self, args=tuple(args))

    def _match_tensor(self, graph: Graph, tensor: str | None, producer: str | None) -> Iterator[set[str]]:
        if producer is None or producer not in graph.dag:
            return
        op = graph.op(producer)
        if op.op_type not in self.op_types or not self.constraints.op_ok(op):
            return
        if not self.constraints.tensor_ok(graph.tensors.get(tensor) if tensor else None):
            return
        if self.args is None:
            yield {producer}
            return
        inputs = list(op.inputs)
        if len(inputs) < len(self.args):
            return
        orders: list[tuple[Pattern, ...]] = [self.args]
        if op.op_type in COMMUTATIVE_OPS and len(self.args) == 2 and self.args[0] != self.args[1]:
            orders.append((self.args[1], self.args[0]))
        for order in orders:
            choices = []
            for arg, t in zip(order, inputs, strict=False):
                src = graph.producer.get(t) if t else None
                choices.append(list(arg._match_tensor(graph, t or None, src)))
            for combo in itertools.product(*choices):
                yield {producer}.union(*combo)


@dataclass(frozen=True)
class AltPattern(Pattern):
    """Matches if any alternative does (``a | b``), trying them in order."""

    alternatives: tuple[Pattern, ...] = ()

    def __or__(self, other: Pattern) -> Pattern:
        return AltPattern(alternatives=(*self.alternatives, other))

    def __call__(self, *args: Pattern) -> Pattern:
        return AltPattern(alternatives=tuple(a(*args) for a in self.alternatives))

    def _match_tensor(self, graph: Graph, tensor: str | None, producer: str | None) -> Iterator[set[str]]:
        info = graph.tensors.get(tensor) if tensor else None
        op = graph.op(producer) if producer else None
        if not (self.constraints.tensor_ok(info) and self.constraints.op_ok(op)):
            return
        for alt in self.alternatives:
            yield from alt._match_tensor(graph, tensor, producer)


def is_op(*op_types: str) -> OpPattern:
    """An operator of any of ``op_types`` (ONNX op type names, e.g. ``"Conv"``)."""
    if not op_types:
        raise ValueError("is_op needs at least one op type")
    return OpPattern(op_types=frozenset(op_types))


def wildcard() -> WildcardPattern:
    """Any tensor: an activation, a graph input or a weight."""
    return WildcardPattern()


def is_constant() -> ConstantPattern:
    """A weight (initializer) or the output of an operator that reads no activation."""
    return ConstantPattern()


def find_matches(graph: Graph, pattern: Pattern) -> list[frozenset[str]]:
    """Every distinct convex match of ``pattern`` in ``graph``, rooted at each node in order."""
    seen: set[frozenset[str]] = set()
    found: list[frozenset[str]] = []
    for root in graph.order:
        nodes = pattern.match(graph, root)
        if nodes is not None and nodes not in seen:
            seen.add(nodes)
            found.append(nodes)
    return found


def is_convex(graph: Graph, nodes: Iterable[str]) -> bool:
    """Whether no path leaves ``nodes`` and re-enters it (a subgraph that can run as one unit).

    Walks forward from the set's outside successors, never past the last member in topological
    order (nothing later can lead back in); the set is convex iff no member is reached.
    """
    members = set(nodes)
    if len(members) <= 1:
        return True
    rank = _topo_rank(graph)
    last = max(rank[n] for n in members)
    frontier = [s for n in members for s in graph.dag.successors(n) if s not in members and rank[s] < last]
    seen = set(frontier)
    while frontier:
        node = frontier.pop()
        for succ in graph.dag.successors(node):
            if succ in members:
                return False
            if succ not in seen and rank[succ] < last:
                seen.add(succ)
                frontier.append(succ)
    return True


def _topo_rank(graph: Graph) -> dict[str, int]:
    order = graph.order if len(graph.order) == graph.dag.number_of_nodes() else nx.topological_sort(graph.dag)
    return {n: i for i, n in enumerate(order)}
