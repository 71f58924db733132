"""What an attention core's Softmax normalizes, seen through what changes no key's probability: a
shift of the scores by their maximum, and a per-head sink column joined after the keys."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import onnx
from onnx import numpy_helper

from tessera.core.graph import Graph

__all__ = ["LseSink", "SoftmaxInput", "constant_value", "lse_sink", "softmax_scores"]


class SoftmaxInput(NamedTuple):
    """What a Softmax normalizes: ``scores`` (the key columns), the nodes between them and the
    Softmax that change no probability of a key (a shift by the maximum, the sink's column joined),
    and the tensor of a sink column joined after the keys (None: no sink)."""

    scores: str
    between: frozenset[str]
    sink: str | None


def softmax_scores(graph: Graph, softmax: str) -> SoftmaxInput:
    """The scores a Softmax normalizes, seen through a shift by their own maximum over the last
    axis (``s - max(s)``: numerically careful attention writes it; it changes no probability) and
    through one more column joined after the keys (``concat([s, sink])``: a per-head attention sink,
    GPT-OSS's, which the Softmax's readers drop after it)."""
    tensor, between, sink = graph.op(softmax).inputs[0], set(), None
    sub = graph.producer.get(tensor)
    if sub is not None and graph.op(sub).op_type == "Sub":
        scores, peak = graph.op(sub).inputs[:2]
        reduce = graph.producer.get(peak)
        if reduce is not None and _max_over_last(graph, graph.op(reduce), scores):
            tensor, between = scores, {sub, reduce}
    concat = graph.producer.get(tensor)
    op = None if concat is None else graph.op(concat)
    if op is not None and op.op_type == "Concat" and len(op.inputs) == 2 and _last_axis(graph, tensor, op):
        between.add(op.name)
        tensor, sink = op.inputs
    return SoftmaxInput(tensor, frozenset(between), sink)


class LseSink(NamedTuple):
    """An attention sink applied after the attention, ``o·sigmoid(logsumexp(s) − sink)`` (Granite's
    sliding-window variant): the sink logits' tensor, and the ``Mul`` that scales ``o`` with which
    of its inputs is ``o``."""

    sink: str
    mul: str
    kept: int


def lse_sink(graph: Graph, lse: Any, output: str) -> LseSink | None:
    """The sink ``lse`` (a ReduceLogSumExp of the scores over their last axis) feeds, when all it
    feeds is ``Sigmoid(lse − sink)`` (through casts and reshapes) multiplying ``output``, the
    attention's (through casts); None otherwise."""
    if lse.op_type != "ReduceLogSumExp" or not _over_last(graph, lse, lse.inputs[0]):
        return None
    sub = _only_reader(graph, lse.outputs[0])
    if sub is None or sub.op_type != "Sub" or sub.inputs[0] != lse.outputs[0]:
        return None
    sigmoid = _through(graph, sub.outputs[0], ("Cast",))
    if sigmoid is None or sigmoid.op_type != "Sigmoid":
        return None
    mul = _through(graph, sigmoid.outputs[0], ("Cast", "Unsqueeze", "Reshape"))
    if mul is None or mul.op_type != "Mul":
        return None
    for kept, factor in enumerate(mul.inputs[:2]):
        source = factor
        while (made := graph.producer.get(source)) is not None and graph.op(made).op_type in (
            "Cast",
            "Identity",
        ):
            source = graph.op(made).inputs[0]
        if source == output:
            return LseSink(sub.inputs[1], mul.name, kept)
    return None


def _only_reader(graph: Graph, tensor: str) -> Any:
    readers = graph.consumers.get(tensor, ())
    return graph.op(readers[0]) if len(readers) == 1 else None


def _through(graph: Graph, tensor: str, passing: tuple[str, ...]) -> Any:
    """The first single reader of ``tensor`` that is not one of ``passing``, following those."""
    for _ in range(6):
        op = _only_reader(graph, tensor)
        if op is None or op.op_type not in passing:
            return op
        tensor = op.outputs[0]
    return None


def _last_axis(graph: Graph, tensor: str, op: Any) -> bool:
    axis = int(op.attributes.get("axis", 0))
    info = graph.tensors.get(tensor)
    return axis == -1 or (info is not None and info.shape is not None and axis == len(info.shape) - 1)


def _max_over_last(graph: Graph, op: Any, scores: str) -> bool:
    """Whether ``op`` is a ReduceMax of ``scores`` over their last axis, keeping it."""
    if op.op_type != "ReduceMax" or op.inputs[0] != scores or not op.attributes.get("keepdims", 1):
        return False
    return _over_last(graph, op, scores)


def _over_last(graph: Graph, op: Any, scores: str) -> bool:
    """Whether the reduction ``op`` runs over the last axis of ``scores`` alone."""
    axes = op.attributes.get("axes")
    if axes is None and len(op.inputs) > 1 and op.inputs[1]:
        found = constant_value(graph, op.inputs[1])
        axes = None if found is None else [int(a) for a in np.asarray(found).reshape(-1)]
    info = graph.tensors.get(scores)
    rank = None if info is None or info.shape is None else len(info.shape)
    return axes is not None and len(axes) == 1 and axes[0] in (-1, None if rank is None else rank - 1)


def constant_value(graph: Graph, tensor: str) -> np.ndarray | None:
    """The value of an initializer or a ``Constant`` node's output; None when not constant, or kept
    outside the model (lazy or external data: not read here)."""
    if tensor in graph.initializer_protos:
        proto = graph.initializer_protos[tensor]
        return None if proto.data_location == onnx.TensorProto.EXTERNAL else _to_array(proto)
    node = graph.producer.get(tensor)
    if node is None or graph.op(node).op_type != "Constant":
        return None
    return _to_array(graph.op(node).attributes.get("value"))


def _to_array(value: object) -> np.ndarray | None:
    if value is None or isinstance(value, np.ndarray):
        return value
    if isinstance(value, list | int | float | bool):  # a Constant's value as the graph keeps it
        return np.asarray(value)
    try:
        return numpy_helper.to_array(value)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - not a tensor we can read
        return None
