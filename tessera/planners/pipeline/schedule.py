"""In-flight counts of kFkB stages (GraphPipe thesis Table 3.2). The schedules themselves are data
in :mod:`tessera.core.schedule`."""

from __future__ import annotations


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
