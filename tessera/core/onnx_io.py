"""Loading ONNX models the way models are found in the wild, and turning failures into one-line errors.

The named steps, each usable alone (TVM-pass style, IR in, IR out):

``read_model`` (bytes → ModelProto) → ``hoist_initializer_inputs`` → ``sort_nodes`` (structure checks:
dangling inputs, cycles) → ``name_nodes`` → ``bind_empty_cache`` → ``lower_contrib_ops`` →
``lower_ir_version`` → ``bind_input_shapes`` → ``check_model`` → ``infer_shapes``. :func:`prepare_model`
runs them in that order.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import networkx as nx
import onnx
from google.protobuf.message import DecodeError

from tessera.core.cache_inputs import bind_empty_cache, declared_dims
from tessera.core.contrib_ops import lower_contrib_ops, why_left
from tessera.core.errors import InputError
from tessera.core.external_data import load_present_external_data
from tessera.core.shape_fold import folded_shapes
from tessera.core.sparse_weights import densify
from tessera.core.user_files import read_model_bytes

Shape = tuple[int, ...]

# Element types introduced by each IR version; a model using one cannot be lowered below it.
_DTYPE_MIN_IR: dict[int, int] = {
    onnx.TensorProto.FLOAT8E4M3FN: 9,
    onnx.TensorProto.FLOAT8E4M3FNUZ: 9,
    onnx.TensorProto.FLOAT8E5M2: 9,
    onnx.TensorProto.FLOAT8E5M2FNUZ: 9,
    onnx.TensorProto.UINT4: 10,
    onnx.TensorProto.INT4: 10,
    onnx.TensorProto.FLOAT4E2M1: 11,
}


def read_model(
    source: str | os.PathLike[str] | bytes,
    *,
    label: str | None = None,
    base_dir: str | os.PathLike[str] | None = None,
) -> onnx.ModelProto:
    """Parse an ONNX file (path) or serialized bytes into a ModelProto.

    External data whose file exists in ``base_dir`` (the model's folder) is loaded; external data
    that points nowhere (the zoo's lazily generated weights) is left external: planning needs only
    dims and dtypes.
    """
    if isinstance(source, bytes | bytearray):
        data = bytes(source)
        label = label or "<bytes>"
    else:
        data = read_model_bytes(source)
        label = label or str(source)
        base_dir = Path(source).parent if base_dir is None else base_dir
    if not data:
        raise InputError("file is empty, not an ONNX model", source=label)
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise InputError(f"not an ONNX model (protobuf parse failed: {exc})", source=label) from None
    # Protobuf accepts many byte strings (a text file can parse as a message of unknown fields):
    # a model must at least have a graph with a node or an output.
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise InputError("not an ONNX model (no graph with nodes or outputs)", source=label)
    if base_dir is not None:
        load_present_external_data(model, Path(base_dir), label)
    return model


def hoist_initializer_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop graph inputs that are also initializers (exports before IR 4 list weights as inputs).

    They are weights, not activations: keeping them as inputs would make every backend expect them
    to be fed. IR versions below 4 require initializers to be inputs, so such a model is raised to
    IR 4 (a superset of IR 3). Returns the model (modified in place).
    """
    if model.ir_version < 4:
        model.ir_version = 4
    init_names = {t.name for t in model.graph.initializer}
    keep = [vi for vi in model.graph.input if vi.name not in init_names]
    if len(keep) != len(model.graph.input):
        del model.graph.input[:]
        model.graph.input.extend(keep)
    return model


def sort_nodes(model: onnx.ModelProto, *, label: str) -> onnx.ModelProto:
    """Check every node input has a producer, reject cycles, and put nodes in topological order.

    Exporters sometimes emit acyclic graphs out of order; those are sorted (stably) rather than
    rejected. A dangling input or a cycle is an InputError naming the node and tensor.
    """
    graph = model.graph
    available = {vi.name for vi in graph.input} | {t.name for t in graph.initializer}
    producer = _producers(graph, available, label)
    deps = nx.DiGraph()
    deps.add_nodes_from(range(len(graph.node)))
    for i, node in enumerate(graph.node):
        for name in (*node.input, *outer_scope_inputs(node)):
            if not name or name in available:
                continue
            if name not in producer:
                raise InputError(
                    f"node {_node_label(node, i)} has dangling input {name!r}: no node, graph input or "
                    "initializer produces it",
                    source=label,
                )
            deps.add_edge(producer[name], i)
    for vi in graph.output:
        if vi.name not in producer and vi.name not in available:
            raise InputError(f"graph output {vi.name!r} is produced by no node", source=label)
    try:
        order = list(nx.lexicographical_topological_sort(deps))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(deps)
        names = [_node_label(graph.node[u], u) for u, _ in cycle]
        raise InputError(f"graph has a cycle: {' -> '.join(names + names[:1])}", source=label) from None
    if order != list(range(len(graph.node))):
        nodes = [graph.node[i] for i in order]
        sorted_nodes = [onnx.NodeProto() for _ in nodes]
        for dst, src in zip(sorted_nodes, nodes, strict=True):
            dst.CopyFrom(src)
        del graph.node[:]
        graph.node.extend(sorted_nodes)
    return model


def _producers(graph: onnx.GraphProto, available: set[str], label: str) -> dict[str, int]:
    """The node index producing each tensor; InputError for a tensor produced twice (by two nodes,
    or by a node and a graph input or initializer)."""
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for out in node.output:
            if not out:
                continue
            if out in producer or out in available:
                raise InputError(
                    f"tensor {out!r} is produced twice (node {_node_label(node, i)})", source=label
                )
            producer[out] = i
    return producer


def outer_scope_inputs(node: onnx.NodeProto) -> tuple[str, ...]:
    """Tensors of the enclosing graph that ``node``'s subgraphs (If branches, Loop and Scan bodies)
    read without them being ``node``'s inputs: ONNX lets a subgraph name any outer tensor, so they
    are dependencies as real as the listed inputs."""
    names: list[str] = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            names.extend(_free_tensors(attr.g))
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for g in attr.graphs:
                names.extend(_free_tensors(g))
    explicit = set(node.input)
    return tuple(dict.fromkeys(n for n in names if n not in explicit))


def _free_tensors(graph: onnx.GraphProto) -> list[str]:
    """Tensors a (sub)graph reads that it does not define itself."""
    defined = {vi.name for vi in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    free: list[str] = []
    for node in graph.node:
        free.extend(t for t in (*node.input, *outer_scope_inputs(node)) if t and t not in defined)
        defined.update(node.output)
    return free


def _node_label(node: onnx.NodeProto, index: int) -> str:
    return repr(node.name) if node.name else f"#{index} ({node.op_type})"


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every unnamed node a stable unique name and make duplicated names unique.

    An unnamed node becomes ``{op_type}_{index}`` (its position in topological order); a name seen
    before gets ``__{k}`` appended. The same model always gets the same names.
    """
    seen: set[str] = {n.name for n in model.graph.node if n.name}
    used: set[str] = set()
    for i, node in enumerate(model.graph.node):
        name = node.name or f"{node.op_type}_{i}"
        if not node.name and name in seen:
            name = f"{name}__auto"
        base, k = name, 1
        while name in used:
            name = f"{base}__{k}"
            k += 1
        used.add(name)
        node.name = name
    return model


@functools.cache
def max_runtime_ir_version() -> int:
    """The highest IR version the installed onnxruntime loads (probed once with a one-node model)."""
    import onnxruntime as ort

    for ir in range(onnx.IR_VERSION, 3, -1):
        probe = _identity_model(ir)
        try:
            ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
            return ir
        except Exception:  # noqa: BLE001 - any refusal means "not this IR version"
            continue
    return 7


def _identity_model(ir_version: int) -> onnx.ModelProto:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)])
    model.ir_version = ir_version
    return model


def _min_ir_for_opsets(model: onnx.ModelProto) -> int:
    """Smallest IR version whose release supports the model's default-domain opset."""
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=1)
    candidates = [ir for _, ir, ai_onnx, *_ in onnx.helper.VERSION_TABLE if ai_onnx >= opset]
    return min(candidates) if candidates else onnx.IR_VERSION


def _min_ir_for_dtypes(model: onnx.ModelProto) -> int:
    graph = model.graph
    dtypes = {t.data_type for t in graph.initializer}
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        dtypes.add(vi.type.tensor_type.elem_type)
    return max((_DTYPE_MIN_IR.get(d, 3) for d in dtypes), default=3)


def lower_ir_version(model: onnx.ModelProto, *, label: str, limit: int | None = None) -> onnx.ModelProto:
    """Lower ``ir_version`` to what onnxruntime accepts, when that is safe.

    Safe means the model's opset and element types exist at the lower IR version. A model that needs
    a newer IR than the runtime knows is refused with the versions named.
    """
    limit = max_runtime_ir_version() if limit is None else limit
    if model.ir_version <= limit:
        return model
    needed = max(_min_ir_for_opsets(model), _min_ir_for_dtypes(model))
    if needed > limit:
        raise InputError(
            f"IR version {model.ir_version} cannot be lowered to {limit} (what onnxruntime "
            f"{_ort_version()} accepts): its opset or element types need IR {needed}",
            source=label,
        )
    model.ir_version = max(needed, min(limit, model.ir_version))
    return model


def _ort_version() -> str:
    import onnxruntime as ort

    return ort.__version__


def check_model(model: onnx.ModelProto, *, label: str) -> None:
    """Run ``onnx.checker`` and turn its multi-line report into one line.

    Operators that ONNX has no schema for (custom domains, unknown ops) are refused first: their
    shapes and costs are unknowable, and no backend but the one defining them could run them; so is
    a default-domain opset newer than the installed onnx knows (its operators' semantics are unknown).
    """
    known = onnx.defs.onnx_opset_version()
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > known:
            raise InputError(
                f"the model imports opset {opset.version} of ai.onnx, but the installed onnx "
                f"{onnx.__version__} knows opsets up to {known}: re-export at opset {known} or lower, "
                "or upgrade onnx",
                source=label,
            )
    for node in model.graph.node:
        if not onnx.defs.has(node.op_type, node.domain):
            domain = node.domain or "ai.onnx"
            if (why := why_left(node)) is not None:
                raise InputError(f"node {node.name!r} ({domain} {node.op_type}) is left as onnxruntime's fused "
                                 f"operator: {why}", source=label)  # fmt: skip
            raise InputError(
                f"node {node.name!r} uses op {node.op_type!r} of domain {domain!r}, which has no ONNX "
                "schema (a custom or unknown op): tessera cannot infer its shapes or cost it",
                source=label,
            )
    for vi in model.graph.output:
        if vi.type.HasField("tensor_type") and not vi.type.tensor_type.HasField("shape"):
            # The checker's own message ("Field 'shape' of 'type' is required") names no tensor.
            raise InputError(
                f"graph output {vi.name!r} declares no shape (ONNX requires one; unknown sizes may be "
                "symbolic dims)",
                source=label,
            )
    try:  # weights left outside the file are checked by their shapes, not by reading them
        onnx.checker.check_model(_external_as_inputs(model))
    except onnx.checker.ValidationError as exc:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "invalid model")
        raise InputError(f"invalid ONNX model: {first}", source=label) from None


# The largest input --input-shape may give, in elements (the graph loader's limit for any tensor:
# tessera.core.graph.MAX_TENSOR_ELEMENTS); a larger dimension would not even fit an ONNX int64 dim.
MAX_INPUT_ELEMENTS = 2**40


def _cut(text: str, limit: int = 64) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"… ({len(text)} characters)"


def parse_input_shapes(specs: Sequence[str], *, option: str = "--input-shape") -> dict[str, Shape]:
    """Parse ``NAME=1x3x224x224`` strings (the CLI's ``--input-shape``) into a mapping."""
    shapes: dict[str, Shape] = {}
    for spec in specs:
        name, sep, dims = spec.rpartition("=")
        try:
            if not sep or not name:
                raise ValueError
            shape = tuple(int(d) for d in dims.lower().split("x")) if dims else ()
        except ValueError:
            raise InputError(
                f"{spec!r}: expected NAME=D0xD1x… (e.g. input=1x3x224x224)", source=option
            ) from None
        if any(d <= 0 for d in shape):
            raise InputError(f"{spec!r}: dimensions must be positive", source=option)
        if math.prod(shape) > MAX_INPUT_ELEMENTS:
            raise InputError(
                f"{_cut(spec)}: more than {MAX_INPUT_ELEMENTS:.3g} elements (2**40), not a plausible input",
                source=option,
            )
        shapes[name] = shape
    return shapes


def bind_input_shapes(
    model: onnx.ModelProto, shapes: Mapping[str, Shape], *, label: str, default_dim: int = 1
) -> dict[str, int]:
    """Make every graph input's shape concrete.

    ``shapes`` gives whole shapes by input name; a symbolic dimension it binds (``N`` = 4) is bound
    so in every input that names it; a symbolic or unknown dimension left after that is bound to
    ``default_dim`` (1: one sample, the unit every planner scales from). Returns the symbolic
    dimensions that were bound by default, ``{"input:axis (param)": value}``, so callers can tell
    the user.
    """
    inputs = {vi.name: vi for vi in model.graph.input}
    for name in shapes:
        if name not in inputs:
            raise InputError(
                f"--input-shape names {name!r}, which is not a graph input (inputs: {', '.join(inputs)})",
                source=label,
            )
    bound = _bound_dims(inputs, shapes, label)
    defaulted: dict[str, int] = {}
    for name, vi in inputs.items():
        if not vi.type.HasField("tensor_type"):
            raise InputError(
                f"input {name!r} is not a tensor (sequences and maps are not supported)", source=label
            )
        if name in shapes:
            _set_shape(vi.type.tensor_type, name, shapes[name], label)
        else:
            defaulted.update(_bind_symbolic(vi.type.tensor_type, name, bound, default_dim, label))
    return defaulted


def _bound_dims(
    inputs: Mapping[str, onnx.ValueInfoProto], shapes: Mapping[str, Shape], label: str
) -> dict[str, tuple[int, str]]:
    """The symbolic dims the given shapes bind, each to one value (and the input that bound it),
    applied to every input that names it; InputError where two shapes bind one differently."""
    bound: dict[str, tuple[int, str]] = {}
    for name, want in shapes.items():
        for dim, value in zip(inputs[name].type.tensor_type.shape.dim, want, strict=False):
            if not dim.dim_param:
                continue
            first = bound.setdefault(dim.dim_param, (value, name))
            if first[0] != value:
                raise InputError(
                    f"--input-shape binds dimension {dim.dim_param!r} to {first[0]} ({first[1]}) and "
                    f"{value} ({name})",
                    source=label,
                )
    return bound


def _set_shape(tensor_type: onnx.TypeProto.Tensor, name: str, want: Shape, label: str) -> None:
    """Input ``name`` declared as ``want``, which must keep its rank and its fixed sizes."""
    dims = tensor_type.shape.dim
    if tensor_type.HasField("shape") and len(dims) != len(want):
        raise InputError(
            f"--input-shape {name}: rank {len(want)} given, the model declares rank {len(dims)}", source=label
        )
    for axis, (dim, value) in enumerate(zip(dims, want, strict=False)):
        if dim.HasField("dim_value") and dim.dim_value not in (0, value) and dim.dim_value > 0:
            raise InputError(
                f"--input-shape {name}: axis {axis} is fixed to {dim.dim_value} in the model, {value} given",
                source=label,
            )
    del dims[:]
    for value in want:
        dims.add().dim_value = value


def _bind_symbolic(
    tensor_type: onnx.TypeProto.Tensor,
    name: str,
    bound: Mapping[str, tuple[int, str]],
    default_dim: int,
    label: str,
) -> dict[str, int]:
    """Input ``name``'s symbolic or unknown dims bound (as another input's shape bound them, else to
    ``default_dim``); returns those bound by default."""
    if not tensor_type.HasField("shape"):
        raise InputError(f"input {name!r} has no declared rank: give --input-shape {name}=…", source=label)
    defaulted: dict[str, int] = {}
    for axis, dim in enumerate(tensor_type.shape.dim):
        if dim.HasField("dim_value") and dim.dim_value > 0:
            continue
        if dim.HasField("dim_value"):
            raise InputError(
                f"input {name!r} axis {axis} has size {dim.dim_value}: sizes must be positive", source=label
            )
        param = dim.dim_param or "?"
        value = bound[param][0] if param in bound else default_dim
        if param not in bound:
            defaulted[f"{name}:{axis} ({param})"] = default_dim
        dim.Clear()
        dim.dim_value = value
    return defaulted


def infer_shapes(model: onnx.ModelProto, *, label: str) -> onnx.ModelProto:
    """ONNX shape inference with data propagation (so Shape→Gather→Reshape chains resolve); where
    tensors stay without a concrete shape, the graph's shape computations folded (``shape_fold``: a
    ``Range`` over the input's length), then onnxruntime's symbolic shape inference, kept if better."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError) as exc:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "shape inference failed")
        raise InputError(f"shape inference failed: {first}", source=label) from None
    unresolved = unresolved_tensors(inferred)
    # Tessera's own folding first: what onnxruntime's tool resolves varies by version (1.30: not a Range).
    for second in (folded_shapes, _symbolic_shapes):
        better = second(inferred) if unresolved else None
        if better is not None and len(still := unresolved_tensors(better)) < len(unresolved):
            inferred, unresolved = better, still
    return inferred


def unresolved_tensors(model: onnx.ModelProto) -> list[str]:
    """Tensors that nodes produce whose shape inference gave no concrete shape (a symbolic or
    missing dim, or no shape at all)."""
    known = {}
    for vi in (*model.graph.value_info, *model.graph.output):
        tt = vi.type.tensor_type
        known[vi.name] = (
            vi.type.HasField("tensor_type")
            and tt.HasField("shape")
            and all(d.HasField("dim_value") for d in tt.shape.dim)
        )
    return [t for n in model.graph.node for t in n.output if t and not known.get(t, False)]


def _symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """onnxruntime's symbolic shape inference (it resolves Reshape targets computed from
    ``Shape``); None where it cannot run on the model."""
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        # Where inference stays incomplete, the tool saves the model as sym_shape_infer_temp.onnx in
        # the working directory before raising: a temporary one, never the user's.
        with _quiet_stdio(), tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
            stripped = _external_as_inputs(model)
            inferred = SymbolicShapeInference.infer_shapes(stripped, auto_merge=True)
        return inferred if stripped is model else _restore_initializers(inferred, model)
    except Exception:  # noqa: BLE001 - an optional second opinion: unsupported ops, odd graphs
        return None


def _external_as_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose initializers kept outside the file (external or lazy data, which the tool cannot
    read) are graph inputs of the same type and shape: weights' shapes are all inference needs."""
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    names = {t.name for t in external}
    kept = [t for t in copy.graph.initializer if t.name not in names]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    copy.graph.input.extend(
        onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external
    )
    return copy


def _restore_initializers(inferred: onnx.ModelProto, model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the value infos ``inferred`` found (its inputs and initializers as they were)."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.value_info[:]
    result.graph.value_info.extend(inferred.graph.value_info)
    del result.graph.output[:]
    result.graph.output.extend(inferred.graph.output)
    return result


@contextlib.contextmanager
def _quiet_stdio() -> Iterator[None]:
    """The symbolic inference tool prints (and logs) what it guesses: not for a user's terminal."""
    logger = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def prepare_model(
    source: str | os.PathLike[str] | bytes,
    *,
    input_shapes: Mapping[str, Shape] | None = None,
    label: str | None = None,
    base_dir: str | os.PathLike[str] | None = None,
) -> tuple[onnx.ModelProto, dict[str, int], dict[str, DeclaredShape]]:
    """Run every loading step; returns the named, shape-inferred model, the defaulted dims and the
    graph inputs' and outputs' shapes as the model declares them (:func:`declared_shapes`)."""
    model = read_model(source, label=label, base_dir=base_dir)
    label = label or ("<bytes>" if isinstance(source, bytes | bytearray) else str(source))
    model = densify(model, label=label)
    model = hoist_initializer_inputs(model)
    model = sort_nodes(model, label=label)
    model = name_nodes(model)
    model = bind_empty_cache(model)  # a decoding graph's own KV cache inputs, bound to length 0
    model = lower_contrib_ops(model)  # onnxruntime's fused operators as standard ONNX
    model = lower_ir_version(model, label=label)
    # Shapes first: the checker refuses a graph input without a shape, which --input-shape gives.
    declared = declared_shapes(model)
    defaulted = bind_input_shapes(model, input_shapes or {}, label=label)
    check_model(model, label=label)
    return infer_shapes(model, label=label), defaulted, declared


# A dimension as declared: a number, a symbol's name, or None (neither); None for no declared shape.
DeclaredShape = tuple[int | str | None, ...] | None


def declared_shapes(model: onnx.ModelProto) -> dict[str, DeclaredShape]:
    """The graph inputs' and outputs' shapes as the model declares them, before tessera binds them."""
    return {vi.name: declared_dims(vi) for vi in (*model.graph.input, *model.graph.output)}


def restore_declared_shapes(model: onnx.ModelProto, shapes: Mapping[str, DeclaredShape]) -> onnx.ModelProto:
    """A copy of ``model`` with its inputs' and outputs' shapes as declared (``shapes``) and no
    intermediate ``value_info``: the model as given, with tessera's node names, that loads at any
    batch as the original did."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.value_info[:]
    for vi in (*out.graph.input, *out.graph.output):
        declared = shapes.get(vi.name, ())
        if declared is None or not vi.type.HasField("tensor_type"):
            vi.type.tensor_type.ClearField("shape")
            continue
        dims = vi.type.tensor_type.shape.dim
        del dims[:]
        for value in declared:
            dim = dims.add()
            if isinstance(value, int):
                dim.dim_value = value
            elif value:
                dim.dim_param = value
    return out
