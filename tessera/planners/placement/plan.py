"""``plan_placement``: Collage's two-level backend placement for one model on this machine.

Steps: candidates (:mod:`.candidates`) → measured costs and ε (:mod:`.costs`) → op-level DP (:mod:`.dp`)
→ optionally the graph-level evolutionary search (:mod:`.evolution`) → the chosen placement measured end
to end against every available backend running the whole model. A placement never ships slower than the
best single backend: if one is faster, the plan is that backend alone (``search.chosen`` says so).

References: Collage paper §4, thesis §2.4. Details: docs/placement.md.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera.backends.base import runs_on
from tessera.backends.composite import (
    CompileCache,
    CompositeModel,
    compare_outputs,
    latencies,
    within_tolerance,
)
from tessera.backends.measure import Measurer, time_runs
from tessera.backends.profile_cache import device_fingerprint
from tessera.backends.registry import BackendRegistry, default_registry
from tessera.core.errors import InputError, LaunchError
from tessera.core.graph import Graph
from tessera.core.plans import ModelRef, PlacementGroup, PlacementPlan
from tessera.core.traced import traced_values_message
from tessera.planners.placement.branches import branch_contenders
from tessera.planners.placement.candidates import (
    PlacementCandidate,
    SupportTable,
    enumerate_candidates,
    region_candidates,
)
from tessera.planners.placement.costs import CandidateCosts, ContextSwitch
from tessera.planners.placement.dp import frontier_order, op_level_placement
from tessera.planners.placement.evolution import (
    EvolutionOptions,
    Group,
    evolve,
    graph_level_backend,
    offload_groups,
)
from tessera.planners.placement.final import (
    NOISE_MARGIN,
    FinalChoice,
    final_choice,
    remembered_latencies,
    whole_model_key,
)
from tessera.planners.placement.memo import SearchMemo
from tessera.planners.placement.reference import (
    calibrate,
    error_of,
    fp32_comparison,
    inputs_label,
    reference_run,
    within,
    wrong_groups,
)

log = logging.getLogger(__name__)

MAX_REPAIRS = 5  # DP reruns after banning groups whose outputs are wrong


@dataclass(frozen=True)
class PlacementOptions:
    device: str = "cpu"
    backends: tuple[str, ...] | None = None  # None: every available backend of the device
    search: str = "op"  # "op": the DP; "graph": the DP, then the evolutionary search
    budget_s: float = 60.0  # time budget of the graph-level search
    seed: int = 0
    max_states: int = 128
    screen_ratio: float | None = 4.0
    max_fused: int | None = 512  # fused candidates measured at most (those that can win the most)
    max_group_ops: int = 16  # kernels and small fused groups (pattern and rule candidates)
    region_cuts: int = 6  # regions: spans between this many narrow cuts, up to the whole model
    rounds: int = 9  # interleaved timing rounds of the final comparison (at most)
    min_rounds: int = 3  # ... and at least, when the ranking is already clear
    data: str | None = None  # an .npz of inputs the outputs are checked on (default: seeded random)
    tolerance: float | None = None  # max relative output error: reduced-precision backends may run
    tvm_trials: int = 0  # MetaSchedule trials to tune the model's TVM kernels before the search
    run_timeout_s: float = 120.0  # the reference run (one whole-model run) stops past this
    evolution: EvolutionOptions = field(default_factory=EvolutionOptions)


@dataclass
class PlacementResult:
    plan: PlacementPlan
    groups: list[Group]
    latency_s: dict[str, float]  # "placement" and every single backend
    report: dict[str, Any]


def resolve_backends(
    registry: BackendRegistry, device: str, wanted: Sequence[str] | None, *, tolerance: float | None = None
) -> list[str]:
    """The backends to place on: ``wanted`` (each must exist, be available and run on ``device``) or
    every available backend whose device is ``device``; reduced-precision ones (``openvino-bf16``)
    only with a ``tolerance``, slow-compiling ones (``tvm``: :attr:`Backend.by_default`) only when
    named. Raises :class:`InputError` naming what is missing."""
    if wanted:
        out = []
        for name in wanted:
            # unknown name: InputError listing the registered ones
            ok, reason = registry.entry(name).available()
            if not ok:
                raise InputError(f"backend {name!r} is unavailable: {reason}")
            if tolerance is None and not registry.backend(name).exact:
                raise InputError(
                    f"backend {name!r} computes in reduced precision: give --tolerance (the largest relative "
                    "output error allowed)"
                )
            where = registry.backend(name).device
            if not runs_on(where, device):
                raise InputError(f"backend {name!r} runs on {where}, not on the requested --device {device}")
            out.append(name)
        return list(dict.fromkeys(out))
    out, why = [], []
    for entry in registry.entries():
        if entry.factory is None:
            continue
        ok, reason = entry.available()
        if (
            ok
            and runs_on(entry.backend().device, device)
            and (tolerance is not None or entry.backend().exact)
            and entry.backend().by_default
        ):
            out.append(entry.name)
        elif not ok:
            why.append(f"{entry.name}: {reason}")
    if not out:
        raise InputError(
            f"no backend is available on device {device!r} ({'; '.join(why) or 'none registered'})"
        )
    return out


def plan_placement(  # noqa: C901
    graph: Graph,
    options: PlacementOptions = PlacementOptions(),
    *,
    registry: BackendRegistry | None = None,
    measurer: Measurer | None = None,
    progress: Callable[[str], None] | None = None,
) -> PlacementResult:
    """Place ``graph``'s operators on backends (Collage paper §4, thesis §2.4); see the module docstring."""
    registry = registry or default_registry()
    measurer = measurer or Measurer(seed=options.seed)
    if options.search not in ("op", "graph"):
        raise InputError(f"search must be 'op' or 'graph', not {options.search!r}")
    if (why := traced_values_message(graph)) is not None:  # measured on one routing, run on others
        raise InputError(why, source=graph.source)
    backends = resolve_backends(registry, options.device, options.backends, tolerance=options.tolerance)
    feeds, reference = reference_run(graph, options.seed, options.data, timeout_s=options.run_timeout_s)
    calibrate(registry, backends, graph, feeds)
    if options.tvm_trials and "tvm" in backends:
        tuned = registry.backend("tvm").tune(
            graph.extract(graph.order), options.tvm_trials, seed=options.seed
        )
        log.info(
            "tvm: %d kernels, %d tuned now with %d trials", len(tuned.kernels), len(tuned.tuned), tuned.trials
        )
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    support = SupportTable(registry)
    setting = {
        "max_group_ops": options.max_group_ops,
        "region_cuts": options.region_cuts,
        "screen_ratio": options.screen_ratio,
        "max_fused": options.max_fused,
    }
    memo = SearchMemo.for_search(graph, measurer.cache, registry, backends, setting)
    remembered = memo.candidates()
    candidates = (
        remembered if remembered is not None else find_candidates(graph, registry, backends, support, options)
    )
    timings["candidates_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    costs = CandidateCosts(
        graph,
        registry,
        measurer,
        screen_ratio=options.screen_ratio,
        max_fused=options.max_fused,
        progress=progress,
        composed=len(backends) > 1,
    )
    costs.known = memo.costs()
    costs.screen(candidates)
    costs.bound(candidates)
    epsilon = ContextSwitch(registry, measurer)
    compiled: CompileCache = {}
    # Backends are trusted by the DP, not by the plan: a group whose outputs differ from onnxruntime's
    # on the same inputs is banned and the DP runs again (costs are cached, so this is cheap).
    banned: set[tuple[str, frozenset[str]]] = set()

    def cost(c: PlacementCandidate) -> float:
        return math.inf if (c.backend, c.nodes) in banned else costs(c)

    for _ in range(MAX_REPAIRS):
        try:
            op_level = op_level_placement(graph, candidates, cost, epsilon, max_states=options.max_states)
            op_groups: list[Group] = [
                (g.candidate.backend, g.candidate.nodes, g.candidate.via) for g in op_level.groups
            ]
            wrong = wrong_groups(graph, op_groups, feeds, registry, compiled, tolerance=options.tolerance)
        except Exception as exc:  # noqa: BLE001 - no placement of parts runs: whole models still can
            log.warning(
                "no placement of %s's parts could be built and run (%s: %s); comparing whole-model "
                "backends only",
                graph.source,
                type(exc).__name__,
                " ".join(str(exc).split())[:200],
            )
            op_groups = [(backends[0], frozenset(graph.order), "whole-model fallback")]
            break
        if not wrong:
            break
        for b, nodes in wrong:
            log.warning(
                "%s computes a %d-operator group differently from onnxruntime; not placing it there",
                b,
                len(nodes),
            )
        banned.update(wrong)
    timings["op_level_s"] = time.perf_counter() - t0
    answers = costs.answers(candidates)
    if remembered is None or answers != costs.known:
        memo.save(candidates, answers)

    chosen_groups, chosen = op_groups, "op-level"
    search_info: dict[str, Any] = {}
    if options.search == "graph":
        t0 = time.perf_counter()
        chosen_groups, search_info = _graph_level(
            graph, op_groups, backends, support, feeds, compiled, registry, options, reference
        )
        if chosen_groups is not op_groups:
            chosen = "graph-level"
        timings["graph_level_s"] = time.perf_counter() - t0

    # Measured in one run: the placement and every backend on the whole model, interleaved.
    t0 = time.perf_counter()
    runs: dict[str, Callable[[], Any]] = {}
    composite = CompositeModel(
        graph, [(b, n) for b, n, _ in chosen_groups], registry=registry, cache=compiled
    )
    whole = frozenset(graph.order)
    # One group on one backend is that backend alone: timed once, as that backend.
    same_as = chosen_groups[0][0] if len(chosen_groups) == 1 and chosen_groups[0][1] == whole else None
    outputs: dict[str, dict[str, Any]] = {}  # each contender's outputs on feeds: its error, once
    if same_as is None:
        runs["placement"] = lambda: composite.run(feeds)
        with contextlib.suppress(Exception):  # a failing placement is timed as inf, never chosen
            outputs["placement"] = composite.run(feeds)
    wrong_whole: list[str] = []
    for b in backends:
        try:
            single = CompositeModel(graph, [(b, whole)], registry=registry, cache=compiled)
            outputs[b] = single.run(feeds)
            correct = within(outputs[b], reference, registry.backend(b), options.tolerance)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run the whole model
            log.info("%s does not run the whole model: %s", b, exc)
            continue
        if not correct:
            wrong_whole.append(b)
            log.warning("%s computes the whole model differently from onnxruntime; not a contender", b)
        runs[b] = lambda s=single: s.run(feeds)
    parallel = {
        c.name: c
        for c in branch_contenders(
            graph, [b for b in runs if b in backends and b not in wrong_whole], registry
        )
    }
    for name, c in parallel.items():
        with contextlib.suppress(Exception):  # a failing contender is no contender
            outputs[name] = c.model.run(feeds)
            if within(outputs[name], reference, registry.backend(c.backend), options.tolerance):
                runs[name] = lambda m=c.model: m.run(feeds)
    # Only the contenders stay alive while they are timed: every compiled OpenVINO model keeps its own
    # CPU streams: with 24 other small ones alive, tiny bert on OpenVINO ran 0.097 ms instead of 0.077.
    compiled.clear()
    gc.collect()
    keys = {b: whole_model_key(graph.sha256, [(b, whole)]) for b in runs if b in backends}
    if "placement" in runs:
        keys["placement"] = whole_model_key(graph.sha256, [(b, n) for b, n, _ in chosen_groups])
    keys.update({n: whole_model_key(graph.sha256, c.key_groups) for n, c in parallel.items() if n in runs})
    versions = ";".join(f"{b}={registry.backend(b).version or 'unknown'}" for b in sorted(backends))
    measured, cached = remembered_latencies(
        measurer.cache,
        keys,
        versions,
        device_fingerprint(options.device),
        lambda: latencies(runs, rounds=options.rounds, min_rounds=options.min_rounds),
    )
    if same_as is not None:
        measured = {"placement": measured.get(same_as, math.inf), **measured}
    timings["measure_s"] = time.perf_counter() - t0
    singles = {b: measured[b] for b in backends if b in measured and math.isfinite(measured[b])}
    contenders = {b: t for b, t in singles.items() if b not in wrong_whole}
    best_single = min(contenders, key=lambda b: (contenders[b], b)) if contenders else None
    latency = measured["placement"]
    if not math.isfinite(latency) and best_single is None:
        # A plan without a measured latency would be meaningless: the run failed, not the model.
        raise LaunchError(
            "nothing could be measured: the placed model and every single backend failed to run "
            "(the warnings above say why)",
            source=graph.source,
        )
    decision = final_choice(latency, contenders)
    if same_as is not None and same_as == decision.best_single:
        decision = FinalChoice(
            False, same_as, f"the search placed the whole model on {same_as}, the fastest single backend"
        )
    chosen_key = "placement" if same_as is None else same_as
    if not decision.keep_placement and best_single is not None:
        chosen_groups = [(best_single, whole, "whole model")]
        chosen = f"single backend: {best_single}"
        latency = singles[best_single]
        chosen_key = best_single
    branches = min((n for n in parallel if n in measured), key=lambda n: (measured[n], n), default=None)
    if branches is not None and measured[branches] * (1 + NOISE_MARGIN) < latency:
        c = parallel[branches]
        chosen_groups = [(c.backend, g, "parallel branch") for g in c.groups]
        chosen, latency, chosen_key = "parallel branches", measured[branches], branches
        note = (
            f"the parallel branches on {c.backend}, run concurrently, measured faster beyond the noise margin"
        )
        decision = FinalChoice(True, decision.best_single, note)
    error = error_of(outputs[chosen_key], reference)
    exact = {b: t for b, t in contenders.items() if registry.backend(b).exact}
    if error["max_rel"] > (options.tolerance or 0.0) and not exact and options.tolerance is not None:
        raise InputError(
            f"no placement on {', '.join(backends)} stays within --tolerance {options.tolerance:g} "
            f"(relative error {error['max_rel']:.3g}): add an fp32 backend (onnxruntime) or loosen the budget",
            source=graph.source,
        )
    if (
        error["max_rel"] > (options.tolerance or 0.0)
        and exact
        and any(not registry.backend(b).exact for b, _, _ in chosen_groups)
    ):  # the groups were each within the budget, their errors together are not: exact instead
        fallback = min(exact, key=lambda b: (exact[b], b))
        log.warning(
            "the placement's error %.3g exceeds --tolerance; %s runs the whole model",
            error["max_rel"],
            fallback,
        )
        chosen_groups, chosen, latency = (
            [(fallback, whole, "whole model")],
            f"single backend: {fallback}",
            exact[fallback],
        )
        error = error_of(outputs[fallback], reference)

    concurrent = chosen == "parallel branches"
    groups = []
    group_costs: list[float] = []
    index = {n: i for i, n in enumerate(graph.order)}
    for i, (b, nodes, via) in enumerate(chosen_groups):
        cost = (
            singles.get(b)
            if len(chosen_groups) == 1
            else costs.measurement(PlacementCandidate(b, nodes, via)).median_s
        )
        group_costs.append(cost if cost is not None and math.isfinite(cost) else 0.0)
        groups.append(
            PlacementGroup(
                id=i,
                backend=b,
                nodes=sorted(nodes, key=index.__getitem__),
                pattern=via,
                measured_time_s=cost if cost is not None and math.isfinite(cost) else None,
            )
        )
    predicted_total = sum(group_costs)
    if concurrent:  # a level costs its slowest group (each measured alone)
        levels, steps = parallel[chosen_key].model.levels, parallel[chosen_key].model.steps
        predicted_total = sum(max(group_costs[steps[p].index] for p in level) for level in levels)
    eps_total = _epsilon_of(graph, chosen_groups, epsilon)
    predicted = {
        "latency_s": predicted_total + eps_total,
        "context_switch_s": eps_total,
        "op_level_latency_s": op_level.predicted_s,
        "model": "Collage Eq. 2-3: sum of measured group costs + measured context switches",
    }
    measured_doc = {
        "latency_s": latency,
        "searched_placement_latency_s": measured["placement"],
        **(
            {"parallel_branches_latency_s": {c.backend: measured.get(n) for n, c in parallel.items()}}
            if parallel
            else {}
        ),
        "single_backend_latency_s": {b: singles.get(b) for b in backends},
        "best_single_backend": best_single,
        "wrong_outputs": sorted(wrong_whole),
        "speedup_over_best_single": (singles[best_single] / latency) if best_single else None,
        "compared_with": sorted(contenders),
        "tolerance": options.tolerance,
        "error": error,
        "inputs": inputs_label(options.data, options.seed),
        **fp32_comparison(exact, latency, options.tolerance),
        "noise_margin": NOISE_MARGIN,
        "decision": decision.note,
        "timing": (
            f"median of {options.min_rounds}-{options.rounds} interleaved rounds in one process (more "
            "when contenders are close), stored in the profile cache: a run that finds every contender "
            "there reads them instead"
        ),
    }
    search_doc: dict[str, Any] = {
        "kind": options.search,
        "backends": backends,
        "chosen": chosen,
        "seed": options.seed,
        "max_states": options.max_states,
        "screen_ratio": options.screen_ratio,
        "candidates": len(candidates),
        "screened_candidates": costs.screened,
        "max_fused": options.max_fused,
        "unmeasured_candidates": costs.unmeasured,
        "dp_states": op_level.states,
        "max_group_ops": options.max_group_ops,
        "banned_groups": len(banned),
        "context_switch": epsilon.table(),
        **search_info,
    }
    plan = PlacementPlan(
        model=ModelRef.of(graph),
        device=options.device,
        groups=groups,
        concurrent=concurrent,
        predicted=predicted,
        measured=measured_doc,
        search=search_doc,
    )
    # Facts of this run, not of the plan (a warm repeat run writes the same plan).
    report = {
        "timings": timings,
        "op_level_groups": len(op_groups),
        "measured_candidates": len(costs.measured),
        "final_timings_cached": cached,
    }
    return PlacementResult(plan, chosen_groups, measured, report)


def find_candidates(
    graph: Graph,
    registry: BackendRegistry,
    backends: Sequence[str],
    support: SupportTable,
    options: PlacementOptions,
) -> list[PlacementCandidate]:
    """Kernels and small fused groups (:func:`enumerate_candidates`), then regions up to the whole model
    (:func:`region_candidates`) that are not among them."""
    candidates = enumerate_candidates(
        graph, registry, backends, support=support, max_group_ops=options.max_group_ops
    )
    have = {(c.backend, c.nodes) for c in candidates}
    regions = region_candidates(
        graph, backends, frontier_order(graph), support=support, max_cuts=options.region_cuts
    )
    return candidates + [c for c in regions if (c.backend, c.nodes) not in have]


def _epsilon_of(graph: Graph, groups: Sequence[Group], epsilon: ContextSwitch) -> float:
    """ε of a placement: every tensor read by a group on another backend than its producer's."""
    backend_of = {n: b for b, nodes, _ in groups for n in nodes}
    group_of = {n: i for i, (_, nodes, _) in enumerate(groups) for n in nodes}
    total = 0.0
    for tensor, readers in graph.consumers.items():
        producer = graph.producer.get(tensor)
        if producer is None:
            continue
        info = graph.tensors.get(tensor)
        seen: set[int] = set()
        for r in readers:
            g = group_of[r]
            if g == group_of[producer] or g in seen:
                continue
            seen.add(g)
            if backend_of[r] != backend_of[producer]:
                total += epsilon(backend_of[producer], backend_of[r], info.nbytes if info else 0)
    return total


def _graph_level(  # noqa: PLR0913
    graph: Graph,
    op_groups: list[Group],
    backends: Sequence[str],
    support: SupportTable,
    feeds: dict[str, Any],
    compiled: CompileCache,
    registry: BackendRegistry,
    options: PlacementOptions,
    reference: dict[str, Any],
) -> tuple[list[Group], dict[str, Any]]:
    gb = graph_level_backend(backends)
    if gb is None:
        log.warning(
            "--search graph: no graph-level backend among %s; keeping the op-level placement", backends
        )
        return op_groups, {"graph_level_backend": None}
    on_gb = {n for b, nodes, _ in op_groups if b == gb for n in nodes}
    bits_for = [
        n
        for n in graph.order
        if n not in on_gb and n not in graph.constant_nodes and support.supports(gb, graph, n)
    ]
    placements: dict[tuple[int, ...], list[Group]] = {}

    def fitness(bits: tuple[int, ...]) -> float:
        groups = offload_groups(
            graph, op_groups, gb, [n for n, bit in zip(bits_for, bits, strict=True) if bit]
        )
        placements[bits] = groups
        try:
            model = CompositeModel(graph, [(b, n) for b, n, _ in groups], registry=registry, cache=compiled)
            outputs = model.run(feeds)
            exact = all(registry.backend(b).exact for b, _, _ in groups)
            if not (
                compare_outputs(outputs, reference)["ok"]
                if exact
                else within_tolerance(outputs, reference, options.tolerance)
            ):
                return math.inf  # a placement with wrong outputs is unfit
            return time_runs(lambda: model.run(feeds), warmup=2, repeat=7).median_s
        except Exception as exc:  # noqa: BLE001 - an individual that does not build is unfit
            log.info("individual does not run: %s", exc)
            return math.inf

    evo = EvolutionOptions(
        **{**options.evolution.__dict__, "seed": options.seed, "budget_s": options.budget_s}
    )
    n = len(bits_for)
    result = evolve(n, fitness, [(0,) * n, (1,) * n], evo)
    info = {
        "graph_level_backend": gb,
        "offloadable_operators": n,
        "evolution": {
            "generations": result.generations,
            "evaluations": result.evaluations,
            "stopped": result.stopped,
            "population": evo.population,
            "budget_s": evo.budget_s,
        },
    }
    if result.best == (0,) * n or not math.isfinite(result.best_fitness):
        return op_groups, info
    return placements[result.best], info
