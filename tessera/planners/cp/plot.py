"""Draw a context sweep (tokens/s of each strategy against context length) as an SVG.

matplotlib with the Agg backend (no display), imported only when a plot is asked for; the SVG is
made deterministic (no date, fixed id salt) and written atomically.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from tessera.core.errors import InputError
from tessera.core.files import write_output
from tessera.planners.cp.cost import STRATEGIES
from tessera.planners.cp.plan import SweepRow

__all__ = ["plot_sweep"]

_STYLE = {"tp": ("tab:blue", "o"), "cp": ("tab:orange", "s"), "dp": ("tab:green", "^")}


def plot_sweep(rows: list[SweepRow], path: str | os.PathLike[str], *, title: str) -> Path:
    """Plot ``rows`` to ``path`` (format from the suffix; SVG recommended). Returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib (pip install 'tessera[viz]')", source=str(path)) from None
    fmt = Path(path).suffix.lstrip(".").lower() or "svg"
    with matplotlib.rc_context({"svg.hashsalt": "tessera", "svg.fonttype": "none"}):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        try:
            for strategy in STRATEGIES:
                points = [
                    (row.context, row.best[strategy].tokens_per_s)  # type: ignore[union-attr]
                    for row in rows
                    if row.best.get(strategy) is not None
                ]
                if not points:
                    continue
                color, marker = _STYLE[strategy]
                ax.plot(*zip(*points, strict=True), label=strategy.upper(), color=color, marker=marker)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("decode throughput (tokens/s)")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            fig.tight_layout()
            buffer = io.BytesIO()
            metadata = {"Date": None} if fmt == "svg" else None
            fig.savefig(buffer, format=fmt, metadata=metadata)
        except ValueError as err:
            raise InputError(f"cannot write the plot: {err}", source=str(path)) from None
        finally:
            plt.close(fig)
    return write_output(path, buffer.getvalue())
