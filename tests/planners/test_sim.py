from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.core.schedule import gpipe, one_f_one_b
from tessera.planners.sim import SimEdge, SimStage, simulate


def _chain(p: int, m: int, f: float, b: float, kind: str, comm: float = 0.0):
    stages = [
        SimStage(
            i, 1, f, b, tuple(gpipe(m) if kind == "gpipe" else one_f_one_b(m, p - i)), activation_bytes=10.0
        )
        for i in range(p)
    ]
    edges = [SimEdge(i, i + 1, bytes_per_sample=comm, bandwidth=1.0) for i in range(p - 1)]
    return stages, edges


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(1, 4), (4, 8), (3, 3), (5, 16)])
def test_closed_form_equal_stages(kind: str, p: int, m: int) -> None:
    f, b = 1.0, 2.0
    stages, edges = _chain(p, m, f, b, kind)
    res = simulate(stages, edges, m)
    assert res.iteration_time == pytest.approx((m + p - 1) * (f + b))
    assert res.throughput == pytest.approx(m / res.iteration_time)
    expected_bubble = (p - 1) / (m + p - 1)
    assert res.bubble_fraction == pytest.approx(expected_bubble)
    if kind == "1f1b":
        assert res.peak_in_flight == {i: min(p - i, m) for i in range(p)}
        assert res.peak_memory[0] == pytest.approx(10.0 * min(p, m))


def test_invariants_with_communication_and_branches() -> None:
    # Two branches (0, 1) feeding stage 2, unequal times, micro-batch sizes 2 / 2 / 4.
    m_small, m_big = 4, 2
    stages = [
        SimStage(0, 2, 1.0, 2.0, tuple(one_f_one_b(m_small, 3))),
        SimStage(1, 2, 0.5, 1.0, tuple(one_f_one_b(m_small, 3))),
        SimStage(2, 4, 1.5, 3.0, tuple(one_f_one_b(m_big, 1)), allreduce_time=0.25),
    ]
    edges = [SimEdge(0, 2, 1.0, 4.0, 0.1), SimEdge(1, 2, 1.0, 4.0, 0.1)]
    res = simulate(stages, edges, 8)
    loads = {0: 12.0, 1: 6.0, 2: 9.0 + 0.25}
    assert res.iteration_time >= max(loads.values()) - 1e-9
    critical = 1.0 + (0.1 + 0.5) + 1.5 + 3.0 + (0.1 + 0.5) + 2.0  # one micro-batch end to end
    assert res.iteration_time >= critical
    kinds = {e.kind for e in res.events}
    assert {"F", "B", "send_F", "send_B", "allreduce"} <= kinds
    assert 0.0 <= res.bubble_fraction < 1.0


@pytest.mark.parametrize("trace", [True, False])
def test_each_end_spends_its_own_overhead_on_every_message(trace: bool) -> None:
    """LogP's o at each end: a message costs its sender ``overhead`` after the action that sends
    it (the transfer starts then) and its receiver ``receive_overhead`` before the action that
    takes it, on their own devices. Two stages, one micro-batch: F0, o_s, transfer, o_r, F1, B1,
    o_s, transfer, o_r, B0."""
    f, b, latency, o_s, o_r = 1.0, 2.0, 0.5, 0.25, 0.0625
    stages = [SimStage(0, 1, f, b, ("F0", "B0")), SimStage(1, 1, f, b, ("F0", "B0"))]
    edges = [SimEdge(0, 1, 1.0, float("inf"), latency, overhead=o_s, receive_overhead=o_r)]
    res = simulate(stages, edges, 1, trace=trace)
    assert res.iteration_time == pytest.approx(2 * (f + b) + 2 * latency + 2 * (o_s + o_r))
    assert res.busy == {0: f + b, 1: f + b}  # the overhead is not compute
    # Four micro-batches of GPipe: the first stage's forwards run back to back, each paying the
    # sender's o before the next can start; the last stage's backwards likewise; the receivers'
    # o is paid once more on the path (stage 1 takes F3, stage 0 takes B3's gradient).
    stages = [SimStage(i, 1, f, b, tuple(gpipe(4))) for i in range(2)]
    charged = simulate(stages, edges, 4, trace=trace)
    bare = simulate(
        stages, [dataclasses.replace(edges[0], overhead=0.0, receive_overhead=0.0)], 4, trace=trace
    )
    assert charged.iteration_time == pytest.approx(bare.iteration_time + 8 * o_s + 2 * o_r)
    # The receiver's o alone: now the receivers pace the pipeline, stage 1's forwards and stage
    # 0's backwards each taking o_r longer than their inputs' spacing.
    received = simulate(stages, [dataclasses.replace(edges[0], overhead=0.0)], 4, trace=trace)
    assert received.iteration_time == pytest.approx(bare.iteration_time + 8 * o_r)


@pytest.mark.parametrize("trace", [True, False])
def test_an_edge_of_no_floating_tensor_sends_no_gradient_back(trace: bool) -> None:
    """Stage 0 sends stage 2 a mask (no gradient) and stage 1 an activation: stage 0's backward
    waits for stage 1's gradient only, and takes that one message in."""
    f, b, latency, o_s, o_r = 1.0, 2.0, 0.5, 0.25, 0.0625
    stages = [SimStage(i, 1, f, b, ("F0", "B0")) for i in range(3)]
    link = {"overhead": o_s, "receive_overhead": o_r}
    edges = [
        SimEdge(0, 1, 1.0, float("inf"), latency, **link),
        SimEdge(0, 2, 1.0, float("inf"), latency, **link, grads=False),
        SimEdge(1, 2, 1.0, float("inf"), latency, **link),
    ]
    res = simulate(stages, edges, 1, trace=trace)
    # F0 and its first send (to stage 1), which stage 1 takes in; stage 2 takes stage 1's
    # activation and the mask; then the gradients back, stage 0 taking one.
    hop = o_s + latency + o_r
    at_1 = f + hop
    at_2 = at_1 + f + hop + o_r
    assert res.iteration_time == pytest.approx(at_2 + f + b + hop + b + hop + b)
    if trace:
        assert {(e.stage, e.peer) for e in res.events if e.kind == "send_B"} == {(2, 1), (1, 0)}
    # Had the mask's edge carried a gradient, stage 2's B would send it too (o_s) and stage 0
    # would take it in (o_r).
    graded = simulate(
        stages, [*edges[:1], dataclasses.replace(edges[1], grads=True), edges[2]], 1, trace=trace
    )
    assert graded.iteration_time == pytest.approx(res.iteration_time + o_s + o_r)


@pytest.mark.parametrize("trace", [True, False])
def test_every_action_pays_the_executors_own_overhead_on_its_device(trace: bool) -> None:
    stages, edges = _chain(2, 4, 1.0, 2.0, "1f1b")
    bare = simulate(stages, edges, 4, trace=trace)
    charged = [dataclasses.replace(s, action_overhead=0.25) for s in stages]
    res = simulate(charged, edges, 4, trace=trace)
    assert res.busy == bare.busy  # not compute
    # Every action on the critical path (5 F/B pairs of 1F1B over 2 stages, 4 micro-batches) pays it.
    assert res.iteration_time == pytest.approx(bare.iteration_time + 2 * 5 * 0.25)


def test_deadlock_is_reported() -> None:
    stages = [
        SimStage(0, 1, 1.0, 1.0, ("F0", "B0", "F1", "B1")),
        SimStage(1, 1, 1.0, 1.0, ("F1", "B1", "F0", "B0")),
    ]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(stages, [SimEdge(0, 1)], 2)


@st.composite
def _random_pipelines(draw):
    """A random stage DAG (edges forward in stage order), per-stage micro-batch sizes dividing the
    mini-batch, times, transfers and all-reduces, and per-stage orders of F/B passes: 1F1B with a
    random warm-up or a random interleaving (which may deadlock)."""
    mini_batch = draw(st.sampled_from([4, 8, 16]))
    n = draw(st.integers(1, 5))
    stages = []
    for i in range(n):
        b = draw(st.sampled_from([d for d in (1, 2, 4, 8) if mini_batch % d == 0]))
        m = mini_batch // b
        if draw(st.booleans()):
            actions = one_f_one_b(m, draw(st.integers(1, m)))
        else:
            actions, f, g = [], 0, 0
            while g < m:
                if f < m and (f == g or draw(st.booleans())):
                    actions.append(f"F{f}")
                    f += 1
                else:
                    actions.append(f"B{g}")
                    g += 1
        time = st.floats(0.0, 4.0, allow_nan=False)
        stages.append(
            SimStage(
                i,
                b,
                draw(time),
                draw(time),
                tuple(actions),
                devices=draw(st.integers(1, 4)),
                allreduce_time=draw(st.sampled_from([0.0, 0.5, 3.0])),
                static_memory=1.0,
                activation_bytes=2.0,
                action_overhead=draw(st.sampled_from([0.0, 0.0, 0.125])),
            )
        )
    edges = [
        SimEdge(
            i,
            j,
            draw(st.sampled_from([0.0, 0.5, 2.0])),
            draw(st.sampled_from([1.0, 4.0])),
            draw(time),
            overhead=draw(st.sampled_from([0.0, 0.0, 0.25])),
            receive_overhead=draw(st.sampled_from([0.0, 0.0, 0.0625])),
        )
        for i in range(n)
        for j in range(i + 1, n)
        for _ in range(draw(st.sampled_from([0, 0, 1, 2])))  # a pair listed twice: the event path
    ]
    return stages, edges, mini_batch


@settings(max_examples=300, deadline=None)
@given(_random_pipelines())
def test_the_untraced_fast_path_matches_the_event_simulation_exactly(case) -> None:
    """Without shared interfaces and a trace, simulate takes a work-list path with no event queue;
    every number it returns equals the event-ordered simulation's (trace=True) bit for bit, and
    both report the same deadlocks."""
    stages, edges, mini_batch = case
    try:
        traced = simulate(stages, edges, mini_batch)
    except ValueError as err:
        with pytest.raises(ValueError, match="deadlock") as fast:
            simulate(stages, edges, mini_batch, trace=False)
        assert str(fast.value) == str(err)
        return
    fast = simulate(stages, edges, mini_batch, trace=False)
    assert fast.events == []
    assert dataclasses.replace(traced, events=[]) == fast
