"""A decoding graph's own KV cache bound empty: the graph becomes its model's whole-sequence forward pass.

Exports made for onnxruntime's decoding loops (onnxruntime-genai's model builder, optimum,
``GroupQueryAttention``) take the cache as inputs (``past_key_values.N.key``, ``past_key``, … with a
past-length axis) and return it (``present.N.key``, …). tessera keeps its own cache, so each such
input becomes a tensor of past length 0 (its other axes from the token input's shape or its declared
size), a Concat onto it loses it, a fused attention reads no past, and the present outputs go."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

# The inputs of onnxruntime's fused attention operators that carry a past (blanked when bound empty).
PAST_INPUTS = {"GroupQueryAttention": (3, 4), "MultiHeadAttention": (6, 7), "Attention": (4,)}


def input_role(name: str) -> str:
    """What a decoder's graph input carries, told by its name as transformers exports it:
    ``mask`` (attention_mask), ``positions`` (position_ids) or ``tokens``."""
    lowered = name.lower()
    return "mask" if "mask" in lowered else "positions" if "position" in lowered else "tokens"


def _cache_name(name: str) -> bool:
    lowered = name.lower()
    return "past" in lowered or "cache" in lowered or "present" in lowered


def declared_dims(value: onnx.ValueInfoProto) -> tuple[int | str | None, ...] | None:
    """A value's shape as the model declares it: a number, a symbol's name, or None per axis; None
    for no declared shape."""
    tensor = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not tensor.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)


def _token_input(graph: onnx.GraphProto) -> onnx.ValueInfoProto | None:
    """The token ids: an integer input of rank 2 named neither a mask nor positions."""
    ints = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
    return next(
        (
            i
            for i in graph.input
            if i.type.tensor_type.elem_type in ints
            and len(declared_dims(i) or ()) == 2
            and input_role(i.name) == "tokens"
        ),
        None,
    )


def _past_axis(dims: Sequence[int | str | None], token_dims: Sequence[int | str | None]) -> int | None:
    """The one axis of a cache input that is neither a number nor one of the token input's axes."""
    free = [i for i, d in enumerate(dims) if not isinstance(d, int) and (d is None or d not in token_dims)]
    return free[0] if len(free) == 1 else None


def cache_inputs(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """``{input: (its past-length axis, its rank)}`` for each floating-point graph input of rank 3 to 5 named as a
    cache (past / cache) whose one free axis is its past length; empty when there is no token input."""
    graph = model.graph
    tokens = _token_input(graph)
    if tokens is None:
        return {}
    token_dims = declared_dims(tokens) or ()
    weights = {t.name for t in graph.initializer}
    found = {}
    for value in graph.input:
        dims = declared_dims(value)
        floating = value.type.tensor_type.elem_type in _FLOATS
        if value.name in weights or dims is None or not floating or not 3 <= len(dims) <= 5:
            continue
        if _cache_name(value.name) and (axis := _past_axis(dims, token_dims)) is not None:
            found[value.name] = (axis, len(dims))
    return found


_FLOATS = {
    onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE,
}  # fmt: skip


def bind_empty_cache(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its cache inputs (:func:`cache_inputs`) bound to past length 0 and its cache
    outputs (named present / past / cache) dropped; the same object, unchanged, when it has none."""
    found = cache_inputs(model)
    if not found:
        return model
    graph = model.graph
    tokens = _token_input(graph)
    assert tokens is not None  # cache_inputs found one
    token_dims = declared_dims(tokens) or ()
    empties = [
        node
        for value in graph.input
        if value.name in found
        for node in _empty(value, found[value.name][0], tokens.name, token_dims)
    ]
    for node in graph.node:
        _drop_past(node, found)
    nodes = [*empties, *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    kept_inputs = [i for i in graph.input if i.name not in found]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    outputs = [o for i, o in enumerate(graph.output) if i == 0 or not _cache_name(o.name)]
    del graph.output[:]
    graph.output.extend(outputs)
    return model


def _empty(
    value: onnx.ValueInfoProto, axis: int, tokens: str, token_dims: Sequence[int | str | None]
) -> list[onnx.NodeProto]:
    """Nodes computing ``value`` as zeros of its shape with ``axis`` of length 0: the token input's
    axes where it shares their names, declared sizes elsewhere."""
    name = value.name
    dims = declared_dims(value) or ()
    parts: list[onnx.NodeProto] = []
    pieces = []
    for i, d in enumerate(dims):
        piece = f"{name}/dim{i}"
        if i == axis:
            parts.append(_constant(piece, [0]))
        elif isinstance(d, int):
            parts.append(_constant(piece, [d]))
        else:
            shape = f"{name}/token_shape{i}"
            parts.append(helper.make_node("Shape", [tokens], [shape], name=shape))
            parts.append(helper.make_node("Gather", [shape, f"{piece}/at"], [piece], name=piece, axis=0))
            parts.append(_constant(f"{piece}/at", [token_dims.index(d)]))
        pieces.append(piece)
    shape = f"{name}/shape"
    parts.append(helper.make_node("Concat", pieces, [shape], name=shape, axis=0))
    dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
    zero = numpy_helper.from_array(np.zeros(1, dtype), "value")
    parts.append(helper.make_node("ConstantOfShape", [shape], [name], name=f"{name}/empty", value=zero))
    # Constants first: a node's inputs come before it.
    return sorted(parts, key=lambda n: n.op_type != "Constant")


def _constant(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], name=name, value=numpy_helper.from_array(np.array(values, np.int64))
    )


def _drop_past(node: onnx.NodeProto, found: dict[str, tuple[int, int]]) -> None:
    """A Concat along a cache input's past axis without it; a fused attention without its past."""
    if node.op_type == "Concat":
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        kept = [t for t in node.input if t not in found or axis % found[t][1] != found[t][0]]
        if kept and len(kept) < len(node.input):
            del node.input[:]
            node.input.extend(kept)
    elif node.domain == "com.microsoft" and node.op_type in PAST_INPUTS:
        for i in PAST_INPUTS[node.op_type]:
            if i < len(node.input) and node.input[i] in found:
                node.input[i] = ""
