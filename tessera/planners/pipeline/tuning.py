"""Schedule tuning on the simulator: 1F1B warm-up counts (jointly, then stage by stage) and
Algorithm 4's rescheduling of the best candidates (GraphPipe thesis §3.6, §3.10.1)."""

from __future__ import annotations

import dataclasses

from tessera.planners.pipeline.materialize import scheduled
from tessera.planners.pipeline.types import Pipeline
from tessera.planners.sim import simulate_pipeline

# 1F1B warm-up slack tried per candidate (:func:`materialize`): Table 3.2's minimum, and one or two more
# micro-batches in flight on every stage with successors (hides transfers; costs memory).
WARM_UP_SLACKS = (0, 1, 2)


# Warm-up tuning (:func:`fastest_tuned`): the joint step of :func:`tune_warm_up` (a few simulations)
# on this many of the fastest candidates (distinct stage graph and micro-batch size), …
_JOINT_TUNED = 8


# … then its stage-by-stage steps on the fastest few of those (distinct stage graphs).
_TUNED = 3


# Extra warm-up :func:`tune_warm_up` tries on all stages with successors at once (below the number
# of micro-batches, then all of them), before it tunes stage by stage.
_JOINT_EXTRAS = (3, 4, 6, 8, 12, 16, 24, 32)


# Simulated passes (forwards and backwards of all stages) one warm-up tuning may spend: about 0.1 s
# of simulation (1.4 M passes/s untraced on this machine); stages nearest the sinks are tuned first.
_TUNE_TASKS = 150_000


# Algorithm 4's budget under ``--schedule auto``, for all the candidates it reschedules together:
# one costs about 4·m²·S² simulated passes for m micro-batches and S stages (2m trial simulations
# per stage, each of up to 2m·S passes); spending all of it takes 0.2–0.25 s on this machine. Three
# times the budget (and twice the tuned candidates) changed no plan of bench/gpp.py's models.
_GREEDY_TASKS = 1_500_000


def fastest_tuned(timed: list[tuple[tuple, Pipeline]]) -> tuple[Pipeline, tuple]:
    """The fastest plan after warm-up tuning (:func:`tune_warm_up`), with its rank: the
    :data:`_JOINT_TUNED` fastest candidates of ``timed``, each stage graph and micro-batch size
    once (from its fastest uniform warm-up), get the joint step, which costs a few simulations;
    then the :data:`_TUNED` fastest stage graphs of those get the stage-by-stage steps too.

    ``timed``: ``(rank, pipeline)`` pairs, rank ``(simulated time, bottleneck TPS, estimate,
    warm-up, stage graph key)``; ties go to the better balanced plan, the better estimate, fewer
    micro-batches in flight."""
    joint: list[tuple[tuple, Pipeline]] = []
    seen: set[tuple] = set()
    for rank, pipe in sorted(timed, key=lambda rp: rp[0]):
        # Each stage graph and micro-batch size once: with its warm-up tuned, a stage graph at a
        # larger micro-batch can overtake the smaller one that ranked first untuned (CANDLE-Uno
        # rewritten at 32 devices: 4096 against 2048, 820.3k against 805.7k samples/s).
        if (rank[-1], pipe.micro_batch_size) in seen:
            continue
        seen.add((rank[-1], pipe.micro_batch_size))
        tuned, t = tune_warm_up(pipe, per_stage=False)
        joint.append(((t, rank[1], rank[2], sum(st.in_flight for st in tuned.stages), rank[-1]), tuned))
        if len(seen) == _JOINT_TUNED:
            break
    if not joint:
        raise ValueError("no candidate to tune")
    out: tuple[tuple, Pipeline] | None = None
    graphs: set[tuple] = set()
    for rank, pipe in sorted(joint, key=lambda rp: rp[0]):
        # Each stage graph once here (the slots keyed by micro-batch size too were neutral on the
        # bench, but CANDLE-Uno rewritten at 4 devices lost 1.6 %).
        if rank[-1] in graphs:
            continue
        graphs.add(rank[-1])
        tuned, t = tune_warm_up(pipe)
        mine = (t, *rank[1:3], sum(st.in_flight for st in tuned.stages), rank[-1])
        if out is None or mine < out[0]:
            out = (mine, tuned)
        if len(graphs) == _TUNED:
            break
    assert out is not None
    return out[1], out[0]


def tune_warm_up(pipe: Pipeline, *, per_stage: bool = True) -> tuple[Pipeline, float]:
    """A 1F1B pipeline with each stage's warm-up tuned on the simulator, and its iteration time.

    Algorithm 4's idea (a stage runs ahead as far as it helps, no further) at the grain of the
    warm-up count: first all stages with successors together (:data:`_JOINT_EXTRAS`), then the
    stages one by one in reverse topological order (those downstream already tuned), each
    trying 0, 1, 2, 4, … extra warm-up micro-batches (:func:`scheduled`) within memory; a count
    is kept when the simulated iteration is faster, ties going to fewer in flight. Start: the
    warm-up ``pipe`` has (its stages' extra over Table 3.2). At most :data:`_TUNE_TASKS`
    simulated passes (long pipelines of many micro-batches stop early). ``per_stage=False``:
    the joint step alone."""
    current = {st.id: 0 for st in pipe.stages}
    base = scheduled(pipe, {})
    if base is not None:
        for st, least in zip(pipe.stages, base.stages, strict=True):
            current[st.id] = max(0, st.in_flight - least.in_flight)
    best_time = simulate_pipeline(pipe, trace=False).iteration_time
    if pipe.schedule_kind != "1f1b":
        return pipe, best_time
    budget = _TUNE_TASKS // (2 * pipe.num_micro_batches * len(pipe.stages))  # simulations it may take
    tuning = _Tuning(pipe, pipe, best_time, current, budget)
    tuning.joint()
    if per_stage:
        for st in reversed(pipe.stages):
            if st.id in tuning.sources and not tuning.stage(st.id):
                break
    return tuning.best, tuning.best_time


@dataclasses.dataclass
class _Tuning:
    """The state of :func:`tune_warm_up`: the best pipeline so far, its time, the extra warm-up per
    stage it has, and the simulations left."""

    pipe: Pipeline
    best: Pipeline
    best_time: float
    current: dict[int, int]
    budget: int

    @property
    def sources(self) -> set[int]:
        return {e.src for e in self.pipe.edges}

    def _simulated(self, trial: dict[int, int]) -> tuple[Pipeline, float] | None:
        """``trial``'s pipeline and iteration time, one simulation spent; None: it does not fit memory."""
        self.budget -= 1
        cand = scheduled(self.pipe, trial)
        return None if cand is None else (cand, simulate_pipeline(cand, trace=False).iteration_time)

    def joint(self) -> None:
        """Every stage with successors together (the candidates come with 0–2 extra): where several
        stages feed one (a graph pipeline's branches into their merge), one running ahead gains
        nothing while the others hold the merge back, so the stage-by-stage steps never find the
        warm-up they need together (CANDLE-Uno rewritten at 32 devices, seven branch stages into
        one: 1F1B 769.5k → 820.3k samples/s, Algorithm 4's). Extra m: every forward first (GPipe's
        order) on those stages."""
        m, sources = self.pipe.num_micro_batches, self.sources
        for extra in [e for e in _JOINT_EXTRAS if e < m] + [m]:
            if self.budget <= 0:
                return
            trial = {s: max(x, extra) if s in sources else x for s, x in self.current.items()}
            if trial == self.current:
                continue
            found = self._simulated(trial)
            if found is None:
                return  # more warm-up only needs more memory
            if found[1] < self.best_time:
                (self.best, self.best_time), self.current = found, trial

    def stage(self, stage: int) -> bool:
        """``stage`` alone with 0, 1, 2, 4, … extra warm-up (ties to fewer in flight); False when the
        simulations ran out."""
        m = self.pipe.num_micro_batches
        for step in range(m + 1):
            extra = 0 if step == 0 else 1 << (step - 1)
            if extra >= m:
                break
            if extra == self.current[stage]:
                continue
            if self.budget <= 0:
                return False
            trial = {**self.current, stage: extra}
            found = self._simulated(trial)
            if found is None:
                if extra > self.current[stage]:
                    break  # more warm-up only needs more memory
                continue
            if found[1] < self.best_time or (found[1] == self.best_time and extra < self.current[stage]):
                (self.best, self.best_time), self.current = found, trial
        return True


def fastest_rescheduled(best: Pipeline, best_time: float, timed: list[tuple[tuple, Pipeline]]) -> Pipeline:
    """``--schedule auto``: the fastest of ``best`` (the 1F1B search's plan, simulated at
    ``best_time``) and the candidates of ``timed`` rescheduled by Algorithm 4 (:mod:`.greedy`:
    every stage as early as its successors allow, with the fewest micro-batches in flight that
    costs no time), where that fits memory. Same stages, devices and micro-batch sizes as the
    candidates; only the order of passes changes.

    Candidates go in the order of their 1F1B rank (``timed``: ``(rank, pipeline)``, the stage
    graph's key last in the rank), each distinct stage graph and micro-batch size once. Algorithm 4
    costs about ``4·m²·S²`` simulated passes for ``m`` micro-batches and ``S`` stages: together
    they may spend :data:`_GREEDY_TASKS` (a candidate that would overdraw it is passed over). A
    candidate whose busiest stage alone — ``m`` forwards and backwards, then its all-reduce —
    takes as long as the best so far is passed over too: no schedule makes it faster.

    The stage graph that wins under 1F1B is not always the one that wins under Algorithm 4:
    stages of unequal load side by side gain most from passes 1F1B's fixed pattern cannot
    order."""
    budget = _GREEDY_TASKS
    seen: set[tuple] = set()
    for rank, pipe in sorted(timed, key=lambda rp: rp[0]):
        key = (rank[-1], pipe.micro_batch_size)
        if key in seen:
            continue
        seen.add(key)
        m, n = pipe.num_micro_batches, len(pipe.stages)
        tasks = 4 * m * m * n * n
        busiest = max(m * (st.forward_time + st.backward_time) + st.allreduce_time for st in pipe.stages)
        if tasks > budget or busiest >= best_time:
            continue
        budget -= tasks
        greedy = scheduled(dataclasses.replace(pipe, schedule_kind="greedy"), {})
        if greedy is None:
            continue
        t = simulate_pipeline(greedy, trace=False).iteration_time
        if t < best_time:
            best, best_time = greedy, t
    return best
