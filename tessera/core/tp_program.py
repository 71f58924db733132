"""A tensor-parallel rank's copy of a stage as an ONNX model: its blocks of the split weights, the
shapes of its split tensors, and the collectives (``TpCopy``, ``TpReduce``, ``TpShard``:
``tessera.backends.torch_ops.collectives``) where whole and split tensors meet. The split itself
comes from :mod:`tessera.core.tensor_parallel`; the executor's ranks run it, and ``plan --profile``
measures it on its ranks. Narrative: docs/executor.md."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tessera.core.graph import Graph
from tessera.core.tensor_parallel import TpSplit, shard
from tessera.core.weights import is_lazy_tensor, lazy_values

__all__ = ["local_model"]

_NARROW = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16}  # widened by ``widen``


def local_model(
    graph: Graph, nodes: Iterable[str], split: TpSplit, index: int, *, group: str = "tp", widen: bool = False
) -> onnx.ModelProto:
    """The stage ``nodes`` of ``graph`` as rank ``index`` of ``split.t`` runs it (``split`` restricted
    to the stage). Shapes are read at run time, so any micro-batch runs. ``widen``: a row product of
    bf16 or fp16 computes its partial sums in fp32 (its weight block held so) and they are summed so,
    then rounded once, as one process's product is (a decode step's tokens stay the model's)."""
    model = graph.extract(list(nodes))
    if not split.regions:
        return model
    g = model.graph
    t = split.t
    weights = split.weights
    rows = {n for r in split.regions for n in r.rows}
    kinds = {n: _NARROW.get(graph.tensors[graph.op(n).outputs[0]].dtype) for n in rows if widen}
    narrow = {n: kind for n, kind in kinds.items() if kind is not None}
    wide = {graph.op(n).inputs[1] for n in narrow}
    inits = [
        _sharded(proto, weights.get(proto.name), t, index, proto.name in wide) for proto in g.initializer
    ]
    shapes = {n: s for r in split.regions for n, s in r.shapes.items()}
    constants = {n: s for r in split.regions for n, s in r.constants.items()}
    operands = {key: v for r in split.regions for key, v in r.operands.items()}
    out_nodes: list[onnx.NodeProto] = []
    copies: dict[str, str] = {}  # whole tensor → its copy
    for node in g.node:
        node = _copy_of(node)
        if node.name in constants:
            out_nodes.extend(_whole_shape(node, graph, constants[node.name], t))
            continue
        for k, name in enumerate(node.input):
            if (node.name, k) in operands:
                node.input[k] = _operand(
                    name, (node.name, k), operands[(node.name, k)], graph, copies, out_nodes, t, index, group
                )
        if node.name in shapes:  # the shape (Split: the sizes) the node is given, as the rank's
            local = f"{node.name}__tp_shape"
            out_nodes.append(
                helper.make_node("TpLocal", [node.input[1]], [local], name=local, axis=shapes[node.name], t=t)
            )
            node.input[1] = local
        out_nodes.extend(_row(node, group, narrow.get(node.name)) if node.name in rows else [node])
    del g.node[:]
    g.node.extend(out_nodes)
    del g.initializer[:]
    g.initializer.extend(inits)
    del g.value_info[:]  # the split tensors' shapes changed; the executor does not read them
    return model


def _sharded(
    proto: onnx.TensorProto, split: tuple[int, int] | None, t: int, index: int, wide: bool = False
) -> onnx.TensorProto:
    if split is None:
        return proto
    array = lazy_values(proto) if is_lazy_tensor(proto) else numpy_helper.to_array(proto)
    block = shard(array, *split[:1], t, index, split[1])
    return numpy_helper.from_array(
        np.ascontiguousarray(block.astype(np.float32) if wide else block), proto.name
    )


def _operand(  # noqa: PLR0913
    name: str,
    key: tuple[str, int],
    cut: tuple[int, int] | None,
    graph: Graph,
    copies: dict[str, str],
    out_nodes: list[onnx.NodeProto],
    t: int,
    index: int,
    group: str,
) -> str:
    """A whole tensor a split node reads: through the copy (its gradient all-reduced) where it is
    floating, then cut to the rank's block where ``cut`` says."""
    source = name
    if graph.tensors[name].floating:
        if name not in copies:
            copies[name] = f"{name}__tp_copy"
            out_nodes.append(
                helper.make_node("TpCopy", [name], [copies[name]], name=copies[name], group=group)
            )
        source = copies[name]
    if cut is None:
        return source
    axis, part = cut
    target = f"{name}__tp_shard_{key[0]}_{key[1]}"
    out_nodes.append(
        helper.make_node("TpShard", [source], [target], name=target, axis=axis, t=t, index=index, part=part)
    )
    return target


def _copy_of(node: onnx.NodeProto) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(node)
    return out


def _row(node: onnx.NodeProto, group: str, narrow: int | None = None) -> list[onnx.NodeProto]:
    """A row-split product, its partial sums all-reduced; a Gemm's bias added once, after.
    ``narrow``: the product's element type, its partial sums computed and summed in fp32 instead."""
    out = node.output[0]
    partial = f"{out}__tp_partial"
    widened: list[onnx.NodeProto] = []
    if narrow is not None:
        wide_in = f"{node.input[0]}__tp_fp32_{node.name}"
        widened.append(
            helper.make_node("Cast", [node.input[0]], [wide_in], name=wide_in, to=TensorProto.FLOAT)
        )
        node.input[0] = wide_in
    bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
    if bias is not None:
        del node.input[2:]
        beta = next((a.f for a in node.attribute if a.name == "beta"), 1.0)
        kept = [a for a in node.attribute if a.name != "beta"]
        del node.attribute[:]
        node.attribute.extend(kept)
    node.output[0] = partial
    reduced = f"{out}__tp_sum" if bias is not None else out
    made = [*widened, node]
    if narrow is not None:
        made.append(
            helper.make_node(
                "TpReduce", [partial], [f"{out}__tp_fp32"], name=f"{out}__tp_reduce", group=group
            )
        )
        made.append(
            helper.make_node("Cast", [f"{out}__tp_fp32"], [reduced], name=f"{out}__tp_narrow", to=narrow)
        )
    else:
        made.append(helper.make_node("TpReduce", [partial], [reduced], name=f"{out}__tp_reduce", group=group))
    if bias is not None:
        if beta != 1.0:
            raise NotImplementedError(f"{node.name}: a row-split Gemm with beta {beta}")
        made.append(helper.make_node("Add", [reduced, bias], [out], name=f"{out}__tp_bias"))
    return made


def _whole_shape(node: onnx.NodeProto, graph: Graph, axis: int, t: int) -> list[onnx.NodeProto]:
    """Shape/Size of a split tensor: the whole tensor's, as one process computes it."""
    out = node.output[0]
    if node.op_type == "Size":
        entry = -1
    else:
        rank = len(graph.tensors[node.input[0]].shape or ())
        attrs = {a.name: a.i for a in node.attribute}
        start, end = (
            v % rank if v < 0 else min(v, rank) for v in (attrs.get("start", 0), attrs.get("end", rank))
        )
        if not start <= axis < end:
            return [node]
        entry = axis - start
    node.output[0] = f"{out}__tp_local"
    return [
        node,
        helper.make_node("TpWhole", [node.output[0]], [out], name=f"{out}__tp_whole", axis=entry, t=t),
    ]
