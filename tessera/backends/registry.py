"""The backend registry: backends, their patterns and pattern rules.

Three ways in: built-in backends (one module each), declarative patterns in ``configs/backends/*.yaml``,
and third-party backends from the ``tessera.backends`` entry-point group (``importlib.metadata`` only).
:func:`default_registry` builds the process-wide registry once; :func:`register_backend` adds to it;
:meth:`BackendRegistry.candidates` gives the (backend, node set) candidates the placement search measures.

References: Collage paper §3, Listing 1 (backend registration). Details: docs/backends.md.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.backends.base import Backend
from tessera.backends.patterns import Pattern, find_matches, is_constant, is_op, wildcard
from tessera.backends.rules import (
    ElementwiseFusionRule,
    GraphCompilerRule,
    PatternRule,
    SingleOpRule,
    generate_groups,
)
from tessera.core.errors import InputError
from tessera.core.graph import Graph

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tessera.backends"


@dataclass(frozen=True)
class NamedPattern:
    name: str
    pattern: Pattern
    origin: str = "builtin"


@dataclass
class BackendEntry:
    """A registered backend: how to make it, its patterns and rules, and where it came from."""

    name: str
    factory: Callable[[], Backend] | None
    patterns: list[NamedPattern] = field(default_factory=list)
    rules: list[PatternRule] = field(default_factory=list)
    origin: str = "builtin"
    load_error: str | None = None  # a plugin that failed to load is listed, unavailable
    _instance: Backend | None = field(default=None, repr=False)

    def backend(self) -> Backend:
        if self._instance is None:
            if self.factory is None:
                raise InputError(f"backend {self.name!r} failed to load: {self.load_error}")
            self._instance = self.factory()
        return self._instance

    def available(self) -> tuple[bool, str]:
        """Whether the backend can run here, and why not. Never raises: a plugin whose construction
        or ``available()`` raises is unavailable, with the error as the reason."""
        if self.factory is None:
            return False, f"plugin failed to load: {self.load_error}"
        try:
            ok, reason = self.backend().available()
        except Exception as exc:  # noqa: BLE001 - third-party code: never crash the registry
            return False, f"availability check failed: {type(exc).__name__}: {exc}"
        return bool(ok), str(reason or "")

    def describe(self) -> dict[str, Any]:
        """The ``tessera backends --json`` row."""
        if self.factory is None:
            info: dict[str, Any] = {
                "name": self.name,
                "available": False,
                "reason": f"plugin failed to load: {self.load_error}",
                "version": None,
                "device": None,
            }
            capability = None
        else:
            capability = None
            try:
                backend = self.backend()
                info = backend.describe()
            except Exception:  # noqa: BLE001 - a plugin that raises is listed, unavailable
                info = {"name": self.name, "available": False, "reason": self.available()[1]}
                info.update(version=None, device=None)
            info["name"] = self.name
            if info["available"]:
                try:
                    cap = backend.capability()
                    capability = {
                        "op_types": len(cap.op_types) if cap.op_types is not None else None,
                        "dtypes": sorted(cap.dtypes),
                        "source": cap.source,
                        "query": cap.query,
                    }
                except Exception as exc:  # noqa: BLE001 - a broken runtime is reported, not raised
                    info["available"] = False
                    info["reason"] = f"capability query failed: {type(exc).__name__}: {exc}"
        info["patterns"] = len(self.patterns)
        info["rules"] = len(self.rules)
        info["origin"] = self.origin
        info["capability"] = capability
        return info


@dataclass(frozen=True)
class Candidate:
    """A subgraph a backend can run as one unit, and which pattern or rule proposed it."""

    backend: str
    nodes: frozenset[str]
    via: str


class BackendRegistry:
    """Backends by name, with their patterns and pattern rules."""

    def __init__(self) -> None:
        self._entries: dict[str, BackendEntry] = {}
        self._pending: dict[str, list[NamedPattern]] = {}  # YAML patterns of backends not (yet) registered

    # -- registration ---------------------------------------------------------------------------

    def register_backend(
        self,
        name: str,
        factory: Callable[[], Backend] | type[Backend] | Backend,
        *,
        patterns: Iterable[Pattern | NamedPattern] = (),
        rules: Iterable[PatternRule] = (),
        origin: str = "user",
        replace: bool = False,
    ) -> BackendEntry:
        """Register a backend: a factory (or class, or instance), its patterns and pattern rules."""
        if not name or not isinstance(name, str):
            raise ValueError("a backend needs a name")
        if name in self._entries and not replace:
            raise ValueError(f"backend {name!r} is already registered (pass replace=True to override)")
        if isinstance(factory, Backend):
            instance = factory
            make: Callable[[], Backend] = lambda: instance  # noqa: E731
        else:
            make = factory
        entry = BackendEntry(name, make, origin=origin)
        self._entries[name] = entry
        for p in patterns:
            self.add_pattern(name, p)
        for r in rules:
            self.add_pattern_rule(name, r)
        entry.patterns.extend(self._pending.pop(name, []))
        return entry

    def add_pattern(self, backend: str, pattern: Pattern | NamedPattern, *, name: str | None = None) -> None:
        """Collage's ``add_backend_pattern``: the backend runs subgraphs matching ``pattern``."""
        named = (
            pattern
            if isinstance(pattern, NamedPattern)
            else NamedPattern(name or f"pattern{len(self.entry(backend).patterns)}", pattern)
        )
        self.entry(backend).patterns.append(named)

    def add_pattern_rule(self, backend: str, rule: PatternRule) -> None:
        """Collage's ``add_backend_pattern_rule``: groups generated by ``rule`` run on the backend."""
        if not isinstance(rule, PatternRule):
            raise TypeError(f"a pattern rule must be a PatternRule, not {type(rule).__name__}")
        self.entry(backend).rules.append(rule)

    # -- lookup ---------------------------------------------------------------------------------

    def entry(self, name: str) -> BackendEntry:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self._entries) or "none"
            raise InputError(f"unknown backend {name!r} (registered: {known})") from None

    def backend(self, name: str) -> Backend:
        return self.entry(name).backend()

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[BackendEntry]:
        return list(self._entries.values())

    def available(self) -> list[str]:
        """Names of the backends that can run here."""
        out = []
        for e in self._entries.values():
            if e.available()[0]:
                out.append(e.name)
        return out

    def report(self) -> list[dict[str, Any]]:
        return [e.describe() for e in self._entries.values()]

    # -- candidates -----------------------------------------------------------------------------

    def candidates(self, graph: Graph, backends: Iterable[str] | None = None) -> list[Candidate]:
        """Every (backend, node set) that a pattern or rule of an available backend proposes and the
        backend supports, deduplicated, in a deterministic order."""
        names = list(backends) if backends is not None else self.available()
        seen: set[tuple[str, frozenset[str]]] = set()
        out: list[Candidate] = []
        for name in names:
            entry = self.entry(name)
            backend = entry.backend()
            proposals: list[tuple[frozenset[str], str]] = []
            for named in entry.patterns:
                proposals += [
                    (nodes, f"pattern:{named.name}") for nodes in find_matches(graph, named.pattern)
                ]
            for rule in entry.rules:
                proposals += [(g.nodes, f"rule:{rule.name}") for g in generate_groups(graph, rule)]
            for nodes, via in proposals:
                if (name, nodes) in seen:
                    continue
                seen.add((name, nodes))
                if backend.supports(graph, nodes):
                    out.append(Candidate(name, nodes, via))
        return out

    # -- third parties and YAML -----------------------------------------------------------------

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> list[str]:
        """Register the backends that installed distributions declare in ``group``; returns their names.

        A plugin that fails to load is listed as an unavailable backend with the error as the reason.
        """
        loaded = []
        for ep in importlib.metadata.entry_points(group=group):
            origin = f"entry point {ep.name} = {ep.value}"
            try:
                obj = ep.load()
                names = self._register_plugin(ep.name, obj, origin)
            except Exception as exc:  # noqa: BLE001 - third-party code: never crash the registry
                log.warning("backend plugin %s failed to load: %s", ep.name, exc)
                if ep.name not in self._entries:
                    self._entries[ep.name] = BackendEntry(
                        ep.name, None, origin=origin, load_error=f"{type(exc).__name__}: {exc}"
                    )
                continue
            loaded += names
        return loaded

    def _register_plugin(self, ep_name: str, obj: Any, origin: str) -> list[str]:
        if inspect.isclass(obj) and issubclass(obj, Backend):
            name = obj.name or ep_name
            self.register_backend(name, obj, origin=origin)
            return [name]
        if isinstance(obj, Backend):
            name = obj.name or ep_name
            self.register_backend(name, obj, origin=origin)
            return [name]
        if callable(obj):
            before = set(self._entries)
            obj(self)
            return [n for n in self._entries if n not in before]
        raise TypeError(
            f"entry point must name a Backend class, instance or register(registry) function, not {type(obj).__name__}"
        )

    def load_yaml(self, path: str | Path) -> int:
        """Add the patterns of one YAML file (format: :func:`pattern_from_yaml`); returns how many."""
        from tessera.core.config_files import read_yaml

        path = Path(path)
        data, _ = read_yaml(path, what="backend pattern file")
        if not isinstance(data, Mapping) or not isinstance(data.get("backend"), str):
            raise InputError("expected a mapping with 'backend: NAME' and 'patterns:'", source=path)
        patterns = data.get("patterns") or {}
        if not isinstance(patterns, Mapping):
            raise InputError("'patterns' must map pattern names to patterns", source=path)
        unknown = set(data) - {"backend", "patterns", "description"}
        if unknown:
            raise InputError(f"unknown field(s): {', '.join(sorted(unknown))}", source=path)
        backend = data["backend"]
        count = 0
        for pname, spec in patterns.items():
            named = NamedPattern(
                str(pname),
                pattern_from_yaml(spec, where=f"patterns.{pname}", source=path),
                f"yaml {path.name}",
            )
            if backend in self._entries:
                self._entries[backend].patterns.append(named)
            else:
                self._pending.setdefault(backend, []).append(named)
            count += 1
        return count

    def load_yaml_dir(self, folder: str | Path | None = None) -> int:
        from tessera.core.config_files import presets_dir

        folder = Path(folder) if folder is not None else presets_dir("backends")
        if not folder.is_dir():
            return 0
        return sum(self.load_yaml(p) for p in sorted(folder.glob("*.yaml")))


def pattern_from_yaml(spec: Any, *, where: str = "pattern", source: str | Path | None = None) -> Pattern:
    """A pattern from its YAML form.

    ``"*"`` (or ``any``): a wildcard; ``const``: a weight; ``OpType``: that operator with free inputs;
    a mapping ``{op: OpType | [OpType…], args: [...], attrs: {...}, shape: [...], dtype: ...}``, or
    ``{any_of: [...]}`` for alternatives.
    """
    if isinstance(spec, str):
        if spec in ("*", "any", "wildcard"):
            return wildcard()
        if spec in ("const", "constant"):
            return is_constant()
        return is_op(spec)
    if not isinstance(spec, Mapping):
        raise InputError(f"{where}: expected an op name, '*', 'const' or a mapping", source=source)
    unknown = set(spec) - {"op", "args", "attrs", "shape", "dtype", "any_of"}
    if unknown:
        raise InputError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}", source=source)
    if "any_of" in spec:
        pattern = _alternatives(spec["any_of"], where, source)
    elif "op" in spec:
        pattern = _operator(spec, where, source)
    else:
        pattern = wildcard()
    return _constrained(pattern, spec, where, source)


def _alternatives(alts: Any, where: str, source: str | Path | None) -> Pattern:
    """``any_of``: the first of its patterns that matches."""
    if not isinstance(alts, list) or not alts:
        raise InputError(f"{where}.any_of: expected a non-empty list", source=source)
    pattern: Pattern = pattern_from_yaml(alts[0], where=f"{where}.any_of[0]", source=source)
    for i, alt in enumerate(alts[1:], 1):
        pattern = pattern | pattern_from_yaml(alt, where=f"{where}.any_of[{i}]", source=source)
    return pattern


def _operator(spec: Mapping[str, Any], where: str, source: str | Path | None) -> Pattern:
    """``op`` (one type or a list) with its ``args`` patterns, if given."""
    ops = spec["op"] if isinstance(spec["op"], list) else [spec["op"]]
    if not ops or not all(isinstance(o, str) for o in ops):
        raise InputError(f"{where}.op: expected an op type or a list of op types", source=source)
    pattern = is_op(*ops)
    if "args" not in spec:
        return pattern
    if not isinstance(spec["args"], list):
        raise InputError(f"{where}.args: expected a list", source=source)
    return pattern(
        *(pattern_from_yaml(a, where=f"{where}.args[{i}]", source=source) for i, a in enumerate(spec["args"]))
    )


def _constrained(pattern: Pattern, spec: Mapping[str, Any], where: str, source: str | Path | None) -> Pattern:
    """``pattern`` with the ``attrs``, ``shape`` and ``dtype`` the spec asks of the node."""
    if "attrs" in spec:
        if not isinstance(spec["attrs"], Mapping):
            raise InputError(f"{where}.attrs: expected a mapping", source=source)
        pattern = pattern.has_attr(spec["attrs"])
    if "shape" in spec:
        shape = spec["shape"]
        if not isinstance(shape, list) or not all(d is None or isinstance(d, int) for d in shape):
            raise InputError(f"{where}.shape: expected a list of sizes (null for any)", source=source)
        pattern = pattern.has_shape(shape)
    if "dtype" in spec:
        pattern = pattern.has_dtype(str(spec["dtype"]))
    return pattern


# --- the built-in backends and the process-wide registry ----------------------------------------


def _builtin(name: str) -> Callable[[], Backend]:
    def make() -> Backend:
        if name == "onnxruntime":
            from tessera.backends.onnxruntime import OnnxRuntimeBackend

            return OnnxRuntimeBackend()
        if name in ("openvino", "openvino-bf16"):
            from tessera.backends.openvino import OpenVinoBackend

            return OpenVinoBackend("bf16" if name == "openvino-bf16" else "f32")
        if name == "onnxruntime-int8":
            from tessera.backends.onnxruntime_int8 import OnnxRuntimeInt8Backend

            return OnnxRuntimeInt8Backend()
        if name == "tvm":
            from tessera.backends.tvm import TvmBackend

            return TvmBackend()
        if name == "cudnn":
            from tessera.backends.cudnn import CudnnBackend

            return CudnnBackend()
        if name == "tensorrt":
            from tessera.backends.tensorrt import TensorRtBackend

            return TensorRtBackend()
        raise KeyError(name)

    return make


def builtin_rules() -> dict[str, list[PatternRule]]:
    """Each built-in backend's pattern rules (its fusion engine, in Collage's terms)."""
    return {
        # ORT's CPU graph optimizer fuses conv/matmul with following activations and bias adds.
        "onnxruntime": [ElementwiseFusionRule(name="ort-fusion", max_ops=8)],
        # Groups quantized to int8 (QDQ) and run by ORT: regions, so that a quantized group's integer
        # kernels hand int8 tensors on inside it; place uses it under --tolerance.
        "onnxruntime-int8": [GraphCompilerRule(name="onnxruntime-int8-region", max_ops=64)],
        # Graph compilers take whole regions between a seed and its post-dominators.
        "openvino": [GraphCompilerRule(name="openvino-region", max_ops=64)],
        # The same compiler in bf16 (the CPU plugin's inference precision): place uses it under --tolerance.
        "openvino-bf16": [GraphCompilerRule(name="openvino-bf16-region", max_ops=64)],
        # TVM's FuseOps: an anchor (conv/matmul) with its elementwise epilogue.
        "tvm": [ElementwiseFusionRule(name="tvm-fuse-ops", max_ops=16)],
        # cuDNN/cuBLAS are operator libraries: one operator per kernel (plus YAML-enumerated fusions).
        "cudnn": [SingleOpRule(name="cudnn-op")],
        "tensorrt": [GraphCompilerRule(name="tensorrt-region", max_ops=64)],
    }


def builtin_registry() -> BackendRegistry:
    """The built-in backends (five runtimes; ONNX Runtime also in int8, OpenVINO in bf16) with their rules (no YAML, no plugins)."""
    registry = BackendRegistry()
    for name, rules in builtin_rules().items():
        registry.register_backend(name, _builtin(name), rules=rules, origin="builtin")
    return registry


_DEFAULT: BackendRegistry | None = None


def default_registry(*, reload: bool = False) -> BackendRegistry:
    """The process-wide registry: built-ins, ``configs/backends/*.yaml``, then entry-point plugins."""
    global _DEFAULT
    if _DEFAULT is None or reload:
        registry = builtin_registry()
        registry.load_yaml_dir()
        registry.load_entry_points()
        _DEFAULT = registry
    return _DEFAULT


def register_backend(
    name: str,
    factory: Callable[[], Backend] | type[Backend] | Backend,
    *,
    patterns: Iterable[Pattern | NamedPattern] = (),
    rules: Iterable[PatternRule] = (),
    replace: bool = False,
) -> BackendEntry:
    """Register a backend in the process-wide registry (see :meth:`BackendRegistry.register_backend`)."""
    return default_registry().register_backend(
        name, factory, patterns=patterns, rules=rules, origin="user", replace=replace
    )
