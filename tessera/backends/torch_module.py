"""ONNX → trainable ``torch.nn.Module``: the interpreter of (sub-)models for training and profiling.

:class:`OnnxModule` holds the initializers (floating-point ones of rank ≥ 1 as ``nn.Parameter``s, except
BatchNormalization's statistics; the rest as buffers) and runs the nodes in topological order, one
function per operator from the table :data:`OPS` (as in ONNX's reference operators). BatchNormalization
follows inference semantics, so micro-batched training equals whole-batch training. Parameter names are
sanitized for torch and mapped back by :attr:`OnnxModule.onnx_names`. Opset ≥ 13 semantics.
Details: docs/backends.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import onnx
from onnx import numpy_helper
from torch import Tensor, nn

from tessera.backends.precision import in_precision
from tessera.backends.torch_ops import (
    EXTENSIONS,
    MAX_OPSET,
    MIN_OPSET,
    OPS,
    from_numpy,
    function_of,
    node_attributes,
    schema_version,
    schema_versions,
)
from tessera.backends.torch_program import build_program, identifier
from tessera.core.errors import InputError
from tessera.core.weights import is_lazy_tensor, lazy_values

# Replaces a node's outputs: hook(its inputs, its outputs) -> outputs (OnnxModule.run).
NodeHook = Callable[[Sequence["Tensor | None"], tuple[Tensor, ...]], Sequence[Tensor]]


class NodeStep(NamedTuple):
    """One node as the interpreter runs it: ``fn(inputs, attrs)`` (from :data:`OPS`)."""

    fn: Callable[..., Any]
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]
    name: str


# Node inputs (op_type, position) that are statistics, not weights: never trained.
FROZEN_INPUTS = {("BatchNormalization", 3), ("BatchNormalization", 4)}


def unsupported_operators(nodes: Iterable[tuple[str, str, str]]) -> dict[str, list[str]]:
    """Of the ``(name, op type, domain)`` nodes, those the executor has no function for (:data:`OPS`;
    other domains included): ``{op type: [node, …]}``, in op-type order."""
    found: dict[str, list[str]] = {}
    for name, op_type, domain in nodes:
        if domain not in ("", "ai.onnx") or (op_type not in OPS and op_type not in EXTENSIONS):
            found.setdefault(op_type, []).append(name)
    return dict(sorted(found.items()))


def check_supported(model: onnx.ModelProto, label: str) -> None:
    """InputError naming what of ``model`` this executor cannot run: operators it has no function
    for (custom domains included) and schema versions older than the ones it implements (opsets
    before MIN_OPSET: Softmax-11 flattened its input to 2-D), so a launcher can refuse a model before
    any worker starts. Versions after MAX_OPSET run on the newest function (docs/operators.md)."""
    g = model.graph
    missing = list(unsupported_operators((n.name, n.op_type, n.domain) for n in g.node))
    if missing:
        raise InputError(
            f"operator(s) {', '.join(missing)} not supported by the torch executor "
            "(tessera.backends.torch_module.OPS)",
            source=label,
        )
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), MAX_OPSET)
    old = sorted(
        {
            f"{n.op_type}-{v} (implemented: {', '.join(map(str, schema_versions(n.op_type)))})"
            for n in g.node
            if (v := schema_version(n.op_type, opset)) is not None and v < schema_versions(n.op_type)[0]
        }
    )
    if old:
        raise InputError(
            f"operator version(s) {'; '.join(old)} of opset {opset} not supported by the torch executor "
            f"(ONNX opset >= {MIN_OPSET} semantics; convert with onnx.version_converter)",
            source=label,
        )


class OnnxModule(nn.Module):
    """An ONNX model (or a sub-model from ``Graph.extract``) as a trainable torch module.

    ``forward(*inputs)`` takes the graph inputs in ONNX order (tensors; batch sizes are free: the
    declared shapes are not enforced) and returns the graph outputs as a tuple in ONNX order.
    :meth:`run` does the same by name.
    """

    def __init__(self, model: onnx.ModelProto, *, label: str = "<model>", precision: str = "fp32") -> None:
        super().__init__()
        g = model.graph
        self.label = label
        inits = {t.name for t in g.initializer}
        self.input_names: tuple[str, ...] = tuple(vi.name for vi in g.input if vi.name not in inits)
        self.output_names: tuple[str, ...] = tuple(vi.name for vi in g.output)
        check_supported(model, label)
        frozen = {n.input[i] for n in g.node for i in range(len(n.input)) if (n.op_type, i) in FROZEN_INPUTS}
        self.params = nn.ParameterDict()
        self.onnx_names: dict[str, str] = {}  # sanitized parameter or buffer name → initializer name
        self._init_keys: dict[str, tuple[str, str]] = {}  # initializer → ("param"|"buffer", key)
        used: set[str] = set()
        for t in g.initializer:
            # A paper-size zoo model's lazy parameters are generated here, as materialize would.
            array = lazy_values(t) if is_lazy_tensor(t) else numpy_helper.to_array(t)
            value = from_numpy(array)
            key = identifier(t.name, used)
            self.onnx_names[key] = t.name
            if value.is_floating_point() and value.dim() > 0 and t.name not in frozen:
                self.params[key] = nn.Parameter(value)
                self._init_keys[t.name] = ("param", key)
            else:
                self.register_buffer(f"c_{key}", value)
                self._init_keys[t.name] = ("buffer", f"c_{key}")
        self._nodes = [
            NodeStep(
                in_precision(n.op_type, function_of(n.op_type), precision),
                n.op_type,
                tuple(n.input),
                tuple(n.output),
                node_attributes(n),
                n.name or n.op_type,
            )
            for n in g.node
        ]
        self._types = [(n.name or n.op_type, n.op_type) for n in g.node]
        # forward's program (fused, generated code); run() interprets the nodes (hooks need them)
        self.program = build_program(model, self.input_names, tuple(self._init_keys), label, precision)

    def compile_program(self) -> None:
        """Run forward through ``torch.compile`` of the program (inductor, dynamic shapes). Slower
        than the fx program on this CPU and not bit-identical to it (docs/executor.md)."""
        from tessera.backends.torch_program import compiled

        self.program = compiled(self.program)

    def node_types(self) -> dict[str, str]:
        """``{node name: op type}`` in execution order (the names :meth:`run`'s hooks take)."""
        return dict(self._types)

    def steps(self) -> list[NodeStep]:
        """The nodes as the interpreter runs them, in topological order."""
        return list(self._nodes)

    def initializers(self) -> dict[str, Tensor]:
        """``{initializer name: tensor}`` (parameters and buffers, as the graph reads them)."""
        return dict(zip(self._init_keys, self._initializer_values(), strict=True))

    def onnx_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(initializer name, parameter) for every trainable initializer, in model order."""
        for name, (kind, key) in self._init_keys.items():
            if kind == "param":
                yield name, self.params[key]

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if len(inputs) != len(self.input_names):
            raise TypeError(f"{self.label}: expected {len(self.input_names)} inputs, got {len(inputs)}")
        return self.program(*inputs, *self._initializer_values())

    def _initializer_values(self) -> list[Tensor]:
        return [
            self.params[key] if kind == "param" else getattr(self, key)
            for kind, key in self._init_keys.values()
        ]

    def run(
        self,
        feeds: Mapping[str, Tensor],
        *,
        after: Mapping[str, NodeHook] | None = None,
        only: frozenset[str] | None = None,
        interpret: bool = False,
        tensors: Iterable[str] | None = None,
    ) -> dict[str, Tensor]:
        """Forward by name: ``{input: tensor}`` → ``{output: tensor}``, through the program unless
        ``interpret`` or either of these asks for the nodes one by one: ``after`` maps node names to
        hooks ``hook(inputs, outputs) -> outputs`` that replace what the node computed (the decoder
        swaps an attention core's output for attention over its KV cache this way); ``only`` runs
        just those nodes (the others must not be needed; a hooked node whose inputs were skipped is
        not run: its hook gets None for them and no outputs). ``tensors``: return these tensors
        (any the graph computes, interpreted) instead of the outputs."""
        if not (after or only is not None or interpret or tensors is not None):
            return dict(zip(self.output_names, self(*(feeds[n] for n in self.input_names)), strict=True))
        env = self._interpret({n: feeds[n] for n in self.input_names}, after or {}, only)
        return {t: env[t] for t in (self.output_names if tensors is None else tensors)}

    def _interpret(
        self, env: dict[str, Tensor], after: Mapping[str, NodeHook], only: frozenset[str] | None = None
    ) -> dict[str, Tensor]:
        env.update(zip(self._init_keys, self._initializer_values(), strict=True))
        for fn, _, ins, outs, attrs, node in self._nodes:
            if only is not None and node not in only:
                continue
            args = [env.get(t) if t else None for t in ins]
            if node in after and any(t and t not in env for t in ins):  # inputs skipped by ``only``
                env.update(zip(outs, after[node](args, ()), strict=False))
                continue
            try:
                result = fn(args, attrs)
            except Exception as exc:  # name the node: an interpreter error is useless without it
                raise RuntimeError(f"{self.label}: node {node!r}: {type(exc).__name__}: {exc}") from exc
            results = result if isinstance(result, tuple) else (result,)
            if node in after:
                results = tuple(after[node](args, results))
            if any(outs[len(results) :]):
                raise RuntimeError(
                    f"{self.label}: node {node!r}: the executor does not produce {outs[len(results) :]}"
                )
            for t, value in zip(outs, results, strict=False):
                if t:
                    env[t] = value
        return env


def to_torch(model: onnx.ModelProto, *, label: str = "<model>", precision: str = "fp32") -> OnnxModule:
    """Convert ``model`` (whole or extracted) into an :class:`OnnxModule` whose products compute in
    ``precision`` (``fp32``: as the model says; ``bf16``: :mod:`tessera.backends.precision`)."""
    return OnnxModule(model, label=label, precision=precision)
