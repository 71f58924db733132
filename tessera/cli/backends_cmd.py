"""``tessera backends``: every registered backend, whether it can run here, and why not."""

from __future__ import annotations

import click
from rich.markup import escape

from tessera.cli.options import json_option
from tessera.cli.render import console, emit_json


@click.command()
@json_option
def backends(as_json: bool) -> None:
    """List the backends: available or not (with the reason), version, device, patterns and rules."""
    from tessera.backends.registry import default_registry

    rows = default_registry().report()
    if as_json:
        emit_json({"backends": rows})
        return
    out = console()
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        cap = row.get("capability") or {}
        if cap.get("op_types") is not None:
            ops = f"{cap['op_types']} op types"
        else:
            ops = "ops per subgraph" if cap else ""
        counts = f"{row['patterns']} patterns, {row['rules']} rules"
        version = row["version"] or "-"
        # Names, devices and reasons come from plugins and drivers: text, never rich markup.
        name = escape(f"{row['name']:<{width}}  {version:<12}")
        if row["available"]:
            out.print(f"[green]✓[/green] {name} {escape(str(row['device']))}  ({ops}; {counts})")
        else:
            out.print(f"[red]✗[/red] {name} unavailable: {escape(str(row['reason']))}  ({counts})")
