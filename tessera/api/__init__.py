"""tessera as a library: each command as a function returning the object the command prints
(``--json`` is its ``to_json()``); errors are :class:`TesseraError` subclasses carrying the exit
code the command would end with. ``__all__`` is the contract, documented in docs/api.md::

    import tessera
    plan = tessera.plan("mmt.onnx", cluster="local-cpu-split", mini_batch=16)
    run = tessera.launch(plan, steps=3)
    print(run.to_json()["measured"]["iteration_time_s"])
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import onnx

from tessera.api.models import (
    TesseraWarning,
    check_plan_llm_config,
    load_model,
    load_plan_model,
    plan_graph,
)
from tessera.api.planning import plan_decoding, plan_pipeline
from tessera.api.results import Inspection, Placement, Validation, inspect_report
from tessera.core.errors import InfeasibleError, InputError, LaunchError, TesseraError
from tessera.core.graph import Graph
from tessera.core.plans import CpPlan, GppPlan, Plan, load_plan
from tessera.core.specs import ClusterSpec, load_cluster
from tessera.core.tokens import default_loss
from tessera.executor import RUNNERS, LaunchRequest
from tessera.executor.launcher import LaunchOptions
from tessera.executor.report import RunReport

__all__ = [
    "Inspection",
    "InfeasibleError",
    "InputError",
    "LaunchError",
    "Placement",
    "TesseraError",
    "TesseraWarning",
    "Validation",
    "inspect",
    "launch",
    "load",
    "place",
    "plan",
    "validate",
]

Model = str | os.PathLike[str] | onnx.ModelProto | Graph
Shapes = Mapping[str, Sequence[int]] | None


def load(model: Model, *, input_shapes: Shapes = None, rewrites: Sequence[str] = ()) -> Graph:
    """``model`` (a path, an ``onnx.ModelProto`` or a loaded graph) as every command loads it:
    checked, shapes inferred (``input_shapes`` binds symbolic dimensions), ``rewrites`` applied."""
    if isinstance(model, Graph):
        return model
    return load_model(model, input_shapes, rewrites)


def inspect(model: Model, *, input_shapes: Shapes = None) -> Inspection:
    """What ``model`` is made of (``tessera inspect``): operators, parameters, FLOPs, branches, and
    the decoder ``plan --kind cp`` would see."""
    graph = load(model, input_shapes=input_shapes)
    return Inspection(graph, inspect_report(graph))


def place(  # noqa: PLR0913
    model: Model,
    *,
    input_shapes: Shapes = None,
    device: str = "cpu",
    backends: Sequence[str] | None = None,
    search: str = "op",
    budget_s: float = 60.0,
    cache: str | os.PathLike[str] | None = None,
    seed: int = 0,
    max_states: int = 128,
    tvm_trials: int = 0,
    tolerance: float | None = None,
    data: str | None = None,
    timeout_s: float = 120.0,
    verify: bool = False,
) -> Placement:
    """Which backend runs which part of ``model`` on this machine (``tessera place``), measured.
    ``verify``: run the placed model against onnxruntime (its verdict in ``verified``)."""
    import time

    from tessera.backends.measure import Measurer
    from tessera.backends.native_output import summary as native_summary
    from tessera.backends.profile_cache import ProfileCache
    from tessera.executor.placement import verify_placement
    from tessera.planners.placement import PlacementOptions, plan_placement

    graph = load(model, input_shapes=input_shapes)
    options = PlacementOptions(
        device=device, backends=tuple(backends) if backends is not None else None, search=search,
        budget_s=budget_s, seed=seed, max_states=max_states, tolerance=tolerance, data=data,
        tvm_trials=tvm_trials, run_timeout_s=timeout_s,
    )  # fmt: skip
    store = ProfileCache(None if cache is None else os.fspath(cache))
    store.check()  # a path that cannot hold the cache fails now, before any measuring
    start = time.perf_counter()
    measurer = Measurer(store, seed=seed)
    result = plan_placement(graph, options, measurer=measurer)
    search_s = time.perf_counter() - start
    verified = verify_placement(graph, result.plan, seed, data) if verify else None
    for line in (*measurer.failures(), *native_summary()):  # one per backend, not one per build
        warnings.warn(line, TesseraWarning, stacklevel=2)
    return Placement(result.plan, search_s, result.report, verified)


def plan(  # noqa: PLR0913
    model: Model | None = None,
    *,
    cluster: str | ClusterSpec,
    kind: str = "gpp",
    input_shapes: Shapes = None,
    mini_batch: int | None = None,
    devices: int | None = None,
    schedule: str = "1f1b",
    k: int = 2,
    memory_limit: int | float | str | None = None,
    recompute: str = "never",
    zero: int | str = 0,
    tensor_parallel: int | str = 1,
    stages: int | None = None,
    bytes_per_param: float | None = None,
    optimizer: str = "sgd",
    loss: str = "mse",
    max_grad_norm: float | None = None,
    rewrites: Sequence[str] = (),
    baseline: bool = True,
    profile: bool = False,
    cache: str | os.PathLike[str] | None = None,
    llm: str | None = None,
    batch: int | None = None,
    context: int | None = None,
    output_len: str = "uniform:1-1024",
    layers: int | None = None,
    dtype: str | None = None,
    strategy: str = "auto",
    degree: int | None = None,
    compile: bool = False,  # noqa: A002 - the command's flag
) -> GppPlan | CpPlan:
    """A plan for ``cluster`` (a preset name, a spec file or a :class:`ClusterSpec`), as ``tessera
    plan`` makes it. ``kind`` ``gpp`` or ``spp``: a training pipeline of ``model`` at ``mini_batch``
    samples; ``cp``: decoding ``batch`` requests of ``context`` tokens (``output_len``: a number, or a
    distribution as ``plan --output-len`` takes it) with the decoder ``model`` or the LLM config
    ``llm``; ``compile``: its decode step predicted as ``launch(compile=True)`` runs it; ``profile``:
    the training stages, or the decode step, measured on this machine (cached in ``cache``).
    InfeasibleError when nothing fits, InputError on bad input."""
    spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)
    if kind == "cp":
        if batch is None or context is None:
            raise InputError("a decoding plan (kind cp) needs batch and context")
        graph = None if model is None else load(model, input_shapes=input_shapes)
        planned = plan_decoding(
            spec, graph=graph, llm=llm, batch=batch, context=context, output_len=output_len,
            layers=layers, dtype=dtype, strategy=strategy, degree=degree, compile=compile, profile=profile,
            cache=cache,
        )  # fmt: skip
        for line in planned.warnings:
            warnings.warn(line, TesseraWarning, stacklevel=2)
        assert planned.plan is not None
        return planned.plan
    if kind not in ("gpp", "spp"):
        raise InputError(f"kind {kind!r}: expected gpp, spp or cp")
    if model is None or mini_batch is None:
        raise InputError(f"a {kind} plan needs a model and mini_batch")
    rewrite_auto = "auto" in rewrites
    graph = load(model, input_shapes=input_shapes, rewrites=() if rewrite_auto else rewrites)
    choice = plan_pipeline(
        graph, spec, kind=kind, mini_batch=mini_batch, devices=devices, schedule=schedule,
        memory_limit=memory_limit, k=k, recompute=recompute, zero=zero, tensor_parallel=tensor_parallel,
        stages=stages, bytes_per_param=bytes_per_param, optimizer=optimizer, loss=loss,
        max_grad_norm=max_grad_norm, baseline=baseline, rewrite_auto=rewrite_auto, profile=profile, cache=cache,
    )  # fmt: skip
    return choice.plan[0]


def validate(plan: str | os.PathLike[str], *, model: str | None = None) -> Validation:
    """The plan file ``plan`` checked against its schema and the model (or LLM config) it names:
    sha256, node names, coverage and the planner's constraints (``tessera validate``). InputError
    (exit 2) naming every problem otherwise."""
    path = os.fspath(plan)
    loaded = load_plan(path, command="validate")
    if loaded.model is None:  # a cp plan made from an LLM config (--llm), not from an ONNX model
        check_plan_llm_config(loaded, path, must_exist=True)
        return Validation(loaded, path, llm_config=loaded.llm_config.path)
    graph = load_plan_model(loaded, path, model)
    shared = [w.model_dump() for w in getattr(loaded, "shared_weights", [])]
    return Validation(loaded, path, model=graph.source, sha256=graph.sha256, shared_weights=shared)


def launch(  # noqa: PLR0913
    plan: str | os.PathLike[str] | Plan,
    *,
    model: str | None = None,
    steps: int = 5,
    lr: float = 0.01,
    seed: int = 0,
    data: str | None = None,
    compile: bool = False,  # noqa: A002 - the command's flag
    training: Mapping[str, Any] | None = None,
    save_model: str | None = None,
    trace: str | None = None,
    new_tokens: int = 8,
    prompt_lens: Sequence[int] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    attention: str = "torch",
    repeat: int = 7,
    timeout_s: float = 60.0,
) -> RunReport:
    """Run ``plan`` (a plan file or a plan object) on torch.distributed workers on this machine and
    report measured against predicted (``tessera launch``). ``training``: the optimizer, schedule,
    loss and checkpoint options as ``launch``'s flags name them (``optimizer``, ``weight_decay``,
    ``lr_schedule``, ``max_grad_norm``, ``loss``, ``precision``, ``checkpoint``, ...). LaunchError (exit 4) when a
    worker fails; a report's ``failure`` is set when its outputs are wrong."""
    if isinstance(plan, str | os.PathLike):
        path = os.fspath(plan)
        loaded = load_plan(path)
    else:
        path, loaded = "<plan>", plan
    runner = RUNNERS.get(loaded.kind)
    if runner is None:
        raise InputError(f"launching a {loaded.kind!r} plan is not available", source=path)
    graph = plan_graph(loaded, path, model)
    options = {"loss": default_loss(data), **(training or {})}
    request = LaunchRequest(
        plan_path=path, graph=graph, launch=LaunchOptions(timeout_s=timeout_s), seed=seed, data=data,
        steps=steps, lr=lr, training=options, compile=compile, save_model=save_model, trace=trace,
        new_tokens=new_tokens, prompt_lens=tuple(prompt_lens) if prompt_lens else None,
        prompts=tuple(tuple(p) for p in prompts) if prompts else None, attention=attention, repeat=repeat,
    )  # fmt: skip
    return runner(loaded, request)
