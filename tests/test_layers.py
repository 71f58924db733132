"""The package's layers hold (DESIGN.md, "Layout and layers"): ``cli > api > executor > planners >
backends, kernels, models > core``. Every import counts, inside functions and ``TYPE_CHECKING``
blocks too: nothing imports upward, there is no import cycle (importing a module runs its packages'
``__init__`` first, so those count as imported), no module takes another module's ``_private``
name, and planners never import click."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

import tessera

LAYERS = {
    "core": 0,
    "backends": 1,
    "kernels": 1,
    "models": 1,
    "planners": 2,
    "executor": 3,
    "api": 4,
    "cli": 5,
}
ROOT = Path(tessera.__file__).parent


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # the module imported (a name imported from a module: that module)
    name: str | None  # the name taken from ``target``, when it is not a module itself
    line: int


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports() -> list[Import]:
    found = []
    for module, path in MODULES.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [
                    Import(module, a.name, None, node.lineno)
                    for a in node.names
                    if a.name.startswith("tessera")
                ]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source != "tessera" and not source.startswith("tessera."):
                    continue
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    found.append(
                        Import(module, full, None, node.lineno)
                        if full in MODULES
                        else Import(module, source, alias.name, node.lineno)
                    )
    return found


IMPORTS = _imports()


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_the_walk_sees_the_package() -> None:
    assert len(MODULES) > 80 and len(IMPORTS) > 300
    assert all(_layer(m) is not None for m in MODULES if m.count(".") >= 1 and m != "tessera.__main__")


def upward(imports: list[Import]) -> list[str]:
    return [
        f"{i.importer}:{i.line} imports {i.target}" + (f".{i.name}" if i.name else "")
        for i in imports
        if (low := _layer(i.importer)) is not None and (high := _layer(i.target)) is not None and high > low
    ]


def private(imports: list[Import]) -> list[str]:
    return [
        f"{i.importer}:{i.line} takes {i.target}.{i.name}"
        for i in imports
        if i.name and i.name.startswith("_") and not i.name.startswith("__") and i.target != i.importer
    ]


def test_nothing_imports_upward() -> None:
    assert not (found := upward(IMPORTS)), "\n".join(found)


def test_no_private_name_crosses_modules() -> None:
    assert not (found := private(IMPORTS)), "\n".join(found)


def test_planners_never_import_click() -> None:
    users = []
    for module, path in MODULES.items():
        if module.startswith("tessera.planners"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                users += [f"{module}:{node.lineno}" for n in names if n.split(".")[0] == "click"]
    assert not users, "\n".join(users)


def _packages_of(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_no_import_cycle() -> None:
    graph = nx.DiGraph()
    for i in IMPORTS:
        target = i.target
        while target not in MODULES and "." in target:
            target = target.rpartition(".")[0]
        own = set(_packages_of(i.importer))
        for t in [*_packages_of(target), target]:
            if t != i.importer and t not in own and t in MODULES:
                graph.add_edge(i.importer, t)
    cycles = sorted(nx.simple_cycles(graph, length_bound=6))
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles[:10])


@pytest.mark.parametrize(
    ("source", "check"),
    [
        ("from tessera.cli.render import progress_bar\n", upward),
        ("def f():\n    from tessera.executor.gpp import x\n", upward),
        ("from tessera.core.graph import _private\n", private),
    ],
)
def test_the_walk_catches_a_breach(source: str, check, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks find a breach planted in a module of planners/."""
    planted = ROOT / "planners" / "planted_breach.py"
    monkeypatch.setitem(MODULES, "tessera.planners.planted_breach", planted)
    real_read = Path.read_text
    monkeypatch.setattr(
        Path, "read_text", lambda p, *a, **k: source if p == planted else real_read(p, *a, **k)
    )
    found = [i for i in _imports() if i.importer == "tessera.planners.planted_breach"]
    assert len(check(found)) == 1


def test_modules_stay_small_and_say_what_they_own() -> None:
    """No module over 600 lines; a module docstring says what the module owns in at most ~10 lines
    (narratives live in docs/, measured numbers in bench/results/)."""
    long_modules = [
        f"{m}: {n} lines" for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 600
    ]
    assert not long_modules, "\n".join(long_modules)
    long_docs = []
    for module, path in MODULES.items():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(doc.splitlines()) > 12:
            long_docs.append(f"{module}: {len(doc.splitlines())} docstring lines")
    assert not long_docs, "\n".join(long_docs)
