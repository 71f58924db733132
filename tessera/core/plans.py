"""Plan schemas: the plan kinds (placement, gpp/spp, cp) as typed, versioned documents.

Every plan has ``schema_version``, ``kind``, ``tool_version``, ``model``, ``cluster``, ``predicted`` and
the kind's own body (the contract: docs/architecture.md). :func:`dump_plan` writes the same bytes for the
same plan; :func:`load_plan` reads and validates a plan file; :mod:`tessera.core.plan_checks` checks it
against the model it names and runs the checks that planners and backends register in ``PLAN_CHECKS``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from tessera import __version__
from tessera.core.errors import InputError
from tessera.core.files import write_output
from tessera.core.plan_files import json_text, read_plan_json
from tessera.core.rewrite import unknown_rewrite
from tessera.core.schedule import ScheduleKind
from tessera.core.specs import MAX_DEVICES

SCHEMA_VERSION = 1
# What a cp plan may say: what `plan --kind cp` accepts (its options and LLM configs use these), so
# validate passes nothing launch cannot build in bounded time. Dtypes: planners.cp.llm.DTYPE_BYTES;
# token counts 1..1024M; sizes beyond any published model; a degree at most specs.MAX_DEVICES.
LLM_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8")
MAX_CONTEXT = 2**30
MAX_BATCH = 2**16
LLM_SIZE_LIMITS: dict[str, int] = {
    "layers": 2**16,
    "hidden": 2**20,
    "heads": 2**16,
    "kv_heads": 2**16,
    "head_dim": 2**16,
    "ffn": 2**22,
    "vocab": 2**24,
    "experts": 2**12,
    "experts_per_token": 2**12,
}


class _Strict(BaseModel):
    # strict: a plan is written by tessera, so "64", 64.0 or true where an integer belongs is a
    # hand edit gone wrong, not something to coerce.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelRef(_Strict):
    """Which model a plan is for: the path given, the sha256 of the loaded (named) model."""

    path: str
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    num_nodes: NonNegativeInt
    input_shapes: dict[str, list[PositiveInt]] = Field(default_factory=dict)
    # Graph rewrites (tessera.core.rewrite) the plan was made on: validate and launch apply them to
    # the model file before they read the plan's node names.
    rewrites: list[str] = Field(default_factory=list)

    @field_validator("rewrites")
    @classmethod
    def _known_rewrites(cls, names: list[str]) -> list[str]:
        why = unknown_rewrite(names)
        if why is not None:
            raise ValueError(why)
        return names

    @classmethod
    def of(cls, graph: Any) -> ModelRef:
        """The reference a plan records for a loaded graph."""
        return cls(
            path=graph.source,
            sha256=graph.sha256,
            num_nodes=graph.num_nodes,
            input_shapes={k: list(v) for k, v in sorted(graph.input_shapes.items())},
            rewrites=list(graph.rewrites),
        )


class _PlanBase(_Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    tool_version: str = __version__
    model: ModelRef
    cluster: dict[str, Any] | None = None
    predicted: dict[str, Any] = Field(default_factory=dict)

    # The headline prediction of each kind, which launch reports measurements against.
    _HEADLINE: ClassVar[str] = ""

    @model_validator(mode="after")
    def _predictions_are_quantities(self) -> _PlanBase:
        """Every number under ``predicted`` is finite and not negative (times, rates, bytes, counts,
        fractions), and the kind's headline prediction, where the plan has one, is such a number."""
        headline = self.predicted.get(self._HEADLINE)
        if self._HEADLINE and headline is not None and not _is_number(headline):
            raise ValueError(f"predicted.{self._HEADLINE} must be a number, got {headline!r}")
        for where, value in _numbers(self.predicted, "predicted"):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{where} is {value}: predictions are finite and not negative")
        return self


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _numbers(value: Any, where: str) -> Iterator[tuple[str, float]]:
    """The numbers nested in a JSON value, with their paths."""
    if _is_number(value):
        yield where, float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{where}[{i}]")


# -- placement (tessera place) -----------------------------------------------------------------


class PlacementGroup(_Strict):
    id: NonNegativeInt
    backend: str
    nodes: list[str] = Field(min_length=1)
    pattern: str
    measured_time_s: NonNegativeFloat | None = None


class PlacementPlan(_PlanBase):
    kind: Literal["placement"] = "placement"
    device: str = "cpu"
    groups: list[PlacementGroup] = Field(min_length=1)
    # Groups that do not depend on each other run at the same time (the parallel branches' plan)
    concurrent: bool = False
    measured: dict[str, Any] = Field(default_factory=dict)
    search: dict[str, Any] = Field(default_factory=dict)  # how the placement was searched (settings, counts)

    _HEADLINE: ClassVar[str] = "latency_s"

    @model_validator(mode="after")
    def _group_ids(self) -> PlacementPlan:
        ids = [g.id for g in self.groups]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"group id {dup} is used twice")
        return self


# -- graph pipeline parallel training (tessera plan --kind gpp) --------------------------------


class StageSchedule(_Strict):
    kind: ScheduleKind
    k: PositiveInt = 1
    # Ordered passes in PyTorch's pipelining vocabulary: "F3" (forward of micro-batch 3), "B3".
    actions: list[Annotated[str, Field(pattern=r"^[FB](0|[1-9]\d{0,8})$")]]


class StageMemory(_Strict):
    weights: NonNegativeInt
    optimizer: NonNegativeInt
    activations: NonNegativeInt
    peak: NonNegativeInt


class Stage(_Strict):
    id: NonNegativeInt
    nodes: list[str] = Field(min_length=1)
    devices: list[str] = Field(min_length=1)
    micro_batch_size: PositiveInt
    schedule: StageSchedule
    in_flight: PositiveInt
    memory: StageMemory
    # Activation recomputation: the stage keeps only its inputs per micro-batch in flight and runs
    # its forward again in the backward (launch: torch.utils.checkpoint).
    recompute: bool = False
    # ZeRO-1: the stage's data-parallel replicas each keep 1/d of its weights' optimizer state,
    # reduce-scatter the gradients and all-gather the updated weights (launch: the same). Written
    # only when 1.
    zero: Literal[0, 1] = 0
    # Tensor parallelism: each replica is ``tensor_parallel`` devices of one node, its matrix
    # products split Megatron-style (tessera.core.tensor_parallel); ``devices`` lists them replica
    # by replica. Written only when above 1.
    tensor_parallel: PositiveInt = 1
    predicted: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _whole_replicas(self) -> Stage:
        if len(self.devices) % self.tensor_parallel:
            raise ValueError(
                f"stage {self.id}: {len(self.devices)} devices do not make replicas of "
                f"tensor_parallel {self.tensor_parallel}"
            )
        return self

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the devices over the tensor-parallel degree."""
        return len(self.devices) // self.tensor_parallel

    @model_serializer(mode="wrap")
    def _without_zero(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if not data.get("zero"):
            data.pop("zero", None)
        if data.get("tensor_parallel", 1) == 1:
            data.pop("tensor_parallel", None)
        return data


class EdgeTensor(_Strict):
    name: str
    bytes: NonNegativeInt


class StageEdge(_Strict):
    src: NonNegativeInt
    dst: NonNegativeInt
    tensors: list[EdgeTensor]
    bytes: NonNegativeInt


class TrainingSetup(_Strict):
    """What a pipeline plan's memory was counted for (thesis Eq. 3.2; :mod:`tessera.core.cost`):
    the precision (``mixed``: fp16 weights and activations; ``fp32``), the bytes each parameter
    costs with its gradient and optimizer state (Adam: 16), and the activation recomputation the
    planner was allowed (``never``, ``all`` stages, or ``auto``: stages chosen by the search; which
    stages recompute is each stage's ``recompute``)."""

    precision: Literal["mixed", "fp32"] = "mixed"
    bytes_per_param: Annotated[float, Field(gt=0, le=1024)] = 16.0  # plan --bytes-per-param's range
    recompute: Literal["never", "auto", "all"] = "never"
    # ZeRO-1 on no stage (0), every replicated stage (1), or where memory needs it ("auto"; which
    # stages shard is each stage's ``zero``).
    zero: Literal[0, 1, "auto"] = 0
    # The optimizer whose step a profiled plan's stages were timed with (plan --optimizer).
    optimizer: Literal["sgd", "adamw", "adam"] = "sgd"
    loss: Literal["mse", "ce"] = "mse"  # the loss they were timed with (plan --loss)
    # The global gradient norm the plan was timed clipping to (plan --max-grad-norm); None: none.
    max_grad_norm: Annotated[float, Field(gt=0)] | None = None

    @model_serializer(mode="wrap")
    def _without_defaults(self, handler: Any) -> dict[str, Any]:
        """``optimizer``, ``loss``, ``zero`` and ``max_grad_norm`` are written when they are not the
        defaults (SGD, squared error, 0, none): a plan made without those flags reads as before."""
        data = handler(self)
        for key, default in (("optimizer", "sgd"), ("loss", "mse"), ("zero", 0), ("max_grad_norm", None)):
            if data.get(key) == default:
                data.pop(key)
        return data


class SharedWeight(_Strict):
    """A weight read by operators of several stages (a tied embedding and LM head): each stage
    holds a copy, and launch sums the copies' gradients before every step."""

    name: str
    stages: list[NonNegativeInt] = Field(min_length=2)
    bytes: NonNegativeInt


class GppPlan(_PlanBase):
    kind: Literal["gpp", "spp"] = "gpp"
    mini_batch_size: PositiveInt
    stages: list[Stage] = Field(min_length=1)
    edges: list[StageEdge] = Field(default_factory=list)
    baseline: dict[str, Any] | None = None
    training: TrainingSetup = Field(default_factory=TrainingSetup)
    shared_weights: list[SharedWeight] = Field(default_factory=list)
    # The same plan in other engines' terms (plan --export): {"megatron": {expressible, args, why}}.
    exports: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_serializer(mode="wrap")
    def _without_empty_shared(self, handler: Any) -> dict[str, Any]:
        """``shared_weights`` and ``exports`` are written only when there are some: a plan of a
        model without tied weights, made without --export, reads as before."""
        data = handler(self)
        for optional in ("shared_weights", "exports"):
            if not data.get(optional):
                data.pop(optional, None)
        return data

    _HEADLINE: ClassVar[str] = "iteration_time_s"

    @model_validator(mode="before")
    @classmethod
    def _recompute_of_older_plans(cls, data: Any) -> Any:
        """Plans written before recomputation was chosen per stage have ``training.recompute`` a
        boolean (every stage or none) and no stage ``recompute``: read them as ``all`` / ``never``."""
        training = data.get("training") if isinstance(data, dict) else None
        if not isinstance(training, dict) or type(training.get("recompute")) is not bool:
            return data
        every = training["recompute"]
        stages = data.get("stages")
        if isinstance(stages, list):
            stages = [{"recompute": every, **st} if isinstance(st, dict) else st for st in stages]
        return {**data, "training": {**training, "recompute": "all" if every else "never"}, "stages": stages}

    @model_validator(mode="after")
    def _stage_graph_indexes(self) -> GppPlan:
        """Stage ids are 0..S−1 in order and edges join stages that exist (every consumer of a
        plan indexes stages by id), and every stage's micro-batches divide the mini-batch."""
        ids = [st.id for st in self.stages]
        if ids != list(range(len(ids))):
            raise ValueError(f"stage ids must be 0..{len(ids) - 1} in order, got {ids[:8]}")
        for e in self.edges:
            if e.src >= len(ids) or e.dst >= len(ids) or e.src == e.dst:
                raise ValueError(f"edge {e.src}->{e.dst} does not join two of the {len(ids)} stages")
        for st in self.stages:
            m, rest = divmod(self.mini_batch_size, st.micro_batch_size)
            if rest or len(st.schedule.actions) != 2 * m:
                raise ValueError(
                    f"stage {st.id}: {len(st.schedule.actions)} actions for mini-batch "
                    f"{self.mini_batch_size} in micro-batches of {st.micro_batch_size}"
                )
        return self


# -- cache-parallel decode (tessera plan --kind cp) --------------------------------------------


class KvShard(_Strict):
    device: str
    start: NonNegativeInt
    stop: NonNegativeInt


class LlmConfigRef(_Strict):
    """The LLM config a cp plan was made from when there is no ONNX model (``--llm``)."""

    kind: Literal["file", "preset"]
    path: str
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class CpPlan(_PlanBase):
    kind: Literal["cp"] = "cp"
    # A cp plan is made from an ONNX model (``model``) or from an LLM config (``llm_config``).
    model: ModelRef | None = None  # type: ignore[assignment]
    llm_config: LlmConfigRef | None = None
    strategy: Literal["cp", "tp", "dp", "cp+tp"]
    degree: PositiveInt
    llm: dict[str, Any]
    workload: dict[str, Any]
    kv_shards: list[KvShard] = Field(default_factory=list)
    collectives: list[dict[str, Any]] = Field(default_factory=list)
    alternatives: list[dict[str, Any]] = Field(default_factory=list)
    serving: dict[str, Any] = Field(default_factory=dict)  # {"vllm": ...}: planners/cp/serving.py

    _HEADLINE: ClassVar[str] = "tokens_per_s"

    @model_validator(mode="after")
    def _llm_and_workload_are_usable(self) -> CpPlan:
        """What the executor builds from, within what the planner accepts: the decoder's sizes
        (positive integers within :data:`LLM_SIZE_LIMITS`, kv_heads dividing heads), the degree,
        the batch, a context and output lengths within the planner's range, and the KV block."""
        for key, limit in LLM_SIZE_LIMITS.items():
            if key not in _EXPERT_SIZES:
                _bounded(f"llm.{key}", self.llm.get(key), limit)
        _check_experts(self.llm)
        if self.llm["heads"] % self.llm["kv_heads"]:
            raise ValueError(f"llm.kv_heads {self.llm['kv_heads']} must divide llm.heads {self.llm['heads']}")
        if self.llm.get("dtype") not in LLM_DTYPES:
            raise ValueError(
                f"llm.dtype must be one of {', '.join(LLM_DTYPES)}, got {_short(self.llm.get('dtype'))}"
            )
        _bounded("degree", self.degree, MAX_DEVICES, what="devices")
        _bounded("workload.batch", self.workload.get("batch"), MAX_BATCH, what="requests")
        context = self.workload.get("context")
        if type(context) is int and context > MAX_CONTEXT:
            raise ValueError(f"workload.context {context} is beyond the planner's {MAX_CONTEXT} tokens")
        _bounded("workload.context", context, MAX_CONTEXT, what="tokens")
        lengths = self.workload.get("output_len")
        if lengths is not None:  # what the plan was predicted for (launch decodes --new-tokens)
            if not isinstance(lengths, dict):
                raise ValueError(f"workload.output_len must be an object, got {_short(lengths)}")
            low = _bounded("workload.output_len.min", lengths.get("min"), MAX_CONTEXT, what="tokens")
            high = _bounded("workload.output_len.max", lengths.get("max"), MAX_CONTEXT, what="tokens")
            if low > high:
                raise ValueError(f"workload.output_len.min {low} is more than its max {high}")
            if context + high - 1 > MAX_CONTEXT:
                raise ValueError(
                    f"workload.context {context} plus output lengths up to {high} is "
                    f"{context + high - 1} positions; a request may hold at most {MAX_CONTEXT}"
                )
        cost = self.predicted.get("cost_model")
        if cost is not None and not isinstance(cost, dict):
            raise ValueError(f"predicted.cost_model must be an object, got {_short(cost)}")
        block = cost.get("kv_block", 1) if cost else 1  # absent: the default
        _bounded("predicted.cost_model.kv_block", block, MAX_CONTEXT, what="tokens")
        return self

    @model_validator(mode="after")
    def _has_a_source(self) -> CpPlan:
        if (self.model is None) == (self.llm_config is None):
            raise ValueError("a cp plan names exactly one of model (ONNX) and llm_config")
        return self

    @model_validator(mode="after")
    def _shards_fit_the_workload(self) -> CpPlan:
        """One distinct device per rank, and KV shards as the planner writes them: consecutive
        ranges that split the context for CP, the whole context on every device otherwise."""
        n = self.degree
        devices = self.workload.get("devices")
        if devices is not None and (
            not isinstance(devices, list) or len(devices) != n or len(set(map(str, devices))) != n
        ):
            raise ValueError(f"workload.devices must name {n} distinct devices (degree {n})")
        context = self.workload.get("context")
        if type(context) is not int or context < 1:
            raise ValueError(f"workload.context must be a positive integer, got {context!r}")
        if not self.kv_shards:
            return self
        if len(self.kv_shards) != n:
            raise ValueError(f"a plan of degree {n} has {len(self.kv_shards)} kv_shards")
        if devices is not None and [s.device for s in self.kv_shards] != devices:
            raise ValueError("kv_shards name other devices than workload.devices")
        spans = [(s.start, s.stop) for s in self.kv_shards]
        if self.strategy == "cp":
            ends = [0] + [b for _, b in spans]
            if [a for a, _ in spans] != ends[:-1] or ends[-1] != context or any(a > b for a, b in spans):
                raise ValueError(
                    f"cp kv_shards must split positions 0..{context} in consecutive ranges, got {spans}"
                )
        elif any(span != (0, context) for span in spans):
            raise ValueError(f"{self.strategy} kv_shards must each hold positions 0..{context}, got {spans}")
        return self


_EXPERT_SIZES = ("experts", "experts_per_token")
# The llm block of a dense decoder: what a plan written before mixtures of experts leaves out.
DENSE_FFN: dict[str, int] = {"experts": 1, "experts_per_token": 1, "shared_ffn": 0}


def _check_experts(llm: dict[str, Any]) -> None:
    """A mixture of experts' sizes, where given (a plan of a dense FFN may leave them out)."""
    for key in _EXPERT_SIZES:
        if key in llm:
            _bounded(f"llm.{key}", llm[key], LLM_SIZE_LIMITS[key])
    sizes = {**DENSE_FFN, **llm}
    if sizes["experts_per_token"] > sizes["experts"]:
        raise ValueError("llm.experts_per_token is more than llm.experts")
    if sizes["shared_ffn"] != 0:  # 0: no shared expert
        _bounded("llm.shared_ffn", llm["shared_ffn"], LLM_SIZE_LIMITS["ffn"])
    if llm.get("dense_layers", 0) != 0:  # layers with a dense FFN beside the experts' (0: none)
        _bounded("llm.dense_layers", llm["dense_layers"], llm["layers"] - 1)
        _bounded("llm.dense_ffn", llm.get("dense_ffn"), LLM_SIZE_LIMITS["ffn"])
        if sizes["experts"] == 1:
            raise ValueError("llm.dense_layers needs a mixture of experts (llm.experts > 1)")


def _bounded(where: str, value: Any, limit: int, *, what: str = "") -> int:
    """``value`` when it is an integer in ``1..limit``; else ValueError naming ``where``."""
    if type(value) is not int or value < 1:
        raise ValueError(f"{where} must be a positive integer, got {_short(value)}")
    if value > limit:
        unit = f" {what}" if what else ""
        raise ValueError(f"{where} {_short(value)} is more than {limit}{unit}, the most a cp plan may hold")
    return value


def _short(value: Any) -> str:
    """``repr(value)`` cut short: a number of thousands of digits must not flood the one-line error."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}... ({len(text)} characters)"


Plan = PlacementPlan | GppPlan | CpPlan
_KINDS: dict[str, type[_PlanBase]] = {
    "placement": PlacementPlan,
    "gpp": GppPlan,
    "spp": GppPlan,
    "cp": CpPlan,
}

# Planner-specific structural checks, by plan kind: each gets (plan, graph) and returns problems.
PLAN_CHECKS: dict[str, list[Callable[[Any, Any], list[str]]]] = {}


def dump_plan(plan: _PlanBase) -> str:
    """The plan as canonical JSON text (field order fixed by the schema; 2-space indent)."""
    return json_text(plan.model_dump(mode="json"))


def write_plan(plan: _PlanBase, path: str | os.PathLike[str]) -> Path:
    return write_output(path, dump_plan(plan))


def parse_plan(data: dict[str, Any], *, label: str) -> Plan:
    """Validate a decoded JSON document as a plan of its kind."""
    if not isinstance(data, dict):
        raise InputError("a plan must be a JSON object", source=label)
    version = data.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise InputError(
            f"schema_version {version!r} is not supported (this tessera reads version {SCHEMA_VERSION})",
            source=label,
        )
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in _KINDS:
        raise InputError(
            f"kind {kind!r} is not a plan kind (expected one of: placement, gpp, spp, cp)", source=label
        )
    try:
        return _KINDS[kind].model_validate(data)  # type: ignore[return-value]
    except ValidationError as exc:
        raise InputError(_first_error(exc), source=label) from None


def load_plan(path: str | os.PathLike[str], *, command: str | None = None) -> Plan:
    """Read and validate a plan file; InputError naming it for anything else. ``command`` (e.g.
    ``validate``) words the message for a file that is no plan at all (an ONNX model, a binary)."""
    return parse_plan(read_plan_json(path, command=command), label=str(path))


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "plan"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = str(first["msg"]).removeprefix("Value error, ")  # pydantic's prefix says nothing
    return f"field {where}: {message}{more}"
