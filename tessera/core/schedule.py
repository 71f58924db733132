"""Micro-batch schedules of pipeline stages as data (GraphPipe thesis §3.6; PyTorch pipelining's
``_Action`` vocabulary).

:class:`Action` is one pass: ``F3`` (forward of micro-batch 3), ``B3`` (its backward), ``2F3`` (with
its stage). Plans store the text form; :meth:`Action.parse` reads it back. :func:`schedule_problems`
is the one validator (constraint C4) that the planner, the simulator and the executor share;
:data:`SCHEDULE_KINDS` is the one table of schedule kinds and their generators.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NamedTuple, get_args

_ACTION = re.compile(r"^(?:(\d+))?([FB])(\d+)$")

PassKind = Literal["F", "B"]


class Action(NamedTuple):
    """One pass of a stage's schedule: ``kind`` ``F`` (forward) or ``B`` (backward) of ``micro_batch``;
    ``stage`` is None inside one stage's list (``F3``) and set where actions of stages mix (``2F3``)."""

    stage: int | None
    kind: PassKind
    micro_batch: int

    def __str__(self) -> str:
        return f"{'' if self.stage is None else self.stage}{self.kind}{self.micro_batch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"2F3"`` → Action(2, "F", 3); ``"F3"`` → Action(None, "F", 3). ValueError otherwise."""
        match = _ACTION.match(text.strip())
        if not match:
            raise ValueError(f"not a pipeline action: {text!r}")
        stage, kind, micro_batch = match.groups()
        return cls(None if stage is None else int(stage), kind, int(micro_batch))  # type: ignore[arg-type]

    def on_stage(self, stage: int | None) -> Action:
        return self._replace(stage=stage)


def schedule_problems(actions: Sequence[str], num_micro_batches: int) -> list[str]:
    """C4 problems of one stage's schedule (thesis §3.3): each pass exactly once, forwards and
    backwards each in micro-batch order, every forward before its backward. Empty when it holds."""
    m = num_micro_batches
    problems: list[str] = []
    forwards: list[int] = []
    backwards: list[int] = []
    forwarded: set[int] = set()
    for text in actions:
        try:
            a = Action.parse(text)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if a.micro_batch >= m:
            problems.append(f"{text}: there are {m} micro-batches (0..{m - 1})")
        elif a.kind == "F":
            forwards.append(a.micro_batch)
            forwarded.add(a.micro_batch)
        else:
            if a.micro_batch not in forwarded:
                problems.append(f"B{a.micro_batch} before F{a.micro_batch}")
            backwards.append(a.micro_batch)
    expected = list(range(m))
    if forwards != expected:
        problems.append(f"forwards are not F0..F{m - 1} in order")
    if backwards != expected:
        problems.append(f"backwards are not B0..B{m - 1} in order")
    return problems


def one_f_one_b(num_micro_batches: int, warmup: int) -> list[str]:
    """1F1B: ``warmup`` forwards, then B/F alternating, then the remaining backwards."""
    m = num_micro_batches
    w = max(1, min(warmup, m))
    actions = [f"F{i}" for i in range(w)]
    f, b = w, 0
    while b < m:
        actions.append(f"B{b}")
        b += 1
        if f < m:
            actions.append(f"F{f}")
            f += 1
    return actions


def k_f_k_b(num_micro_batches: int, k: int, warmup: int) -> list[str]:
    """kFkB: ``warmup`` forwards, then ``k`` backwards and ``k`` forwards alternating, then the rest."""
    m = num_micro_batches
    k = min(k, m)
    w = max(1, min(max(warmup, k), m))
    actions = [f"F{i}" for i in range(w)]
    f, b = w, 0
    while b < m:
        for _ in range(k):
            if b < m and b < f:
                actions.append(f"B{b}")
                b += 1
        for _ in range(k):
            if f < m:
                actions.append(f"F{f}")
                f += 1
    return actions


def gpipe(num_micro_batches: int) -> list[str]:
    """GPipe: every forward, then every backward."""
    return [f"F{i}" for i in range(num_micro_batches)] + [f"B{i}" for i in range(num_micro_batches)]


def in_flight_of(actions: Sequence[str]) -> int:
    """Peak number of micro-batches forwarded and not yet backwarded in ``actions``."""
    live = peak = 0
    for a in actions:
        live += 1 if Action.parse(a).kind == "F" else -1
        peak = max(peak, live)
    return peak


def format_grid(schedules: Mapping[int, Sequence[str]], *, width: int = 5) -> str:
    """Any schedule as a rank × step grid (one row per stage), like PyTorch's ``_format_pipeline_order``."""
    if not schedules:
        return ""
    steps = max(len(a) for a in schedules.values())
    head = "stage".ljust(7) + "".join(f"{s:<{width}}" for s in range(steps))
    rows = [head]
    for stage in sorted(schedules):
        cells = list(schedules[stage]) + [""] * (steps - len(schedules[stage]))
        rows.append(f"{stage:<7}" + "".join(f"{c:<{width}}" for c in cells))
    return "\n".join(r.rstrip() for r in rows) + "\n"


def to_pytorch_csv(schedules: Mapping[int, Sequence[str]]) -> str:
    """A chain plan's schedule in ``torch.distributed.pipelining``'s CSV form: one row per rank,
    each cell an action ``{stage}{F|B}{micro_batch}`` (rank ``r`` runs stage ``r``)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for stage in sorted(schedules):
        writer.writerow([str(Action.parse(a).on_stage(stage)) for a in schedules[stage]])
    return out.getvalue()


def from_pytorch_csv(text: str) -> dict[int, list[str]]:
    """Inverse of :func:`to_pytorch_csv` (rank → actions without the stage prefix)."""
    result: dict[int, list[str]] = {}
    for rank, row in enumerate(csv.reader(io.StringIO(text))):
        result[rank] = [str(Action.parse(cell).on_stage(None)) for cell in row if cell.strip()]
    return result


def chain_order(stage_ids: Sequence[int], edges: Sequence[tuple[int, int]]) -> str | None:
    """Why stages ``stage_ids`` with dependencies ``edges`` are not the chain ``0 → 1 → … → S−1``
    that ``torch.distributed.pipelining`` runs (rank ``i`` runs stage ``i``, which feeds stage
    ``i + 1``); ``None`` when they are. A tensor that skips stages (``0 → 2`` besides ``0 → 1 →
    2``) keeps the chain: the stages between pass it along, as PyTorch's pipeline splitter does."""
    ids = sorted(stage_ids)
    if ids != list(range(len(ids))):
        return f"stage ids {ids} are not 0..{len(ids) - 1}"
    for src, dst in sorted(set(edges)):
        if dst <= src:
            return f"stage {src} feeds stage {dst}, an earlier one"
    missing = sorted(set(range(len(ids) - 1)) - {src for src, dst in edges if dst == src + 1})
    if missing:
        i = missing[0]
        return f"stage {i} does not feed stage {i + 1}: the stages form a graph, not a chain"
    return None


# The kinds of schedule a stage may run, and what a planner may be asked for: a kind, or ``auto`` (the
# fastest of the 1F1B search's plans and their Algorithm 4 reschedules). Typed here, listed once below.
ScheduleKind = Literal["1f1b", "kfkb", "greedy", "gpipe"]
ScheduleChoice = Literal["1f1b", "kfkb", "greedy", "gpipe", "auto"]


class Generator(NamedTuple):
    """How a kind's schedule is made: from (micro-batches, in-flight count, k), or None where the
    planner writes each stage's list itself (``greedy``: Algorithm 4)."""

    generate: Callable[[int, int, int], list[str]] | None
    help: str


SCHEDULE_KINDS: dict[str, Generator] = {
    "1f1b": Generator(lambda m, w, k: one_f_one_b(m, w), "warm-up forwards, then one backward, one forward"),
    "kfkb": Generator(k_f_k_b, "warm-up forwards, then k backwards and k forwards (Table 3.2)"),
    "greedy": Generator(None, "Algorithm 4: a backward whenever it does not delay the stage"),
    "gpipe": Generator(lambda m, w, k: gpipe(m), "every forward, then every backward"),
}
SCHEDULE_CHOICES: tuple[str, ...] = (*SCHEDULE_KINDS, "auto")
if tuple(SCHEDULE_KINDS) != get_args(ScheduleKind) or SCHEDULE_CHOICES != get_args(ScheduleChoice):
    raise AssertionError(
        "SCHEDULE_KINDS and the ScheduleKind / ScheduleChoice types must list the same kinds"
    )
