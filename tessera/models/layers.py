"""The ONNX graph builder and the layers the zoo models are made of.

:class:`GraphBuilder` accumulates nodes, initializers and graph inputs/outputs under a name scope
(``branch2/layer1/attn``), so every node gets a unique, readable name that plans can refer to. A
single-output node's output tensor has the node's name. Layers are functions ``layer(g, x, ...) ->
y`` over tensor names; each owns its parameters and its constants (shape vectors, scalars), so a
pipeline stage that holds a layer holds everything the layer reads.

All models use opset 17 (default domain only), fp32 activations, and ``batch`` as the symbolic
first dimension of every input and output.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tessera import __version__
from tessera.core.weights import ONES, ZEROS, Init, generate, lazy_tensor

OPSET = 17
IR_VERSION = 8
BATCH = "batch"
"""The name of the symbolic batch dimension (``dim_param``) of every input and output."""

Shape = Sequence[int | str]


class GraphBuilder:
    """Builds one ONNX model: scoped, unique names; parameters eager or lazy (see ``weights``)."""

    def __init__(self, name: str, *, seed: int, lazy: bool) -> None:
        self.name = name
        self.seed = seed
        self.lazy = lazy
        self.parameter_count = 0
        self._scopes: list[str] = []
        self._nodes: list[onnx.NodeProto] = []
        self._initializers: list[TensorProto] = []
        self._inputs: list[onnx.ValueInfoProto] = []
        self._outputs: list[onnx.ValueInfoProto] = []
        self._node_names: set[str] = set()
        self._tensor_names: set[str] = set()

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix every name created inside the block with ``name/``."""
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def qualify(self, name: str) -> str:
        return "/".join([*self._scopes, name])

    def _claim_tensor(self, name: str) -> str:
        if name in self._tensor_names:
            raise RuntimeError(f"tensor name {name!r} is used twice")
        self._tensor_names.add(name)
        return name

    def input(self, name: str, elem_type: int, shape: Shape) -> str:
        """Declare a graph input (unscoped name)."""
        self._inputs.append(helper.make_tensor_value_info(self._claim_tensor(name), elem_type, shape))
        return name

    def output(self, tensor: str, elem_type: int, shape: Shape) -> None:
        """Declare ``tensor`` a graph output."""
        self._outputs.append(helper.make_tensor_value_info(tensor, elem_type, shape))

    def param(self, name: str, shape: Sequence[int], init: Init) -> str:
        """A weight: an fp32 initializer drawn as ``init`` says, lazy when the builder is lazy."""
        full = self._claim_tensor(self.qualify(name))
        dims = tuple(int(d) for d in shape)
        if self.lazy:
            tensor = lazy_tensor(full, dims, init, self.seed)
        else:
            values = generate(full, dims, init, self.seed)
            tensor = TensorProto(name=full, data_type=TensorProto.FLOAT, dims=dims, raw_data=values.tobytes())
        self._initializers.append(tensor)
        self.parameter_count += math.prod(dims)
        return full

    def const(self, name: str, value: np.ndarray) -> str:
        """A small constant (shape vector, scalar): always stored inline."""
        full = self._claim_tensor(self.qualify(name))
        self._initializers.append(numpy_helper.from_array(value, full))
        return full

    def op(
        self, op_type: str, inputs: Sequence[str], name: str, *, output: str | None = None, **attrs: object
    ) -> str:
        """Add a single-output node named ``scope/name``; returns its output tensor's name.

        The output tensor is named like the node unless ``output`` names it (a graph output).
        """
        node_name = self.qualify(name)
        if node_name in self._node_names:
            raise RuntimeError(f"node name {node_name!r} is used twice")
        self._node_names.add(node_name)
        out = self._claim_tensor(output or node_name)
        self._nodes.append(helper.make_node(op_type, list(inputs), [out], name=node_name, **attrs))
        return out

    def build(self, config: object, doc: str, extra: dict[str, str] | None = None) -> onnx.ModelProto:
        """The finished model (opset 17, IR version 8).

        ``metadata_props`` record the model (``tessera.model``: the graph name), the seed, every
        field of the dataclass ``config`` and of ``extra`` as ``tessera.<field>``, and
        ``tessera.parameters``: the number of weight elements (every :meth:`param`, BatchNorm
        running statistics included; not the inline constants).
        """
        graph = helper.make_graph(self._nodes, self.name, self._inputs, self._outputs, self._initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            ir_version=IR_VERSION,
            producer_name="tessera.models",
            producer_version=__version__,
            doc_string=doc,
        )
        props = {"tessera.model": self.name, "tessera.seed": str(self.seed)}
        for key, value in dataclasses.asdict(config).items():  # type: ignore[call-overload]
            props[f"tessera.{key}"] = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        props.update({f"tessera.{key}": value for key, value in (extra or {}).items()})
        props["tessera.parameters"] = str(self.parameter_count)
        helper.set_model_props(model, props)
        return model


# --- constants ---------------------------------------------------------------------------------


def shape_const(g: GraphBuilder, name: str, dims: Sequence[int]) -> str:
    """An int64 shape vector (``0`` copies the input's dimension, as in Reshape)."""
    return g.const(name, np.array(dims, dtype=np.int64))


def scalar_const(g: GraphBuilder, name: str, value: float) -> str:
    return g.const(name, np.array(value, dtype=np.float32))


# --- dense layers ------------------------------------------------------------------------------


def linear(
    g: GraphBuilder, x: str, in_dim: int, out_dim: int, name: str, *, std: float, bias: bool = True
) -> str:
    """``x @ W (+ b)`` as MatMul (+ Add), for inputs of any rank; ``W`` is ``[in_dim, out_dim]``."""
    with g.scope(name):
        weight = g.param("weight", (in_dim, out_dim), Init.normal(std))
        y = g.op("MatMul", [x, weight], "matmul")
        if bias:
            y = g.op("Add", [y, g.param("bias", (out_dim,), ZEROS)], "bias_add")
    return y


def gemm(
    g: GraphBuilder, x: str, in_dim: int, out_dim: int, name: str, *, std: float, output: str | None = None
) -> str:
    """A fully connected layer on ``[batch, in_dim]`` as one Gemm (``W`` is ``[out_dim, in_dim]``,
    ``transB=1``, as PyTorch exports ``nn.Linear``)."""
    with g.scope(name):
        weight = g.param("weight", (out_dim, in_dim), Init.normal(std))
        bias = g.param("bias", (out_dim,), ZEROS)
        return g.op("Gemm", [x, weight, bias], "gemm", output=output, transB=1)


def mlp(g: GraphBuilder, x: str, in_dim: int, widths: Sequence[int], name: str) -> str:
    """Feed-forward layers ``name/layer{i}``: Gemm + Relu each, He-initialized so activations stay O(1)."""
    with g.scope(name):
        for i, width in enumerate(widths):
            with g.scope(f"layer{i}"):
                x = gemm(g, x, in_dim, width, "fc", std=math.sqrt(2.0 / in_dim))
                x = g.op("Relu", [x], "relu")
            in_dim = width
    return x


def gelu(g: GraphBuilder, x: str, name: str = "gelu") -> str:
    """Exact GELU, ``0.5 * x * (1 + erf(x / sqrt(2)))``, from opset-17 primitives (Gelu is opset 20)."""
    with g.scope(name):
        scaled = g.op("Mul", [x, scalar_const(g, "inv_sqrt2", 1.0 / math.sqrt(2.0))], "div_sqrt2")
        erf = g.op("Erf", [scaled], "erf")
        shifted = g.op("Add", [erf, scalar_const(g, "one", 1.0)], "add_one")
        gated = g.op("Mul", [x, shifted], "mul_x")
        return g.op("Mul", [gated, scalar_const(g, "half", 0.5)], "mul_half")


def layer_norm(g: GraphBuilder, x: str, dim: int, name: str, *, epsilon: float = 1e-5) -> str:
    """LayerNormalization over the last axis with scale (ones) and bias (zeros)."""
    with g.scope(name):
        scale = g.param("scale", (dim,), ONES)
        bias = g.param("bias", (dim,), ZEROS)
        return g.op("LayerNormalization", [x, scale, bias], "layer_norm", axis=-1, epsilon=epsilon)


def ffn(
    g: GraphBuilder,
    x: str,
    hidden: int,
    inner: int,
    name: str = "ffn",
    *,
    std: float = 0.02,
    std_down: float | None = None,
    gated: bool = False,
) -> str:
    """The transformer feed-forward block: linear ``fc1`` -> GELU -> linear ``fc2``; ``gated``:
    SwiGLU, ``fc2(silu(gate(x)) * fc1(x))`` (Llama). ``std_down``: of ``fc2`` (default ``std``)."""
    with g.scope(name):
        h = linear(g, x, hidden, inner, "fc1", std=std)
        if gated:
            gate = linear(g, x, hidden, inner, "gate", std=std)
            silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], "gate_sigmoid")], "silu")
            h = g.op("Mul", [silu, h], "gated")
        else:
            h = gelu(g, h)
        return linear(g, h, inner, hidden, "fc2", std=std if std_down is None else std_down)


# --- attention ---------------------------------------------------------------------------------


def attention(  # noqa: PLR0913
    g: GraphBuilder,
    x: str,
    *,
    hidden: int,
    heads: int,
    seq: int | None,
    kv_heads: int | None = None,
    causal: bool = False,
    name: str = "attn",
    std: float = 0.02,
    head_dim: int | None = None,
) -> str:
    """Multi-head self-attention on ``[batch, seq, hidden]`` from MatMul/Reshape/Transpose/Softmax.

    Nodes under ``name/``: ``q``, ``k``, ``v`` projections (MatMul + bias Add), ``q_heads``,
    ``k_heads``, ``v_heads`` (Reshape + Transpose to ``[batch, heads, seq, head_dim]``, K to
    ``[batch, heads, head_dim, seq]``), ``qk_matmul``, ``qk_scale`` (Mul by ``1/sqrt(head_dim)``),
    with ``causal``: ``mask_fill`` (ConstantOfShape) -> ``causal_mask`` (Trilu) -> ``mask_add``;
    ``softmax``, ``av_matmul``, ``merge_heads`` (Transpose + Reshape), ``out`` projection.

    ``kv_heads < heads`` is grouped-query attention: K and V are projected to ``kv_heads`` heads
    and each is shared by ``heads / kv_heads`` query heads (``k_repeat``/``v_repeat``: Reshape,
    Expand, Reshape), so the attention core is the same as for multi-head attention.

    ``seq`` None: any sequence length (the GPT decodes token by token): the causal mask's shape and
    the grouped-query repeats follow the input. ``head_dim``: default ``hidden / heads``.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads or (head_dim is None and hidden % heads):
        raise ValueError(
            f"heads ({heads}) must divide hidden ({hidden}) and kv_heads ({kv_heads}) must divide heads"
        )
    head_dim = hidden // heads if head_dim is None else head_dim
    width = heads * head_dim
    with g.scope(name):
        q = linear(g, x, hidden, width, "q", std=std)
        k = linear(g, x, hidden, kv_heads * head_dim, "k", std=std)
        v = linear(g, x, hidden, kv_heads * head_dim, "v", std=std)
        q = _split_heads(g, q, heads, head_dim, "q_heads", perm=(0, 2, 1, 3))
        k = _split_heads(g, k, kv_heads, head_dim, "k_heads", perm=(0, 2, 3, 1))
        v = _split_heads(g, v, kv_heads, head_dim, "v_heads", perm=(0, 2, 1, 3))
        if kv_heads != heads:
            length = -1 if seq is None else seq  # Reshape's -1: whatever the input holds
            k = _repeat_kv(g, k, kv_heads, heads, (head_dim, length), "k_repeat")
            v = _repeat_kv(g, v, kv_heads, heads, (length, head_dim), "v_repeat")
        scores = g.op("MatMul", [q, k], "qk_matmul")
        scores = g.op(
            "Mul", [scores, scalar_const(g, "qk_scale/factor", 1.0 / math.sqrt(head_dim))], "qk_scale"
        )
        if causal:
            fill = helper.make_tensor("value", TensorProto.FLOAT, [1], [-1e9])
            square = (
                g.op("Shape", [scores], "mask_shape", start=-2)  # [S, S] of the scores
                if seq is None
                else shape_const(g, "mask_fill/shape", (seq, seq))
            )
            masked = g.op("ConstantOfShape", [square], "mask_fill", value=fill)
            # Strictly upper triangle (future positions) keeps -1e9, the rest becomes 0.
            mask = g.op(
                "Trilu",
                [masked, g.const("causal_mask/k", np.array(1, dtype=np.int64))],
                "causal_mask",
                upper=1,
            )
            scores = g.op("Add", [scores, mask], "mask_add")
        probs = g.op("Softmax", [scores], "softmax", axis=-1)
        context = g.op("MatMul", [probs, v], "av_matmul")
        with g.scope("merge_heads"):
            context = g.op("Transpose", [context], "transpose", perm=[0, 2, 1, 3])
            context = g.op("Reshape", [context, shape_const(g, "shape", (0, 0, width))], "reshape")
        return linear(g, context, width, hidden, "out", std=std)


def _split_heads(g: GraphBuilder, x: str, heads: int, head_dim: int, name: str, perm: Sequence[int]) -> str:
    with g.scope(name):
        x = g.op("Reshape", [x, shape_const(g, "shape", (0, 0, heads, head_dim))], "reshape")
        return g.op("Transpose", [x], "transpose", perm=list(perm))


def _repeat_kv(g: GraphBuilder, x: str, kv_heads: int, heads: int, tail: tuple[int, int], name: str) -> str:
    """``[b, kv_heads, *tail]`` -> ``[b, heads, *tail]``, each KV head repeated ``heads/kv_heads`` times."""
    group = heads // kv_heads
    with g.scope(name):
        x = g.op("Reshape", [x, shape_const(g, "unsqueeze_shape", (0, kv_heads, 1, *tail))], "unsqueeze")
        ones = tuple(1 if d == -1 else d for d in tail)  # Expand: 1 keeps the input's length
        x = g.op("Expand", [x, shape_const(g, "expand_shape", (1, kv_heads, group, *ones))], "expand")
        return g.op("Reshape", [x, shape_const(g, "shape", (0, heads, *tail))], "reshape")


def transformer_layer(  # noqa: PLR0913
    g: GraphBuilder,
    x: str,
    *,
    hidden: int,
    heads: int,
    ffn_dim: int,
    seq: int | None,
    kv_heads: int | None = None,
    causal: bool = False,
    pre_norm: bool = True,
    epsilon: float = 1e-5,
    head_dim: int | None = None,
    gated: bool = False,
    fan_in: bool = False,
) -> str:
    """One transformer layer in the current scope: attention and FFN, each with a residual.

    ``pre_norm`` (GPT-2, MMT): ``x + attn(ln1(x))``, then ``x + ffn(ln2(x))``.
    Post-norm (BERT): ``ln1(x + attn(x))``, then ``ln2(x + ffn(x))``. ``fan_in``: weights drawn
    with std ``1/sqrt(rows)`` instead of 0.02 (activations stay O(1): clear greedy tokens).
    """
    std, std_down = (hidden**-0.5, ffn_dim**-0.5) if fan_in else (0.02, 0.02)

    def attn(h: str) -> str:
        return attention(
            g,
            h,
            hidden=hidden,
            heads=heads,
            seq=seq,
            kv_heads=kv_heads,
            causal=causal,
            std=std,
            head_dim=head_dim,
        )

    def feed_forward(h: str) -> str:
        return ffn(g, h, hidden, ffn_dim, std=std, std_down=std_down, gated=gated)

    for index, (body, block) in enumerate((("attn", attn), ("ffn", feed_forward)), start=1):
        norm = f"ln{index}"
        h = layer_norm(g, x, hidden, norm, epsilon=epsilon) if pre_norm else x
        x = g.op("Add", [x, block(h)], f"{body}_residual")
        if not pre_norm:
            x = layer_norm(g, x, hidden, norm, epsilon=epsilon)
    return x


# --- convolutions ------------------------------------------------------------------------------


def conv_bn(  # noqa: PLR0913
    g: GraphBuilder,
    x: str,
    in_ch: int,
    out_ch: int,
    name: str,
    *,
    kernel: int,
    stride: int = 1,
    group: int = 1,
    relu: bool = True,
) -> str:
    """Conv (no bias, ``group`` groups, "same" padding) -> BatchNormalization (inference) [-> Relu]."""
    with g.scope(name):
        fan_in = in_ch // group * kernel * kernel
        weight = g.param(
            "weight", (out_ch, in_ch // group, kernel, kernel), Init.normal(math.sqrt(2.0 / fan_in))
        )
        pad = kernel // 2
        y = g.op(
            "Conv",
            [x, weight],
            "conv",
            kernel_shape=[kernel, kernel],
            strides=[stride, stride],
            pads=[pad] * 4,
            group=group,
        )
        bn = [g.param(p, (out_ch,), init) for p, init in (("bn_scale", ONES), ("bn_bias", ZEROS))]
        stats = [g.param(p, (out_ch,), init) for p, init in (("bn_mean", ZEROS), ("bn_var", ONES))]
        y = g.op("BatchNormalization", [y, *bn, *stats], "bn", epsilon=1e-5)
        return g.op("Relu", [y], "relu") if relu else y
