"""``--gantt``: a simulated pipeline iteration drawn as stages × time (SVG or PNG), byte-stable."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from tessera.core.files import write_output
from tessera.planners.pipeline.types import Pipeline
from tessera.planners.sim import SimResult

_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "send_F": "#55A868", "send_B": "#55A868", "allreduce": "#8C8C8C"}


def write_gantt(sim: SimResult, pipe: Pipeline, path: str | os.PathLike[str]) -> Path:
    """Draw the simulated iteration (stages × time; forward, backward, communication) as SVG/PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(pipe.stages)
    # A fixed hash salt: matplotlib's SVG ids are otherwise random, and the same plan must draw
    # the same bytes.
    with matplotlib.rc_context({"svg.hashsalt": "tessera", "svg.fonttype": "none"}):
        fig, ax = plt.subplots(figsize=(12, 0.5 * n + 1.5))
        data = _draw_gantt(fig, ax, sim, pipe, Path(path).suffix.lstrip(".").lower() or "svg")
    return write_output(path, data)


def _draw_gantt(fig: Any, ax: Any, sim: SimResult, pipe: Pipeline, fmt: str) -> bytes:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(pipe.stages)
    try:
        for e in sim.events:
            comm = e.kind.startswith("send")
            y = e.stage + (0.3 if comm else 0.0)
            h = 0.25 if comm else 0.6
            ax.broken_barh([(e.start * 1e3, (e.end - e.start) * 1e3)], (y - 0.3, h), color=_COLOURS[e.kind])
        ax.set_yticks(range(n))
        ax.set_yticklabels([f"stage {s.id} ({len(s.devices)} dev)" for s in pipe.stages])
        ax.invert_yaxis()
        ax.set_xlabel("time (ms)")
        ax.set_title(f"{pipe.kind.upper()}: one iteration, {sim.iteration_time * 1e3:.2f} ms", loc="left")
        ax.legend(
            handles=[
                Patch(color=_COLOURS["F"], label="forward"),
                Patch(color=_COLOURS["B"], label="backward"),
                Patch(color=_COLOURS["send_F"], label="communication"),
                Patch(color=_COLOURS["allreduce"], label="all-reduce"),
            ],
            # Above the axes, right of the title: inside them it covered the first stage's bars.
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            ncol=4,
            fontsize="small",
            frameon=False,
        )
        buf = io.BytesIO()
        metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None}}.get(fmt)
        fig.savefig(buf, format=fmt, metadata=metadata, bbox_inches="tight")
    finally:
        plt.close(fig)
    return buf.getvalue()
