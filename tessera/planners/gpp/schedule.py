"""Micro-batch schedules of pipeline stages (GraphPipe thesis §3.6, Table 3.2, Algorithm 4).

A schedule is data: the ordered list of a stage's passes in PyTorch pipelining's vocabulary,
``"F3"`` (forward of micro-batch 3) and ``"B3"`` (its backward); with a stage index in front
(``"2F3"``) an action names its stage too, as in ``torch.distributed.pipelining``'s
``_Action`` text form. Generators are pure; the simulator and the executor interpret any list.

- ``1f1b``: ``w`` warm-up forwards, then alternate one backward and one forward, then the
  cool-down backwards; ``w`` is the stage's in-flight count.
- ``kfkb``: ``ℓ`` warm-up forwards, then alternate ``k`` backwards and ``k`` forwards (thesis
  footnote 7); in-flight counts by Table 3.2 (:func:`compute_in_flight`).
- ``gpipe``: all forwards, then all backwards.
- ``greedy`` (Algorithm 4): explicit per-stage action lists, a backward whenever it does not
  delay the stage (:mod:`tessera.planners.gpp.greedy`).
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Mapping, Sequence

_ACTION = re.compile(r"^(?:(\d+))?([FB])(\d+)$")


def compute_in_flight(kx: int, bx: int, ky: int, by: int, iy: int) -> int:
    """In-flight *samples* of stage x given its successor y (thesis Table 3.2, verbatim).

    ``kx, bx``: stage x's kFkB k and micro-batch size; ``ky, by, iy``: the successor's k,
    micro-batch size and in-flight samples.
    """
    m = max(bx, by)
    xb, yb = kx * bx, ky * by
    if m < xb < yb:
        return iy + 2 * m
    if m == xb < yb:
        return iy + m
    if bx <= by < yb < xb:
        return iy + xb - yb + 2 * by
    if bx <= by == yb < xb:
        return iy + xb
    if by <= bx < yb < xb:
        return iy + xb - yb + 2 * bx
    if by <= bx == yb < xb:
        return iy + xb
    if m == yb == xb:
        return iy + yb
    if m < yb == xb:
        return iy + 2 * m
    if bx <= xb < by <= yb:
        return iy + by
    if by <= yb < bx <= xb:
        return iy + xb - yb + bx
    raise AssertionError(f"Table 3.2 has no row for k_x={kx} b_x={bx} k_y={ky} b_y={by}")


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
    return [f"F{i}" for i in range(num_micro_batches)] + [f"B{i}" for i in range(num_micro_batches)]


def in_flight_of(actions: Sequence[str]) -> int:
    """Peak number of micro-batches forwarded and not yet backwarded in ``actions``."""
    live = peak = 0
    for a in actions:
        live += 1 if parse_action(a)[1] == "F" else -1
        peak = max(peak, live)
    return peak


def parse_action(text: str) -> tuple[int | None, str, int]:
    """``"2F3"`` → (2, "F", 3); ``"F3"`` → (None, "F", 3)."""
    match = _ACTION.match(text.strip())
    if not match:
        raise ValueError(f"not a pipeline action: {text!r}")
    stage, kind, mb = match.groups()
    return (None if stage is None else int(stage)), kind, int(mb)


def format_action(stage: int | None, kind: str, micro_batch: int) -> str:
    return f"{'' if stage is None else stage}{kind}{micro_batch}"


def check_schedule(actions: Sequence[str], num_micro_batches: int) -> list[str]:
    """C4 problems of one stage's schedule: each pass exactly once, forwards and backwards in
    micro-batch order, every forward before its backward."""
    problems: list[str] = []
    fw: list[int] = []
    bw: list[int] = []
    done_fw: set[int] = set()
    for a in actions:
        try:
            _, kind, mb = parse_action(a)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if mb >= num_micro_batches:
            problems.append(f"{a}: there are {num_micro_batches} micro-batches (0..{num_micro_batches - 1})")
            continue
        if kind == "F":
            fw.append(mb)
            done_fw.add(mb)
        else:
            if mb not in done_fw:
                problems.append(f"B{mb} before F{mb}")
            bw.append(mb)
    expected = list(range(num_micro_batches))
    if fw != expected:
        problems.append(f"forwards are not F0..F{num_micro_batches - 1} in order")
    if bw != expected:
        problems.append(f"backwards are not B0..B{num_micro_batches - 1} in order")
    return problems


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
        writer.writerow([format_action(stage, *parse_action(a)[1:]) for a in schedules[stage]])
    return out.getvalue()


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


def from_pytorch_csv(text: str) -> dict[int, list[str]]:
    """Inverse of :func:`to_pytorch_csv` (rank → actions without the stage prefix)."""
    result: dict[int, list[str]] = {}
    for rank, row in enumerate(csv.reader(io.StringIO(text))):
        result[rank] = [format_action(None, *parse_action(cell)[1:]) for cell in row if cell.strip()]
    return result
