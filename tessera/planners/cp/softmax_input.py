"""What an attention core's Softmax normalizes, seen through what changes no key's probability: a
shift of the scores by their maximum, and a per-head sink column joined after the keys."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import onnx
from onnx import numpy_helper

from tessera.core.graph import Graph

__all__ = ["SoftmaxInput", "constant_value", "softmax_scores"]


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


def _last_axis(graph: Graph, tensor: str, op: Any) -> bool:
    axis = int(op.attributes.get("axis", 0))
    info = graph.tensors.get(tensor)
    return axis == -1 or (info is not None and info.shape is not None and axis == len(info.shape) - 1)


def _max_over_last(graph: Graph, op: Any, scores: str) -> bool:
    """Whether ``op`` is a ReduceMax of ``scores`` over their last axis, keeping it."""
    if op.op_type != "ReduceMax" or op.inputs[0] != scores or not op.attributes.get("keepdims", 1):
        return False
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
