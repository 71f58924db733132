"""Every module imports on its own, first, in a fresh interpreter (no circular import that only
the usual import order hides: ``from tessera.planners.sim import simulate`` failed that way)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tessera

_CHECK = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "tessera" or m.startswith("tessera.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _modules() -> list[str]:
    root = Path(tessera.__file__).parent
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # runs the CLI
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.slow  # a fresh interpreter imports every module, torch among them
def test_every_module_imports_first() -> None:
    names = _modules()
    assert "tessera.planners.sim" in names and len(names) > 50
    done = subprocess.run([sys.executable, "-c", _CHECK, *names], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_cli_loads_torch_only_for_a_command_that_needs_it(tmp_path: Path) -> None:
    """``inspect`` loaded torch (and torch._dynamo, which makes a folder in TMPDIR) through the
    plan command's imports: under a low ``ulimit -v`` it failed with a raw ImportError. It now
    loads no torch and inspects within 700 MB of address space."""
    import resource

    from tessera.models import build

    model = tmp_path / "gpt.onnx"
    import onnx

    onnx.save(build("gpt", "tiny"), model)
    probe = "import sys, tessera.cli.main; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
        == "False"
    )

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (700 * 2**20, 700 * 2**20))

    proc = subprocess.run(
        [sys.executable, "-m", "tessera", "inspect", str(model), "--json"],
        capture_output=True, text=True, preexec_fn=limited, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
