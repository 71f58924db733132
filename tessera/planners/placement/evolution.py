"""Collage's graph-level placement optimizer: evolutionary search over offloading decisions.

An individual is one bit per operator the op-level DP did not put on the graph-level backend (OpenVINO,
else TVM: :func:`graph_level_backend`); 1 offloads it into maximal convex regions (:func:`offload_groups`).
Seeded with all zeros and all ones; elitism, tournament selection, two-point crossover, bit-flip mutation;
fitness is the measured end-to-end latency. Seeded, deterministic given the fitness values; stops at
saturation, after ``generations``, or at the time budget.

References: Collage paper §4.3, Fig. 6; thesis §2.4.3. Details: docs/placement.md.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import networkx as nx

from tessera.backends.patterns import is_convex
from tessera.core.graph import Graph

log = logging.getLogger(__name__)

GRAPH_LEVEL_BACKENDS = ("openvino", "tvm", "tensorrt")

Bits = tuple[int, ...]
Group = tuple[str, frozenset[str], str]  # backend, nodes, via


@dataclass(frozen=True)
class EvolutionOptions:
    population: int = 12
    generations: int = 30
    patience: int = 4  # generations without a better individual: saturation
    tournament: int = 3
    crossover_rate: float = 0.9
    mutation_rate: float | None = None  # per bit; default 1 / number of bits
    elite: int = 2
    budget_s: float | None = 60.0
    seed: int = 0


@dataclass
class EvolutionResult:
    best: Bits
    best_fitness: float
    generations: int
    evaluations: int
    stopped: str  # "saturation" | "generations" | "budget" | "no bits"
    history: list[float] = field(default_factory=list)  # best fitness after each generation


def graph_level_backend(available: Iterable[str]) -> str | None:
    """The graph inference library the graph-level search offloads to (first available of
    :data:`GRAPH_LEVEL_BACKENDS`)."""
    names = set(available)
    return next((b for b in GRAPH_LEVEL_BACKENDS if b in names), None)


def evolve(
    n_bits: int,
    fitness: Callable[[Bits], float],
    seeds: Sequence[Bits],
    options: EvolutionOptions = EvolutionOptions(),
    *,
    clock: Callable[[], float] = time.monotonic,
) -> EvolutionResult:
    """Minimize ``fitness`` over bit strings of length ``n_bits`` (see the module docstring)."""
    rng = random.Random(options.seed)
    scorer = _Scorer(fitness, clock, options.budget_s)
    memo, score, out_of_time = scorer.memo, scorer.score, scorer.out_of_time
    if n_bits == 0:
        empty: Bits = ()
        return EvolutionResult(empty, score(empty), 0, len(memo), "no bits", [memo[empty]])

    population = _first_population(rng, n_bits, seeds, options.population)
    for ind in population:
        score(ind)
        if out_of_time():
            break
    scored = [i for i in population if i in memo]
    best = min(scored, key=lambda i: (memo[i], i))
    history = [memo[best]]
    mutation = options.mutation_rate if options.mutation_rate is not None else 1.0 / n_bits
    stale, generation, stopped = 0, 0, "generations"
    while generation < options.generations:
        if out_of_time():
            stopped = "budget"
            break
        generation += 1
        scored_before, scored = scored, []
        for child in _children(rng, scored_before, memo, options, mutation):
            if out_of_time() and child not in memo:
                continue
            score(child)
            scored.append(child)
        new_best = min(scored, key=lambda i: (memo[i], i))
        if memo[new_best] < memo[best]:
            best, stale = new_best, 0
        else:
            stale += 1
        history.append(memo[best])
        if stale >= options.patience:
            stopped = "saturation"
            break
    return EvolutionResult(best, memo[best], generation, len(memo), stopped, history)


class _Scorer:
    """Fitness memoized per individual, and the search's time budget (None: none)."""

    def __init__(self, fitness: Callable[[Bits], float], clock: Callable[[], float], budget_s: float | None):
        self.fitness, self.clock, self.budget_s = fitness, clock, budget_s
        self.memo: dict[Bits, float] = {}
        self.start = clock()

    def out_of_time(self) -> bool:
        return self.budget_s is not None and self.clock() - self.start > self.budget_s

    def score(self, bits: Bits) -> float:
        if bits not in self.memo:
            self.memo[bits] = self.fitness(bits)
        return self.memo[bits]


def _first_population(rng: random.Random, n_bits: int, seeds: Sequence[Bits], size: int) -> list[Bits]:
    """The seeds (each once), then random individuals up to ``size``."""
    population: list[Bits] = []
    for s in seeds:
        if len(s) != n_bits:
            raise ValueError(f"seed individual has {len(s)} bits, expected {n_bits}")
        if tuple(s) not in population:
            population.append(tuple(s))
    while len(population) < max(size, len(population)):
        population.append(tuple(rng.randint(0, 1) for _ in range(n_bits)))
    return population


def _children(
    rng: random.Random,
    scored: Sequence[Bits],
    memo: dict[Bits, float],
    options: EvolutionOptions,
    mutation: float,
) -> list[Bits]:
    """The next generation: the elite, then tournament winners crossed over in pairs and mutated."""
    ranked = sorted(scored, key=lambda i: (memo[i], i))
    children: list[Bits] = ranked[: options.elite]
    n_bits = len(scored[0])
    while len(children) < options.population:
        a = _tournament(rng, scored, memo, options.tournament)
        b = _tournament(rng, scored, memo, options.tournament)
        if rng.random() < options.crossover_rate and n_bits > 1:
            a, b = _two_point_crossover(rng, a, b)
        for child in (a, b):
            child = tuple(bit ^ 1 if rng.random() < mutation else bit for bit in child)
            if len(children) < options.population:
                children.append(child)
    return children


def _tournament(rng: random.Random, pool: Sequence[Bits], memo: dict[Bits, float], k: int) -> Bits:
    picks = [pool[rng.randrange(len(pool))] for _ in range(max(1, k))]
    return min(picks, key=lambda i: (memo[i], i))


def _two_point_crossover(rng: random.Random, a: Bits, b: Bits) -> tuple[Bits, Bits]:
    i, j = sorted(rng.sample(range(len(a) + 1), 2))
    return a[:i] + b[i:j] + a[j:], b[:i] + a[i:j] + b[j:]


# --- individuals as placements ------------------------------------------------------------------


def offload_groups(
    graph: Graph, op_groups: Sequence[Group], graph_backend: str, offload: Iterable[str]
) -> list[Group]:
    """The placement of an individual: ``op_groups`` with the ``offload`` operators moved to
    ``graph_backend``, merged with its groups into maximal convex regions whose group graph stays a DAG.

    Constant operators follow their readers: one whose readers all end on ``graph_backend`` moves too.
    """
    moved = set(offload)
    on_graph = {n for b, nodes, _ in op_groups if b == graph_backend for n in nodes} | moved
    changed = True
    while changed:
        changed = False
        for n in graph.constant_nodes:
            succ = set(graph.dag.successors(n))
            if n not in on_graph and succ and succ <= on_graph:
                on_graph.add(n)
                changed = True
    groups: list[Group] = []
    for backend, nodes, via in op_groups:
        if backend == graph_backend:
            groups.append((backend, nodes, via))
            continue
        rest = nodes - on_graph
        if not rest:
            continue
        if rest == nodes:
            groups.append((backend, nodes, via))
            continue
        for part in _convex_parts(graph, rest):
            groups.append((backend, part, f"{via} (split)"))
    for n in graph.order:
        if n in on_graph and not any(n in g[1] for g in groups if g[0] == graph_backend):
            groups.append((graph_backend, frozenset([n]), "graph-level offload"))
    return _merge_regions(graph, groups, graph_backend)


def _convex_parts(graph: Graph, nodes: frozenset[str]) -> list[frozenset[str]]:
    parts = []
    for comp in nx.weakly_connected_components(graph.dag.subgraph(nodes)):
        comp = frozenset(comp)
        if is_convex(graph, comp):
            parts.append(comp)
        else:
            parts.extend(frozenset([n]) for n in comp)
    index = {n: i for i, n in enumerate(graph.order)}
    return sorted(parts, key=lambda p: min(index[n] for n in p))


def _merge_regions(graph: Graph, groups: list[Group], backend: str) -> list[Group]:
    """Greedily merge adjacent groups of ``backend`` (edges in model order) while the group graph
    stays acyclic (a merge of A → B is refused when another path leads from A to B)."""
    of = {n: i for i, (_, nodes, _) in enumerate(groups) for n in nodes}
    q = graph.quotient(nodes for _, nodes, _ in groups)
    parent = list(range(len(groups)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    index = {n: i for i, n in enumerate(graph.order)}
    edges = sorted(graph.dag.edges, key=lambda e: (index[e[0]], index[e[1]]))
    for u, v in edges:
        a, b = find(of[u]), find(of[v])
        if a == b or groups[a][0] != backend or groups[b][0] != backend:
            continue
        # A cycle would appear iff B is reachable from A other than by the direct edge.
        others = [s for s in q.successors(a) if s != b]
        if any(nx.has_path(q, s, b) for s in others):
            continue
        nx.contracted_nodes(q, a, b, self_loops=False, copy=False)
        parent[b] = a
    merged: dict[int, set[str]] = {}
    for i, (_, nodes, _) in enumerate(groups):
        merged.setdefault(find(i), set()).update(nodes)
    out = []
    for root, nodes in merged.items():
        b, _, via = groups[root]
        parts = sum(1 for i in range(len(groups)) if find(i) == root)
        out.append((b, frozenset(nodes), via if parts == 1 else f"graph-level region ({parts} merged)"))
    return sorted(out, key=lambda g: min(index[n] for n in g[1]))
