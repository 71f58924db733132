"""GraphPipe's greedy micro-batch scheduler, as written: per stage in reverse topological order, a
backward whenever it does not delay the stage (``IsTimeOptimal`` on the simulator).

References: GraphPipe thesis §3.10.1, Algorithm 4.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from tessera.core.schedule import gpipe
from tessera.planners.sim import SimEdge, SimStage, simulate

_TOLERANCE = 1e-9


def greedy_schedules(
    stages: Sequence[SimStage], edges: Sequence[SimEdge], mini_batch: int
) -> dict[int, list[str]]:
    """Algorithm 4 for every stage (see the module docstring); ``stages``' actions are ignored."""
    graph = nx.DiGraph()
    graph.add_nodes_from(s.id for s in stages)
    graph.add_edges_from((e.src, e.dst) for e in edges)
    by_id = {s.id: s for s in stages}
    schedules: dict[int, list[str]] = {}
    for sid in reversed(list(nx.lexicographical_topological_sort(graph))):
        below = nx.descendants(graph, sid)
        others = {j: schedules[j] for j in below}
        sub_edges = [e for e in edges if e.src in below | {sid} and e.dst in below]
        schedules[sid] = greedy_stage(
            by_id[sid], [by_id[j] for j in sorted(below)], others, sub_edges, mini_batch
        )
    return schedules


def greedy_stage(
    stage: SimStage,
    successors: Sequence[SimStage],
    schedules: dict[int, list[str]],
    edges: Sequence[SimEdge],
    mini_batch: int,
) -> list[str]:
    """Algorithm 4 for one stage, given the fixed schedules of every stage below it."""
    m = mini_batch // stage.micro_batch_size
    fixed = [_with_actions(s, schedules[s.id]) for s in successors]

    def finish(actions: list[str]) -> float:
        try:
            result = simulate([_with_actions(stage, actions), *fixed], edges, mini_batch, trace=False)
        except ValueError:  # the candidate deadlocks against a successor's schedule (C5)
            return float("inf")
        return result.last_end[stage.id]

    best = finish(gpipe(m))  # the minimum running time (module docstring)
    actions = ["F0"]
    c_f, c_b = 1, 0
    for _ in range(2 * m - 1):
        if c_f == m:
            take_backward = True
        elif c_b == c_f:
            take_backward = False
        else:
            candidate = actions + [f"B{c_b}"] + _one_f_one_b_tail(m, c_f, c_b + 1)
            take_backward = finish(candidate) <= best * (1 + _TOLERANCE)
        if take_backward:
            actions.append(f"B{c_b}")
            c_b += 1
        else:
            actions.append(f"F{c_f}")
            c_f += 1
    return actions


def _one_f_one_b_tail(m: int, c_f: int, c_b: int) -> list[str]:
    """``fw_{c_f+1} bw_{c_b+1} fw_{c_f+2} …`` until the forwards run out, then the backwards
    (0-based: next forward ``c_f``, next backward ``c_b``)."""
    tail: list[str] = []
    while c_b < m:
        if c_f < m:
            tail.append(f"F{c_f}")
            c_f += 1
        tail.append(f"B{c_b}")
        c_b += 1
    return tail


def _with_actions(stage: SimStage, actions: list[str]) -> SimStage:
    return SimStage(
        stage.id,
        stage.micro_batch_size,
        stage.forward_time,
        stage.backward_time,
        tuple(actions),
        stage.devices,
        0.0,
        stage.static_memory,
        stage.activation_bytes,
    )
