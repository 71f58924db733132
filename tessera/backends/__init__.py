"""Backends: registry, pattern language and pattern-rule generator, one module per backend, measurer.

Importing this package is cheap: the runtimes (onnxruntime, openvino, tvm, tensorrt) are imported
only by the backend modules that use them, when a backend is first asked to do something.
"""

from tessera.backends import plan_check as plan_check  # registers the placement plan check
from tessera.backends.base import Backend, BackendUnavailable, BuildError, Capability, Runnable
from tessera.backends.patterns import find_matches, is_constant, is_convex, is_op, wildcard
from tessera.backends.registry import BackendRegistry, Candidate, default_registry, register_backend
from tessera.backends.rules import PatternRule, generate_groups

__all__ = [
    "Backend",
    "BackendRegistry",
    "BackendUnavailable",
    "BuildError",
    "Candidate",
    "Capability",
    "PatternRule",
    "Runnable",
    "default_registry",
    "find_matches",
    "generate_groups",
    "is_constant",
    "is_convex",
    "is_op",
    "register_backend",
    "wildcard",
]
