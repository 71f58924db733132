"""tessera: an optimizer toolchain for deep-learning models given as ONNX files.

The Python API (:mod:`tessera.api`, docs/api.md) is importable from here: ``tessera.plan(...)``;
it is loaded on first use, so ``import tessera`` stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = (
    "Inspection", "InfeasibleError", "InputError", "LaunchError", "Placement", "TesseraError",
    "TesseraWarning", "Validation", "inspect", "launch", "load", "place", "plan", "validate",
)  # fmt: skip
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        from tessera import api

        return getattr(api, name)
    raise AttributeError(f"module 'tessera' has no attribute {name!r}")
