"""Graphs a tracer unrolled for its example's values: they compute the model only for inputs like it.

The legacy exporter runs Python control flow once, on the example. A loop over "the experts some
token was routed to" (eager mixture-of-experts code) becomes a ``Split`` of a ``NonZero`` result into
the sizes the example produced: another input routes differently and the graph fails, or computes
without the experts the example did not reach. tessera refuses such a graph rather than run it.
"""

from __future__ import annotations

from tessera.core.graph import Graph

__all__ = ["traced_values_message"]

# Operators whose output size depends on the values of their input, not only its shape.
_VALUE_SIZED = frozenset({"NonZero", "Unique", "Compress"})
_DEPTH = 8  # producers walked back from a Split's input


def traced_values_message(graph: Graph) -> str | None:
    """Why ``graph`` holds only for its export example (a Split into constant sizes of a dimension
    sized by a ``NonZero``), naming the node and the fix; None when nothing is baked in."""
    for name in graph.order:
        op = graph.op(name)
        if op.op_type != "Split" or not _constant_sizes(graph, name):
            continue
        axis = int(op.attributes.get("axis", 0))
        info = graph.tensors.get(op.inputs[0])
        if info is not None and info.shape is not None and -len(info.shape) <= axis < len(info.shape):
            continue  # the split dimension is known: its sizes are the model's
        source = _value_sized_ancestor(graph, op.inputs[0])
        if source is not None:
            return (
                f"Split {name!r} cuts a dimension sized by the input's values ({graph.op(source).op_type} "
                f"{source!r}) into sizes fixed at export: the exporter unrolled a loop for its example "
                "(an eager mixture of experts does this), and inputs routed otherwise fail or lose rows; "
                "export with torch.onnx.export(..., dynamo=True) (transformers: "
                "config._experts_implementation = 'batched_mm')"
            )
    return None


def _constant_sizes(graph: Graph, name: str) -> bool:
    op = graph.op(name)
    if "split" in op.attributes:
        return True
    if len(op.inputs) < 2 or not op.inputs[1]:
        return False
    sizes = op.inputs[1]
    if sizes in graph.initializer_protos:
        return True
    producer = graph.producer.get(sizes)
    return producer is not None and graph.op(producer).op_type == "Constant"


def _value_sized_ancestor(graph: Graph, tensor: str) -> str | None:
    """The nearest value-sized operator behind ``tensor`` (within :data:`_DEPTH` producers)."""
    frontier, seen = [tensor], set()
    for _ in range(_DEPTH):
        nodes = [graph.producer[t] for t in frontier if t in graph.producer and graph.producer[t] not in seen]
        for node in nodes:
            if graph.op(node).op_type in _VALUE_SIZED:
                return node
        seen.update(nodes)
        frontier = [t for node in nodes for t in graph.op(node).inputs if t]
    return None
