""""""

from __future__ import annotations

import hashlib
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import onnx
from onnx import helper, numpy_helper

from tessera.core.errors import InputError
from tessera.core.flops import OpCost, op_cost
from tessera.core.onnx_io import (
    DeclaredShape,
    Shape,
    outer_scope_inputs,
    prepare_model,
    restore_declared_shapes,
)
from tessera.core.parameters import find_constant_nodes, parameter_owners
from tessera.core.rewrite import REWRITES, apply_rewrites
from tessera.core.user_files import read_model_bytes


def is_floating(dtype: str | np.dtype) -> bool:
    """A floating-point element type, bf16 and float8 included (ml_dtypes' types, as onnx reads them,
    are not numpy ``floating`` subtypes)."""
    d = np.dtype(dtype)
    return np.issubdtype(d, np.floating) or d.name.startswith(("bfloat16", "float8"))


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's name, concrete shape (None when inference could not resolve it) and dtype."""

    name: str
    shape: Shape | None
    dtype: str  # numpy dtype name, e.g. "float32"

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape)) if self.shape is not None else 0

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def scalar(self) -> bool:
        """One element on at most one axis (a loss a training graph computes), not a batch of 1."""
        return self.shape is not None and len(self.shape) <= 1 and all(d == 1 for d in self.shape)

    @property
    def floating(self) -> bool:
        """A floating-point tensor: one a gradient can flow through."""
        return is_floating(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": self.dtype,
        }


@dataclass(frozen=True)
class OpNode:
    """One operator: its ONNX identity, tensors, and costs at the loaded shapes."""

    name: str
    op_type: str
    domain: str
    attributes: Mapping[str, Any]
    inputs: tuple[str, ...]  # tensor names in ONNX order ("" for an absent optional input)
    outputs: tuple[str, ...]
    flops: int
    bytes_moved: int
    params: int  # parameter elements first consumed by this node (floating-point initializers)
    param_bytes: int
    # Outer tensors its subgraphs (If branches, Loop bodies) read without listing them as inputs.
    implicit_inputs: tuple[str, ...] = ()


@dataclass
class Graph:
    """A loaded ONNX model and its operator DAG (see the module docstring)."""

    model: onnx.ModelProto  # named, IR-lowered, shape-inferred
    dag: nx.DiGraph
    inputs: dict[str, TensorInfo]
    outputs: dict[str, TensorInfo]
    initializers: dict[str, TensorInfo]
    tensors: dict[str, TensorInfo]  # every tensor with known type: inputs, activations, outputs, weights
    producer: dict[str, str]  # activation tensor → node that produces it
    consumers: dict[str, tuple[str, ...]]  # tensor → nodes that read it, in topological order
    constant_nodes: frozenset[str] = frozenset()  # operators that read no activation (weight producers)
    param_owner: dict[str, str] = field(default_factory=dict)  # parameter tensor → operator charged for it
    # Operators (reading activations) whose tensors shape inference left without a concrete shape:
    # their FLOPs and bytes count 0. Said by every command that loads the model.
    unknown_shapes: tuple[str, ...] = ()
    declared_shapes: dict[str, DeclaredShape] = field(default_factory=dict)  # inputs/outputs, as given
    source: str = "<model>"
    source_sha256: str = ""
    input_shapes: dict[str, Shape] = field(default_factory=dict)  # as given (--input-shape)
    defaulted_dims: dict[str, int] = field(default_factory=dict)
    rewrites: tuple[str, ...] = ()  # graph rewrites applied after loading (tessera.core.rewrite)

    # -- views ---------------------------------------------------------------------------------

    def op(self, name: str) -> OpNode:
        return self.dag.nodes[name]["op"]

    @cached_property
    def order(self) -> tuple[str, ...]:
        """Node names in the model's (topological) order."""
        return tuple(n.name for n in self.model.graph.node)

    def ops(self) -> list[OpNode]:
        return [self.op(n) for n in self.order]

    @property
    def num_nodes(self) -> int:
        return self.dag.number_of_nodes()

    @property
    def total_flops(self) -> int:
        return sum(op.flops for op in self.ops())

    @property
    def num_params(self) -> int:
        return sum(op.params for op in self.ops())

    @property
    def param_bytes(self) -> int:
        return sum(op.param_bytes for op in self.ops())

    def op_histogram(self) -> dict[str, int]:
        counts = Counter(op.op_type for op in self.ops())
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    @property
    def sha256(self) -> str:
        """sha256 of the model as given (the file's bytes): what plans record to name their model."""
        return self.source_sha256

    # -- extraction ----------------------------------------------------------------------------

    def quotient(self, groups: Iterable[Iterable[str]]) -> nx.DiGraph:
        """The group graph: node ``i`` for the ``i``-th group of operators, an edge ``i -> j`` when
        an operator of group ``i`` feeds one of group ``j``. Every operator must be in one group."""
        members = list(groups)
        of = {n: i for i, nodes in enumerate(members) for n in nodes}
        q = nx.DiGraph()
        q.add_nodes_from(range(len(members)))
        q.add_edges_from((of[u], of[v]) for u, v in self.dag.edges if of[u] != of[v])
        return q

    def shared_weights(self, groups: Sequence[Iterable[str]]) -> dict[str, list[int]]:
        """Floating-point, non-scalar initializers (weights) that operators of more than one group
        read: ``{initializer: [group index, …]}`` in name order. A tied embedding and LM head, or
        an exporter's de-duplicated constants, split over pipeline stages: each stage holds a copy,
        and training is exact only if their gradients are summed (Megatron's embedding group)."""
        readers: dict[str, set[int]] = {}
        for i, nodes in enumerate(groups):
            for n in nodes:
                op = self.op(n)
                for t in (*op.inputs, *op.implicit_inputs):
                    info = self.initializers.get(t)
                    if info is not None and info.shape != () and info.floating:
                        readers.setdefault(t, set()).add(i)
        return {t: sorted(g) for t, g in sorted(readers.items()) if len(g) > 1}

    def shared_copies(self, groups: Sequence[Iterable[str]]) -> list[int]:
        """Per group, the parameter elements of the shared weights (:meth:`shared_weights`) it holds
        a copy of without being charged for them: the memory model charges a weight to the one
        operator that consumes it first (``OpNode.params``); every other stage reading it holds a copy."""
        members = [set(nodes) for nodes in groups]
        extra = [0] * len(members)
        for t, readers in self.shared_weights(groups).items():
            for i in readers:
                if self.param_owner.get(t) not in members[i]:
                    extra[i] += self.initializers[t].numel
        return extra

    def shared_owned(self, groups: Sequence[Iterable[str]]) -> list[int]:
        """Per group, the parameter elements of the shared weights it is charged for (it holds the
        operator that consumes them first): with :meth:`shared_copies`, every copy of a tied weight."""
        members = [set(nodes) for nodes in groups]
        owned = [0] * len(members)
        for t, readers in self.shared_weights(groups).items():
            for i in readers:
                if self.param_owner.get(t) in members[i]:
                    owned[i] += self.initializers[t].numel
        return owned

    @property
    def fixed_batch(self) -> dict[str, int]:
        """Inputs of rank ≥ 1 whose axis 0 the model declares as a number, not a symbol (torch.onnx.export
        writes the example's batch unless told ``dynamic_axes=`` / ``dynamic_shapes=``)."""
        fixed = {}
        for name in self.inputs:
            shape = self.declared_shapes.get(name)
            if shape and isinstance(shape[0], int) and shape[0] > 0:
                fixed[name] = shape[0]
        return fixed

    def named_model(self) -> onnx.ModelProto:
        """The model with tessera's node names and its inputs and outputs as declared (what
        ``inspect --write-named`` writes: it loads at any batch, as the original does)."""
        return restore_declared_shapes(self.model, self.declared_shapes)

    def fixed_batch_message(self) -> str | None:
        """Why a training plan of this model cannot run (its batch axis is fixed), with the fix;
        None when every input's axis 0 is symbolic. Training runs micro-batches of any size."""
        fixed = self.fixed_batch
        if not fixed:
            return None
        name, size = next(iter(fixed.items()))
        return (
            f"input {name!r} has a fixed batch of {size} (axis 0 is a number, not a symbol), but training "
            f"runs micro-batches of other sizes: {batch_fix(name, size)}"
        )

    def unknown_shapes_message(self) -> str | None:
        """One line naming the operators whose shapes are unknown and the fix; None if none."""
        if not self.unknown_shapes:
            return None
        shown = ", ".join(f"{self.op(n).op_type} {n!r}" for n in self.unknown_shapes[:3])
        more = f" and {len(self.unknown_shapes) - 3} more" if len(self.unknown_shapes) > 3 else ""
        return (
            f"{len(self.unknown_shapes)} operator(s) have shapes that shape inference could not resolve "
            f"({shown}{more}): their FLOPs and bytes count as 0; give --input-shape for every symbolic "
            "input, or re-export the model with static shapes"
        )

    def boundary(self, nodes: Iterable[str]) -> tuple[list[str], list[str]]:
        """Input and output activation tensors of a node set, in a deterministic order.

        Inputs: tensors read by the set and produced outside it (by other nodes or graph inputs);
        initializers are not inputs (they travel with the subgraph). Outputs: tensors produced in
        the set and read outside it, or graph outputs.
        """
        members = set(nodes)
        unknown = members - set(self.dag.nodes)
        if unknown:
            raise KeyError(f"unknown node(s): {', '.join(sorted(unknown))}")
        ins: list[str] = []
        outs: list[str] = []
        seen_in: set[str] = set()
        for name in self.order:
            if name not in members:
                continue
            op = self.op(name)
            for t in (*op.inputs, *op.implicit_inputs):
                if not t or t in self.initializers or t in seen_in:
                    continue
                if self.producer.get(t) not in members:
                    seen_in.add(t)
                    ins.append(t)
            for t in op.outputs:
                if not t:
                    continue
                read_outside = any(c not in members for c in self.consumers.get(t, ()))
                if read_outside or t in self.outputs:
                    outs.append(t)
        return ins, outs

    def extract(self, nodes: Iterable[str], *, name: str | None = None) -> onnx.ModelProto:
        """Cut ``nodes`` out as a standalone ONNX model that passes ``onnx.checker``.

        Inputs and outputs come from :meth:`boundary`; the initializers the nodes read are copied in;
        node order, opsets and IR version are the parent's.
        """
        members = set(nodes)
        ins, outs = self.boundary(members)
        node_protos = [self._node_proto[n] for n in self.order if n in members]
        used = {t for n in node_protos for t in (*n.input, *self.op(n.name).implicit_inputs) if t}
        inits = [self.initializer_protos[t] for t in sorted(used) if t in self.initializer_protos]
        value_info = [
            self._value_info(t)
            for n in node_protos
            for t in n.output
            if t and t not in outs and t in self.tensors
        ]
        graph = helper.make_graph(
            node_protos,
            name or f"{self.model.graph.name or 'graph'}_sub",
            [self._value_info(t) for t in ins],
            [self._value_info(t) for t in outs],
            initializer=inits,
            value_info=value_info,
        )
        sub = helper.make_model(graph, opset_imports=list(self.model.opset_import))
        sub.ir_version = self.model.ir_version
        return sub

    @cached_property
    def _node_proto(self) -> dict[str, onnx.NodeProto]:
        return {n.name: n for n in self.model.graph.node}

    @cached_property
    def initializer_protos(self) -> dict[str, onnx.TensorProto]:
        """The model's initializers by name (as stored: lazy or external data not read)."""
        return {t.name: t for t in self.model.graph.initializer}

    def _value_info(self, tensor: str) -> onnx.ValueInfoProto:
        info = self.tensors[tensor]
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
        return helper.make_tensor_value_info(
            tensor, elem, list(info.shape) if info.shape is not None else None
        )


def batch_fix(name: str, size: int) -> str:
    """How to re-export a model whose input ``name`` has the fixed batch ``size``."""
    cause = (
        "torch.export fixes any example dimension of size 1, even with dynamic_shapes=, so trace with an "
        "example batch of 2 or more; "
        if size == 1
        else ""
    )
    return (
        f"{cause}re-export with a dynamic batch axis (torch.onnx.export: dynamic_axes={{{name!r}: {{0: "
        "'batch'}}, or dynamic_shapes= with the dynamo exporter)"
    )


def load_graph(
    source: str | os.PathLike[str] | bytes | onnx.ModelProto,
    *,
    input_shapes: Mapping[str, Shape] | None = None,
    label: str | None = None,
    rewrites: Sequence[str] = (),
) -> Graph:
    """Load an ONNX model (path, bytes or ModelProto) into a :class:`Graph`.

    ``rewrites`` names graph rewrites (:mod:`tessera.core.rewrite`) applied after loading; the
    graph's ``sha256`` stays the given model's.

    Raises :class:`~tessera.core.errors.InputError` with a one-line message for anything a user can
    get wrong: unreadable or non-ONNX files, cycles, dangling inputs, checker failures, shapes.
    """
    if label is None:
        label = "<bytes>" if isinstance(source, bytes | bytearray | onnx.ModelProto) else str(source)
    base_dir = None if isinstance(source, bytes | bytearray | onnx.ModelProto) else Path(source).parent
    if isinstance(source, onnx.ModelProto):
        source = source.SerializeToString(deterministic=True)
    elif not isinstance(source, bytes | bytearray):
        source = read_model_bytes(source)
    digest = hashlib.sha256(source).hexdigest()
    model, defaulted, declared = prepare_model(
        source, input_shapes=input_shapes, label=label, base_dir=base_dir
    )
    if rewrites:
        model = apply_rewrites(model, rewrites, label=label)
    graph = build_graph(model, label=label, defaulted_dims=defaulted)
    graph.source_sha256 = digest
    graph.input_shapes = dict(input_shapes or {})
    graph.declared_shapes = declared
    graph.rewrites = tuple(name for name in REWRITES if name in rewrites)  # in the order applied
    return graph


def rewritten(graph: Graph, rewrites: Sequence[str]) -> Graph:
    """``graph`` (loaded without rewrites) with ``rewrites`` applied: what ``load_graph`` of the same
    file with these ``rewrites`` gives, without reading and preparing the file again."""
    if graph.rewrites:
        raise ValueError(f"{graph.source}: already rewritten ({', '.join(graph.rewrites)})")
    model = apply_rewrites(graph.model, rewrites, label=graph.source)
    out = build_graph(model, label=graph.source, defaulted_dims=graph.defaulted_dims)
    out.source_sha256 = graph.source_sha256
    out.input_shapes = dict(graph.input_shapes)
    out.declared_shapes = dict(graph.declared_shapes)
    out.rewrites = tuple(name for name in REWRITES if name in rewrites)
    return out


def build_graph(model: onnx.ModelProto, *, label: str, defaulted_dims: dict[str, int] | None = None) -> Graph:
    """Build the DAG and per-node costs of an already prepared (named, shape-inferred) model."""
    g = model.graph
    tensors, initializers = _tensor_table(g, label)
    implicit = {node.name: outer_scope_inputs(node) for node in g.node}
    producer, consumers = _dataflow(g, implicit)
    inputs = {vi.name: tensors[vi.name] for vi in g.input if vi.name in tensors}
    outputs = {vi.name: tensors[vi.name] for vi in g.output if vi.name in tensors}
    _check_shapes(tensors, label)

    constant_nodes = find_constant_nodes(g, inputs, initializers, producer, implicit)
    param_owner = parameter_owners(g, tensors, initializers, constant_nodes, consumers)
    dag = nx.DiGraph()
    for node in g.node:
        owned = [tensors[t] for t in param_owner.get(node.name, ())]
        dag.add_node(node.name, op=_op_node(node, tensors, owned, implicit[node.name]))
    _add_edges(dag, g, tensors, producer)
    return Graph(
        model=model,
        dag=dag,
        inputs=inputs,
        outputs=outputs,
        initializers=initializers,
        tensors=tensors,
        producer=producer,
        consumers={k: tuple(v) for k, v in consumers.items()},
        constant_nodes=frozenset(constant_nodes),
        param_owner={t: node for node, owned in param_owner.items() for t in owned},
        unknown_shapes=tuple(
            n.name
            for n in g.node
            if n.name not in constant_nodes
            and any(t and (tensors.get(t) is None or tensors[t].shape is None) for t in (*n.input, *n.output))
        ),
        source=label,
        defaulted_dims=dict(defaulted_dims or {}),
    )


def _tensor_table(g: onnx.GraphProto, label: str) -> tuple[dict[str, TensorInfo], dict[str, TensorInfo]]:
    """Every tensor's info (declared and inferred values, weights, Constant outputs) and the weights'."""
    tensors: dict[str, TensorInfo] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        info = _tensor_info_from_value_info(vi)
        if info is not None:
            tensors[vi.name] = info
    initializers = {
        t.name: TensorInfo(t.name, tuple(int(d) for d in t.dims), _dtype_name(t.data_type, label))
        for t in g.initializer
    }
    for t in g.sparse_initializer:
        initializers[t.values.name] = TensorInfo(
            t.values.name, tuple(int(d) for d in t.dims), _dtype_name(t.values.data_type, label)
        )
    tensors.update(initializers)
    for node in g.node:
        if node.op_type == "Constant":
            for out in node.output:
                if out not in tensors:
                    tensors[out] = _constant_info(node, label)
    return tensors, initializers


def _dataflow(
    g: onnx.GraphProto, implicit: Mapping[str, tuple[str, ...]]
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Each tensor's producing node and its consumers (a subgraph's outer reads included)."""
    producer: dict[str, str] = {}
    consumers: dict[str, list[str]] = {}
    for node in g.node:
        for out in node.output:
            if out:
                producer[out] = node.name
        for inp in (*node.input, *implicit[node.name]):
            if inp:
                consumers.setdefault(inp, []).append(node.name)
    return producer, consumers


def _op_node(
    node: onnx.NodeProto,
    tensors: Mapping[str, TensorInfo],
    owned: list[TensorInfo],
    implicit: tuple[str, ...],
) -> OpNode:
    """``node`` as an :class:`OpNode`: its cost from its tensors' shapes, the weights it owns."""
    attrs = {a.name: _plain(helper.get_attribute_value(a)) for a in node.attribute}
    in_infos = [tensors.get(t) if t else None for t in node.input]
    out_infos = [tensors.get(t) if t else None for t in node.output]
    cost: OpCost = op_cost(
        node.op_type,
        attrs,
        [i.shape if i else None for i in in_infos],
        [o.shape if o else None for o in out_infos],
        [i.nbytes if i else 0 for i in in_infos],
        [o.nbytes if o else 0 for o in out_infos],
    )
    return OpNode(
        name=node.name,
        op_type=node.op_type,
        domain=node.domain,
        attributes=attrs,
        inputs=tuple(node.input),
        outputs=tuple(node.output),
        flops=cost.flops,
        bytes_moved=cost.bytes_moved,
        params=sum(t.numel for t in owned),
        param_bytes=sum(t.nbytes for t in owned),
        implicit_inputs=implicit,
    )


def _add_edges(
    dag: nx.DiGraph, g: onnx.GraphProto, tensors: Mapping[str, TensorInfo], producer: Mapping[str, str]
) -> None:
    """An edge from each producer to each consumer, carrying the tensors it passes and their bytes."""
    for node in g.node:
        for t in (*node.input, *outer_scope_inputs(node)):
            src = producer.get(t)
            if src is None:
                continue
            info = tensors.get(t) or TensorInfo(t, None, "float32")
            if not dag.has_edge(src, node.name):
                dag.add_edge(src, node.name, tensors=(info,), bytes=info.nbytes)
                continue
            edge = dag.edges[src, node.name]
            if all(x.name != t for x in edge["tensors"]):
                edge["tensors"] = (*edge["tensors"], info)
                edge["bytes"] += info.nbytes


# Dims above this are taken as a mistake (a declared 2**40-element tensor is not a real model).
MAX_TENSOR_ELEMENTS = 2**40


def _check_shapes(tensors: Mapping[str, TensorInfo], label: str) -> None:
    for info in tensors.values():
        if info.shape is None:
            continue
        if any(d < 0 for d in info.shape):
            raise InputError(
                f"tensor {info.name!r} has a negative dimension {list(info.shape)}", source=label
            )
        if info.numel > MAX_TENSOR_ELEMENTS:
            raise InputError(
                f"tensor {info.name!r} declares {info.numel:.3g} elements {list(info.shape)}: "
                f"more than {MAX_TENSOR_ELEMENTS:.3g}, not a plausible model",
                source=label,
            )


def _tensor_info_from_value_info(vi: onnx.ValueInfoProto) -> TensorInfo | None:
    if not vi.type.HasField("tensor_type"):
        return None
    tt = vi.type.tensor_type
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)).name
    except (KeyError, TypeError, ValueError):
        return None
    shape: Shape | None = None
    if tt.HasField("shape"):
        dims = []
        for d in tt.shape.dim:
            if not d.HasField("dim_value"):
                dims = None
                break
            dims.append(int(d.dim_value))
        shape = tuple(dims) if dims is not None else None
    return TensorInfo(vi.name, shape, dtype)


def _constant_info(node: onnx.NodeProto, label: str) -> TensorInfo:
    for attr in node.attribute:
        if attr.name == "value":
            return TensorInfo(
                node.output[0], tuple(int(d) for d in attr.t.dims), _dtype_name(attr.t.data_type, label)
            )
    return TensorInfo(node.output[0], None, "float32")


def _dtype_name(elem_type: int, label: str) -> str:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except (KeyError, TypeError, ValueError):
        raise InputError(f"unsupported tensor element type {elem_type}", source=label) from None


def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 1


def _plain(value: Any) -> Any:
    """Attribute values as plain Python (bytes → str, tensors → lists) so they serialize."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, onnx.TensorProto):
        if value.data_location == onnx.TensorProto.EXTERNAL:
            return {"tensor": list(value.dims)}
        return numpy_helper.to_array(value).tolist()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, onnx.GraphProto):
        return {"graph": value.name}
    return value


def write_model(model: onnx.ModelProto, path: str | os.PathLike[str]) -> Path:
    """Write a model atomically (serialized deterministically)."""
    from tessera.core.files import write_output

    return write_output(path, model.SerializeToString(deterministic=True))
