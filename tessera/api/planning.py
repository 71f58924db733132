"""The planning the API's ``plan`` and the CLI's ``plan`` share: a training pipeline (gpp, spp;
optionally profiled on this machine) and a decoding plan (cp, from an ONNX decoder or an LLM
config), with no printing: progress and one-line notes go to the caller's callbacks."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tessera.backends.torch_optim import OPTIMIZERS
from tessera.core.errors import InputError
from tessera.core.graph import Graph, batch_fix
from tessera.core.plans import CpPlan, ModelRef
from tessera.core.specs import ClusterSpec
from tessera.core.traced import traced_values_message
from tessera.core.weights import is_lazy

if TYPE_CHECKING:  # the planners import torch: loaded when a plan is made
    from tessera.planners.cp.cost import CostParams
    from tessera.planners.cp.llm import LlmConfig
    from tessera.planners.cp.plan import SweepRow
    from tessera.planners.cp.recognize import Decoder
    from tessera.planners.pipeline.plan import RewriteChoice

__all__ = ["DecodePlanning", "Progress", "plan_decoding", "plan_pipeline"]

# progress(what, done, total): a step of a long measurement (total None: unknown)
Progress = Callable[[str, int, int | None], None]
MAX_COUNTED_BYTES = 1 << 30  # a model's weights up to this are loaded to count its decode step


def plan_pipeline(  # noqa: PLR0913
    graph: Graph,
    cluster: ClusterSpec,
    *,
    kind: str = "gpp",
    mini_batch: int,
    devices: int | None = None,
    schedule: str = "1f1b",
    memory_limit: int | float | str | None = None,
    k: int = 2,
    recompute: str = "never",
    zero: int | str = 0,
    tensor_parallel: int | str = 1,
    stages: int | None = None,
    bytes_per_param: float | None = None,
    optimizer: str = "sgd",
    loss: str = "mse",
    max_grad_norm: float | None = None,
    baseline: bool = True,
    rewrite_auto: bool = False,
    profile: bool = False,
    cache: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    note: Callable[[str], None] | None = None,
) -> RewriteChoice:
    """A gpp or spp plan of ``graph`` (the plan, its pipeline and its simulation: ``.plan``).
    ``profile``: operator and stage times measured on this machine (cached at ``cache``); ``note``
    gets the measurement's one-line summary. InfeasibleError (exit 3) when nothing fits."""
    from tessera.planners.pipeline.plan import pipeline_options, plan_gpp_best
    from tessera.planners.pipeline.profile import open_cache
    from tessera.planners.pipeline.search import planned_device_type
    from tessera.planners.pipeline.stage_profile import StageProfiler, stages_measurable

    if cache is not None and not profile:
        raise InputError("--cache is the cache of --profile's measurements; give --profile too")
    options = pipeline_options(
        cluster, mini_batch=mini_batch, devices=devices, schedule=schedule, memory_limit=memory_limit,
        k=k, recompute=recompute, bytes_per_param=bytes_per_param, zero=zero, tensor_parallel=tensor_parallel,
        stages=stages,
    )  # fmt: skip
    if optimizer not in OPTIMIZERS:
        raise InputError(f"--optimizer {optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    if loss not in ("mse", "ce"):
        raise InputError(f"--loss {loss!r}: expected mse or ce")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise InputError(f"--max-grad-norm {max_grad_norm}: expected a positive norm")
    options = dataclasses.replace(options, optimizer=optimizer, loss=loss, max_grad_norm=max_grad_norm)
    store = open_cache(cache) if profile else None
    device_type = planned_device_type(cluster, devices)
    try:
        return plan_gpp_best(
            graph,
            cluster,
            options,
            kind=kind,
            baseline=baseline,
            rewrite_auto=rewrite_auto,
            measure=(lambda g: _profiled(g, device_type, store, progress, note)) if store else None,
            # Stages are measured on this machine's CPU or GPU, as the cluster's devices are; a GPU
            # cluster planned where torch sees no GPU keeps the operators' times.
            refine=(
                lambda g: (
                    StageProfiler(
                        g,
                        device_type,
                        store,
                        cluster=cluster,
                        optimizer=optimizer,
                        loss=loss,
                        max_grad_norm=max_grad_norm,
                    ).refine_all
                )
            )
            if store and stages_measurable(device_type)
            else None,
        )
    finally:
        if store is not None:
            store.close()


def _profiled(
    graph: Graph, device_type: Any, store: Any, progress: Progress | None, note: Callable[[str], None] | None
) -> Any:
    """``--profile``: every operator measured on this machine, then one summary line to ``note``."""
    from tessera.planners.pipeline.profile import profile_graph

    measured = profile_graph(
        graph,
        device_type,
        cache=store,
        progress=(lambda done, total: progress("profiling operators", done, total)) if progress else None,
    )
    r = measured.report
    roofline = measured.roofline_types()
    fallback = (
        f", {sum(roofline.values())} on the roofline ({', '.join(f'{t} x{n}' for t, n in roofline.items())})"
        if roofline
        else ""
    )
    if note is not None:
        note(
            f"profiled {r.operators} operators ({r.distinct} distinct) on {measured.source['device']}, "
            f"torch {measured.source['torch']}: {r.measurements} (operator, samples) measured, "
            f"{r.cache_hits} cached{fallback}, {r.seconds:.1f}s (cache {store.path})"
        )
    return measured


@dataclass
class DecodePlanning:
    """A decoding plan (None with a sweep alone) and the sweep's rows, for the config planned."""

    plan: CpPlan | None
    rows: list[SweepRow]
    config: LlmConfig
    warnings: list[str] = dataclasses.field(default_factory=list)
    """What the prediction could not hold to (one line each), for the caller to show."""


def plan_decoding(  # noqa: PLR0913
    cluster: ClusterSpec,
    *,
    graph: Graph | None = None,
    llm: str | None = None,
    batch: int,
    context: int | None,
    output_len: str = "uniform:1-1024",
    sweep_contexts: list[int] | None = None,
    layers: int | None = None,
    dtype: str | None = None,
    strategy: str = "auto",
    degree: int | None = None,
    compile: bool = False,  # noqa: A002 - launch's flag
    profile: bool = False,
    cache: str | os.PathLike[str] | None = None,
) -> DecodePlanning:
    """A cp plan of the decoder ``graph`` or of the LLM config ``llm`` (a file or a preset): the
    decoder recognized (InputError naming the node otherwise), then planned; ``compile``: its decode
    step predicted as ``launch --compile`` runs it; ``profile``: that step timed on this machine
    first (:func:`_decode_profiled`), cached in the profile cache at ``cache``."""
    from tessera.planners.cp.llm import LlmSource, load_llm_config
    from tessera.planners.cp.plan import plan_cp_request
    from tessera.planners.cp.recognize import recognize_decoder
    from tessera.planners.cp.workload import parse_output_lengths

    if (graph is None) == (llm is None):
        raise InputError("a decoding plan takes either a model (an ONNX decoder) or an LLM config, not both")
    model_ref, params, positions = None, None, None
    if graph is not None:
        decoder = recognize_decoder(graph)
        why = (
            decoder.fixed_length_message(next(iter(graph.inputs)))
            or _fixed_batch_message(graph, batch)
            or traced_values_message(graph)
        )
        if why is not None:  # launch could not decode it: refused now (exit 2)
            raise InputError(why, source=graph.source)
        config = decoder.config
        source = LlmSource(kind="onnx", path=graph.source, sha256=graph.sha256)
        model_ref, (params, positions) = ModelRef.of(graph), _counted(graph, decoder)
    else:
        assert llm is not None
        config, source = load_llm_config(llm)
    config = config.with_dtype(dtype)
    warnings: list[str] = []
    if compile:
        from tessera.planners.cp.cost import CostParams

        params = dataclasses.replace(params or CostParams(), compiled=True)
        if not all(t.decode_compiled_op_overhead for t in cluster.device_types.values()):
            warnings.append(
                f"cluster {cluster.name}: no decode_compiled_op_overhead for its devices (tessera calibrate "
                "measures it): the compiled step is predicted at the traced step's cost per operation"
            )
    if profile:
        if graph is None:
            raise InputError("--profile times the decode step of a model: it needs MODEL, not --llm")
        at = context if context is not None else (sweep_contexts or [1])[0]
        params, why = _decode_profiled(graph, decoder, config, cluster, params, cache, at, positions, compile)
        warnings += why
    plan, rows = plan_cp_request(
        config, cluster, batch=batch, context=context, output_lengths=parse_output_lengths(output_len),
        sweep_contexts=sweep_contexts or [], layers=layers, model=model_ref, source=source,
        positions=positions, strategy=None if strategy == "auto" else strategy, degree=degree, params=params,
    )  # fmt: skip
    return DecodePlanning(plan, rows, config, warnings)


def _counted(graph: Graph, decoder: Decoder) -> tuple[CostParams | None, int | None]:
    """The cost model's constants with the operations of the decode step ``launch`` will run, traced
    from the model (weights in memory up to 1 GiB; None: the default count per layer), and the
    positions a request may hold as the decode step reads them (a learned table's rows less the
    offset the graph adds; the recognized limit where the step is not built)."""
    if is_lazy(graph.model) or graph.param_bytes > MAX_COUNTED_BYTES:
        return None, decoder.position_limit
    from tessera.executor.decode_program import (
        GATHER_OPERATIONS,
        REDUCE_OPERATIONS,
        TP_DEGREES,
        step_operations,
        tp_launch,
    )
    from tessera.executor.graph_decoder import GraphDecoder
    from tessera.executor.step_check import check_stepwise
    from tessera.planners.cp.cost import CostParams

    # A graph the decode step cannot be built from (one that runs only at its exported length, or
    # whose positions cannot be found) or that steps but not exactly (NotStepwise) is refused now,
    # with the reason launch would give, not after a plan was written.
    stepped = GraphDecoder(graph, decoder)
    check_stepwise(stepped)
    operations = step_operations(stepped)
    # What a tp launch splits at each degree the heads allow (the rest it runs whole on every rank).
    split = tuple(
        tp_launch(stepped, graph, decoder.config, t) for t in TP_DEGREES if decoder.config.heads % t == 0
    )
    counted = (
        CostParams(
            step_operations=operations,
            gather_operations=GATHER_OPERATIONS,
            reduce_operations=REDUCE_OPERATIONS,
            tp_launch=split,
        )
        if operations
        else None
    )
    return counted, stepped.max_positions


def _decode_profiled(  # noqa: PLR0913
    graph: Graph,
    decoder: Decoder,
    config: LlmConfig,
    cluster: ClusterSpec,
    params: CostParams | None,
    cache: str | os.PathLike[str] | None,
    context: int,
    positions: int | None,
    compiled: bool,
) -> tuple[CostParams | None, list[str]]:
    """``params`` with the host time of an operation measured on this model's own decode step
    (traced; compiled too with ``compiled``) at ``context`` (within the model's ``positions``): the
    step less the compute the cost model gives a batch-1 dp step there, over the step's operations.
    Where it cannot be measured here (the step not traced or not built, devices other than this
    machine's CPUs), ``params`` and why."""
    from tessera.executor.decode_profile import STEPS, measured_step
    from tessera.planners.cp.cost import estimate
    from tessera.planners.cp.workload import OutputLengths, Workload
    from tessera.planners.pipeline.profile import open_cache

    if params is None or not params.step_operations:
        return params, [
            f"--profile: {graph.source}'s decode step is not traced here: predicted from the spec"
        ]
    types = list(cluster.device_types.values())
    if any(t.kind != "cpu" for t in types):
        return params, [
            f"--profile: cluster {cluster.name} has devices other than CPUs, which this machine cannot time: "
            "its decode step predicted from the spec"
        ]
    store = open_cache(cache)
    threads = min(t.cores or 1 for t in types)
    at = max(1, min(context, (positions or context + STEPS + 1) - STEPS - 1))
    measured = []
    for on in (False, True) if compiled else (False,):
        try:
            step = measured_step(graph, decoder, store, context=at, compiled=on, threads=threads)
        except ValueError as exc:
            return params, [f"--profile: {graph.source}: {exc}: its decode step predicted from the spec"]
        modeled = estimate(
            config, cluster, Workload(1, at + STEPS // 2, OutputLengths("fixed", 1, 1)), "dp", 1,
            params=dataclasses.replace(params, compiled=on),
        )  # fmt: skip
        compute = modeled.step_time_s - modeled.host_s
        measured.append(max(step - compute, 0.0) / params.step_operations)
    return dataclasses.replace(
        params, measured_op_overhead=(measured[0], measured[-1] if compiled else 0.0)
    ), []


def _fixed_batch_message(graph: Graph, batch: int) -> str | None:
    """Why a plan of ``batch`` requests cannot decode a model whose batch axis is a fixed number
    smaller than that (requests then decode in batches of that size), with the fix; None if it can."""
    for name, size in graph.fixed_batch.items():
        if batch > size:
            return (
                f"input {name!r} has a fixed batch of {size}, so at most {size} request(s) decode at a time, "
                f"but the plan has a batch of {batch}: {batch_fix(name, size)}, or plan --batch {size}"
            )
    return None
