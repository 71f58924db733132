"""An ONNX (sub-)model as a ``torch.fx.GraphModule``: the program the torch executor runs.

One call per step of :func:`~tessera.backends.torch_fusion.steps_of` (ONNX nodes, exporter patterns
fused), Constant nodes held as the program's buffers; the graph inputs, then the initializers, are
its arguments, so the module that owns the parameters (``OnnxModule``) keeps them. ``print(program.code)``
shows it. ``torch.compile`` of it is :func:`compiled`. Details: docs/executor.md.
"""

from __future__ import annotations

import keyword
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import onnx
import torch
from torch import Tensor, fx, nn

from tessera.backends.precision import in_precision
from tessera.backends.torch_fusion import Step, constant_tensor, steps_of


def build_program(
    model: onnx.ModelProto,
    inputs: Sequence[str],
    initializers: Sequence[str],
    label: str,
    precision: str = "fp32",
) -> fx.GraphModule:
    """The program computing ``model``'s outputs from ``inputs`` then ``initializers`` (by name),
    its products in ``precision`` (:mod:`tessera.backends.precision`)."""
    steps, constants = steps_of(model)
    root = nn.Module()
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    used = {"self", *keyword.kwlist}  # the generated forward's own names
    for name in (*inputs, *initializers):
        env[name] = graph.placeholder(identifier(name, used))
    for s in steps:
        if s.op_type == "Constant" and s.outputs[0] in constants:
            attr = f"k{len(root._buffers)}"
            root.register_buffer(attr, constant_tensor(constants[s.outputs[0]]))
            env[s.outputs[0]] = graph.get_attr(attr)
            continue
        args = tuple(env[t] if t else None for t in s.inputs)
        named = [k for k, t in enumerate(s.outputs) if t]
        if named == [0]:
            env[s.outputs[0]] = graph.call_function(_call(s, label, 0, precision), args)
            continue
        call = graph.call_function(_call(s, label, named[-1] + 1 if named else 0, precision), args)
        for k in named:
            env[s.outputs[k]] = graph.call_function(operator.getitem, (call, k))
    graph.output(tuple(env[vi.name] for vi in model.graph.output))
    graph.eliminate_dead_code()
    return fx.GraphModule(root, graph, class_name="OnnxProgram")


# Steps TorchDynamo fails on (ConstantOfShape: its value is a numpy attribute); they run eagerly
# inside the compiled program. Marked here, at compile time: torch.compiler.disable imports
# TorchDynamo (1.1 s), which every process running a program would pay at import otherwise.
_EAGER = frozenset({"onnx_ConstantOfShape"})


def compiled(program: fx.GraphModule) -> Callable[..., Any]:
    """``torch.compile`` of the program (dynamic shapes: micro-batch sizes vary)."""
    for node in program.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", None) in _EAGER:
            node.target = torch.compiler.disable(node.target)
    program.recompile()
    return torch.compile(program, dynamic=True)


def _call(step: Step, label: str, outputs: int, precision: str) -> Callable[..., Any]:
    """The step as a function of its inputs: one tensor back, or a tuple of ``outputs`` (> 1)."""
    fn, attrs, node = in_precision(step.op_type, step.fn, precision), step.attrs, step.nodes[0]

    def call(*args: Tensor | None) -> Any:
        try:
            result = fn(args, attrs)
        except Exception as exc:  # name the node: an error in the program is useless without it
            raise RuntimeError(f"{label}: node {node!r}: {type(exc).__name__}: {exc}") from exc
        if not outputs:
            return result[0] if isinstance(result, tuple) else result
        results = result if isinstance(result, tuple) else (result,)
        if len(results) < outputs:
            raise RuntimeError(f"{label}: node {node!r}: the executor does not produce output {len(results)}")
        return results

    call.__name__ = call.__qualname__ = f"onnx_{step.op_type}"
    call.__module__ = __name__
    return call


def identifier(name: str, used: set[str]) -> str:
    """``name`` as a Python identifier not in ``used`` (and added to it): ``layer0/attn/q`` →
    ``layer0_attn_q``, then ``layer0_attn_q_1`` for another name that reads the same."""
    key = re.sub(r"\W", "_", name) or "_"
    if key[0].isdigit():
        key = f"_{key}"
    base, i = key, 1
    while key in used:
        key, i = f"{base}_{i}", i + 1
    used.add(key)
    return key
