"""``tessera zoo``: list and build the benchmark models."""

from __future__ import annotations

import click
from rich.table import Table

from tessera.cli.options import OutputFile, json_option
from tessera.cli.render import console, emit_json
from tessera.core.graph import write_model
from tessera.models import SIZES, ZOO, build


@click.group()
def zoo() -> None:
    """The model zoo: deterministic builders of the papers' benchmark models (no downloads)."""


@zoo.command("list")
@json_option
def zoo_list(as_json: bool) -> None:
    """List the zoo's models and their sizes."""
    rows = [{"name": s.name, "sizes": list(s.sizes), "description": s.description} for s in ZOO.values()]
    if as_json:
        emit_json(rows)
        return
    table = Table()
    for col in ("model", "sizes", "description"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], ", ".join(r["sizes"]), r["description"])
    console().print(table)


@zoo.command("build")
@click.argument("name", type=click.Choice(sorted(ZOO)))
@click.option("--size", type=click.Choice(SIZES), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the generated weights.")
@click.option(
    "-o",
    "--output",
    type=OutputFile(),
    required=True,
    help="ONNX file to write.",
)
@json_option
def zoo_build(name: str, size: str, seed: int, output: str, as_json: bool) -> None:
    """Build zoo model NAME and write it as ONNX (paper size: weights generated lazily)."""
    model = build(name, size, seed)
    path = write_model(model, output)
    info = {"model": name, "size": size, "seed": seed, "path": str(path), "bytes": path.stat().st_size}
    if as_json:
        emit_json(info)
    else:
        click.echo(f"wrote {path} ({name}, {size}, seed {seed}, {info['bytes']} bytes)")
