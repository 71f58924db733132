"""The search memo: a model's placement candidates and their measured costs, kept next to the profile
cache so that a later search of the same model on the same machine starts warm.

Keyed by the model's sha256, input shapes and operators, every searched backend's name, version and
device fingerprint, and the options that shape the candidates. It caches the profile cache's answers:
delete ``<profile cache>.placement/`` to forget it. Details: docs/placement.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from tessera.backends.profile_cache import ProfileCache, device_fingerprint
from tessera.backends.registry import BackendRegistry
from tessera.core.files import write_atomic
from tessera.core.graph import Graph
from tessera.planners.placement.candidates import PlacementCandidate

log = logging.getLogger(__name__)

MEMO_VERSION = 1
CostKey = tuple[str, frozenset[str]]


class SearchMemo:
    """One model's memo file (see the module docstring); ``path`` None: remember nothing."""

    def __init__(self, graph: Graph, path: Path | None) -> None:
        self.graph = graph
        self.path = path
        self._data: dict[str, object] | None = None
        if path is not None and path.is_file():
            try:
                self._data = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                log.warning("ignoring the unreadable search memo %s: %s", path, exc)

    @classmethod
    def for_search(
        cls,
        graph: Graph,
        cache: ProfileCache | None,
        registry: BackendRegistry,
        backends: Sequence[str],
        setting: Mapping[str, object],
    ) -> SearchMemo:
        """The memo of ``graph`` searched over ``backends`` with ``setting`` (next to ``cache``)."""
        path = getattr(cache, "path", None)
        if not isinstance(path, Path) or not path.parent.is_dir() or not graph.sha256:
            return cls(graph, None)  # no cache file, or a graph not loaded from model bytes
        shapes = sorted((k, list(v)) for k, v in (getattr(graph, "input_shapes", None) or {}).items())
        parts = [MEMO_VERSION, graph.sha256, shapes, list(graph.order), sorted(setting.items())]
        for name in backends:
            backend = registry.backend(name)
            parts.append([name, backend.version, device_fingerprint(backend.device)])
        key = hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]
        return cls(graph, path.with_name(path.name + ".placement") / f"{key}.json")

    def candidates(self) -> list[PlacementCandidate] | None:
        """The remembered candidates, or None."""
        if self._data is None:
            return None
        order = self.graph.order
        return [
            PlacementCandidate(b, frozenset(order[i] for i in nodes), via)
            for b, nodes, via in self._data["candidates"]  # type: ignore[union-attr]
        ]

    def costs(self) -> dict[CostKey, float]:
        """The remembered ``M(P(g))`` per (backend, nodes)."""
        if self._data is None:
            return {}
        order = self.graph.order
        return {
            (b, frozenset(order[i] for i in nodes)): float(cost)
            for b, nodes, cost in self._data.get("costs", [])  # type: ignore[union-attr]
        }

    def save(self, candidates: Sequence[PlacementCandidate], costs: Mapping[CostKey, float]) -> None:
        if self.path is None:
            return
        index = {n: i for i, n in enumerate(self.graph.order)}

        def nodes(ns: frozenset[str]) -> list[int]:
            return sorted(index[n] for n in ns)

        data = {
            "version": MEMO_VERSION,
            "candidates": [[c.backend, nodes(c.nodes), c.via] for c in candidates],
            "costs": [
                [b, nodes(ns), cost]
                for (b, ns), cost in sorted(costs.items(), key=lambda kv: (kv[0][0], nodes(kv[0][1])))
            ],
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(data, separators=(",", ":")))
        except OSError as exc:
            log.warning("cannot write the search memo %s: %s", self.path, exc)
