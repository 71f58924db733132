"""A decoder's own decode step timed on this machine (``plan --kind cp --profile``): the step a dp
rank runs (its traced program, or compiled by inductor as ``launch --compile`` runs it; a static
cache after a prefill), at batch 1, the mean step of each round, the median round; cached in the
profile cache, so a warm run plans the same bytes. Why: docs/cp.md ("Profiled decode plans")."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from tessera.backends.base import torch_threads

if TYPE_CHECKING:
    from tessera.backends.profile_cache import ProfileCache
    from tessera.core.graph import Graph
    from tessera.planners.cp.recognize import Decoder

__all__ = ["ROUNDS", "STEPS", "measured_step"]

BACKENDS = ("torch-decode.step", "torch-decode.compiled-step")  # traced, compiled
RECIPE = "a dp rank's decode step at batch 1 after a prefill: static cache, median of the rounds' means"
# Rounds of STEPS steps each (a prefill before each): the host's speed drifts over seconds, and the
# median round outvotes a slow spell (one block of steps read 510 us for a 310-340 us step).
ROUNDS = 5
STEPS = 32


def measured_step(
    graph: Graph, decoder: Decoder, cache: ProfileCache, *, context: int, compiled: bool, threads: int
) -> float:
    """Seconds of one batch-1 decode step of ``graph`` after a ``context``-token prefill, with
    ``threads`` torch threads: cached, else measured (the median over :data:`ROUNDS` rounds of
    each round's mean step: ``launch`` reports the mean). ``compiled``: the step compiled by
    torch.compile's inductor (its compilation not counted). ValueError where the step cannot be
    built."""
    import torch

    from tessera.backends.profile_cache import Profile, device_fingerprint
    from tessera.planners.pipeline.profile import digest

    fingerprint = device_fingerprint(f"torch cpu, {threads} thread{'' if threads == 1 else 's'}")
    version = str(torch.__version__)
    shapes = sorted((k, list(v)) for k, v in graph.input_shapes.items())
    key = digest([graph.sha256, shapes, list(graph.rewrites), context, RECIPE])
    backend = BACKENDS[compiled]
    found = cache.get(backend, version, fingerprint, key)
    if found is not None and found.ok:
        return found.median_s
    with torch_threads(threads):
        seconds = _measure(graph, decoder, context, compiled)
    cache.put(Profile(backend, version, fingerprint, key, seconds, 0.0, ROUNDS * STEPS))
    return seconds


def _measure(graph: Graph, decoder: Decoder, context: int, compiled: bool) -> float:
    from tessera.executor.decode_program import compile_step
    from tessera.executor.graph_decode_worker import time_decode_step
    from tessera.executor.graph_decoder import GraphDecoder

    stepped = GraphDecoder(graph, decoder)
    why = compile_step(stepped, 1, 1, inductor=compiled)
    if why is not None:
        raise ValueError(f"the decode step could not be built: {why}")
    time_decode_step(stepped, 4, context)  # warm-up: the first steps pay allocation and caches
    return statistics.median(time_decode_step(stepped, STEPS, context, mean=True) for _ in range(ROUNDS))
