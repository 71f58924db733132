"""Recognize a decoder-only transformer in an ONNX graph and read its :class:`LlmConfig` off the weights.

By structure only: causal self-attention cores (:mod:`tessera.planners.cp.attention`: what torch.onnx's
exporters write, SDPA and eager, rotary, grouped-query), an FFN per layer, the token embedding and the
LM head. Sizes come from weight shapes; ``tessera.*`` metadata, when present, is cross-checked.

References: thesis §4.4 (CP splits causal self-attention's KV cache). Matching rules: docs/cp.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from tessera.core.errors import InputError
from tessera.core.graph import Graph, OpNode
from tessera.planners.cp.attention import AttentionCore, Matcher
from tessera.planners.cp.llm import LlmConfig
from tessera.planners.cp.recognize_checks import check_causal, check_cores, fixed_length
from tessera.planners.cp.scores import ScoreMod

# Ops whose output carries only a shape: a dynamic export's Reshape reads its shape off any tensor.
_SHAPE_ONLY = frozenset({"Shape", "Size", "ConstantOfShape", "EyeLike"})

__all__ = ["Decoder", "position_limit", "position_tables", "recognize_decoder", "recognize_llm"]

_NORMS = {
    "LayerNormalization": "layernorm",
    "SimplifiedLayerNormalization": "rmsnorm",
    "RMSNormalization": "rmsnorm",
}


@dataclass(frozen=True)
class Decoder:
    """A recognized decoder: its :class:`LlmConfig` and what the config does not say."""

    config: LlmConfig
    cores: tuple[AttentionCore, ...]  # one per layer, in order
    positions: int | None  # rows of a learned position table; None with rotary (or no) positions
    rotary_dim: int | None  # channels of each head turned by the rotary embedding
    norm: str | None  # layernorm or rmsnorm (also decomposed); None when none was found
    parallel_residual: bool  # the FFN reads the block's input, not attention's output (GPT-J, Phi, NeoX)
    qkv: str  # fused (one projection) or separate
    fixed_length: int | None = None  # the sequence length the graph is tied to; None: any length
    position_constant: bool = False  # learned positions folded into a constant added to the embedding

    @property
    def position_limit(self) -> int | None:
        """The positions a request may hold: a learned table's rows, or the length past which the
        graph's score path does not run (a bias table's end); None: no limit."""
        known = [n for n in (self.positions, *(m.max_length for m in self.scores)) if n is not None]
        return min(known) if known else None

    def fixed_length_message(self, token_input: str) -> str | None:
        """Why the model cannot be decoded token by token (its positions are baked in), with the fix."""
        if self.fixed_length is None:
            return None
        return (
            f"input {token_input!r} has a fixed sequence length of {self.fixed_length} and the graph's positions "
            "do not follow the input's length, but decoding feeds one token at a time: export with a dynamic "
            f"sequence axis (dynamic_axes={{{token_input!r}: {{0: 'batch', 1: 'sequence'}}}}, or dynamic_shapes= "
            "with the dynamo exporter)"
        )

    def to_json(self) -> dict[str, Any]:
        """What ``inspect --json`` reports under ``decoder``."""
        c = self.config
        return {
            "layers": c.layers, "hidden": c.hidden, "heads": c.heads, "kv_heads": c.kv_heads,
            "head_dim": c.head_dim, "ffn": c.ffn, "gated_ffn": c.gated_ffn, "vocab": c.vocab,
            "experts": c.experts, "experts_per_token": c.experts_per_token, "shared_ffn": c.shared_ffn,
            "dense_layers": c.dense_layers, "dense_ffn": c.dense_ffn, "tied_embeddings": c.tied_embeddings, "positions": self.positions, "dtype": c.dtype,
            "rotary": None if self.rotary_dim is None else {"dim": self.rotary_dim, "partial": self.rotary_dim < (c.head_dim or 0)},
            "norm": self.norm, "parallel_residual": self.parallel_residual, "qkv": self.qkv,
            "attention": [core.softmax for core in self.cores],
            "position": self.position_kind, "window": self.window,
            "layer_windows": [mod.window for mod in self.scores],
            "layer_rotary": [core.rotary_dim is not None for core in self.cores],
            "softcap": _shown(self.scores[0].softcap) if self.scores else None,
            "alibi": self.scores[0].alibi is not None if self.scores else False,
            "layer_sinks": [mod.sinks is not None for mod in self.scores],
            "layer_kv_heads": [core.kv_heads for core in self.cores],
        }  # fmt: skip

    @property
    def scores(self) -> tuple[ScoreMod, ...]:
        """What each layer's graph does to its attention scores (evaluated; recognition refuses a
        decoder where one is not known)."""
        return tuple(core.scores for core in self.cores if core.scores is not None)

    @property
    def window(self) -> int | None:
        """The widest sliding window of a layer whose every layer has one; None where any layer
        attends to the whole past."""
        windows = [mod.window for mod in self.scores]
        return None if not windows or None in windows else max(w for w in windows if w is not None)

    @property
    def position_kind(self) -> str:
        """How the model knows positions: rotary, learned (a table), alibi (a score bias), or none."""
        if self.rotary_dim is not None:
            return "rotary"
        if self.scores and self.scores[0].alibi is not None:
            return "alibi"
        return "learned" if self.positions is not None or self.position_constant else "none"


class Ffn(NamedTuple):
    """A layer's feed-forward block: width F (of one expert), gated (SwiGLU), read in parallel with
    attention, and for a mixture of experts how many and how many per token."""

    width: int
    gated: bool
    parallel: bool
    experts: int = 1
    experts_per_token: int = 1
    shared: int = 0  # width of a dense FFN beside the experts (a shared expert)


class _Layers:
    """The FFN, norm and vocabulary queries around matched attention cores."""

    def __init__(self, m: Matcher) -> None:
        self.m, self.g = m, m.g

    def ffn(self, core: AttentionCore, stop: int) -> Ffn | None:
        """The FFN after ``core``'s projections, before position ``stop``: routed experts where a
        router picks them, else a dense one."""
        routed = self.routed(core, stop)
        if routed is None:
            return self.dense(core, stop)
        shared = self.dense(core, stop)  # an expert every token goes through (Qwen2-MoE)
        return routed if shared is None else routed._replace(shared=shared.width)

    def routed(self, core: AttentionCore, stop: int) -> Ffn | None:
        """A mixture of experts: a router's hidden × E scores pick k of E experts, by a ``TopK`` of k
        or by k ``ArgMax``es (PhiMoE's sparsemixer takes the best, masks it, takes the next); the
        experts' weights are E-stacked 3-D tensors (E × F × hidden, E × hidden × F, or E × 2F × hidden
        with gate and up fused) read by the experts' products."""
        start = min(self.m.position[p] for p in core.projections)
        names = self.g.order[start:stop]
        picks: dict[tuple[str, int], int] = {}  # (router input, E) -> experts picked per token
        for name in names:
            op = self.g.op(name)
            if op.op_type == "TopK":
                k = self.m.array(op.inputs[1]) if len(op.inputs) > 1 else None
                router = self._router(op.inputs[0], core.hidden) if k is not None and k.size == 1 else None
                if router is not None:
                    picks[router] = picks.get(router, 0) + int(k.reshape(-1)[0])  # type: ignore[union-attr]
            elif op.op_type == "ArgMax":
                router = self._router(op.inputs[0], core.hidden, masked=True)
                if router is not None:
                    picks[router] = picks.get(router, 0) + 1
        for (source, experts), k in picks.items():
            widths = []
            for tensor in dict.fromkeys(t for n in names for t in self.g.op(n).inputs):
                info = self.g.initializers.get(tensor)
                shape = None if info is None or info.shape is None else tuple(info.shape)
                if shape is None or len(shape) != 3 or shape[0] != experts or core.hidden not in shape[1:]:
                    continue
                widths.append(shape[2] if shape[1] == core.hidden else shape[1])
            if len(widths) < 2:
                continue
            width = min(widths)
            gated = 2 * width in widths or len(widths) >= 3
            parallel = not self._after_attention(source, core)
            return Ffn(width, gated, parallel, experts, k)
        return None

    def _router(self, scores: str, hidden: int, *, masked: bool = False) -> tuple[str, int] | None:
        """``(input, E)`` of the hidden × E projection behind a TopK's scores (through the softmax
        or sigmoid, a bias, casts and reshapes); ``masked``: also through the ``Where`` or
        ``ScatterElements`` that sets the experts already picked to -inf."""
        for _ in range(6):
            op = self.m.producer(scores)
            if op is None:
                return None
            w = self.m.weight_of(op)
            if w is not None:
                return (op.inputs[0], w[2]) if w[1] == hidden and w[2] > 1 else None
            if masked and op.op_type in ("Where", "ScatterElements") and len(op.inputs) == 3:
                # Where(picked, -inf, scores), ScatterElements(scores, picked, -inf)
                scores = op.inputs[2 if op.op_type == "Where" else 0]
                continue
            live = [t for t in op.inputs if t and not self.m.is_constant(t)]
            if (
                op.op_type not in ("Softmax", "Sigmoid", "Add", "Cast", "Reshape", "Identity")
                or len(live) != 1
            ):
                return None
            scores = live[0]
        return None

    def dense(self, core: AttentionCore, stop: int) -> Ffn | None:
        """A dense FFN after ``core``'s projections, before position ``stop``: an up projection
        (E × F, or E × 2F with gate and up fused) and a down one (F × E)."""
        own = {*core.projections, core.out_projection}
        start = min(self.m.position[p] for p in core.projections)
        found = self._pairs(self.g.order[start:stop], own, core.hidden)
        if found is None:
            return None
        ffn, readers, fused, _ = found
        # SwiGLU: gate and up read one tensor, or are one product
        gated = fused or any(readers.count(t) >= 2 for t in readers)
        parallel = not all(self._after_attention(t, core) for t in readers)  # (the LM head may be one)
        return Ffn(ffn, gated, parallel)

    def before_attention(self, core: AttentionCore) -> str | None:
        """The down projection of a feed-forward block before ``core`` (the first attention): a layer
        with no attention (a recurrence, linear attention, a convolution) precedes it."""
        start = min(self.m.position[p] for p in core.projections)
        found = self._pairs(self.g.order[:start], set(), core.hidden)
        return None if found is None else found[3]

    def _pairs(self, names: list[str], own: set, hidden: int) -> tuple[int, list[str], bool, str] | None:
        """The widest up (E×F, or E×2F fused) then down (F×E) pair among ``names``: F, the tensors the
        up projections read, whether gate and up are one product, and the down projection."""
        ups: dict[int, list[str]] = {}  # F -> the tensors E×F projections read (so far)
        found: dict[int, int] = {}  # F of a down projection after its up -> the up's width (F or 2F)
        downs: dict[int, str] = {}
        for name in names:
            op = self.g.op(name)
            w = self.m.weight_of(op)
            if w is None or name in own:
                continue
            _, rows, cols = w
            if cols == hidden and rows not in found:
                if rows in ups:
                    found[rows] = rows
                elif 2 * rows in ups:  # gate and up fused in one E×2F product, split in halves (Phi-3)
                    found[rows] = 2 * rows
                if rows in found:
                    downs[rows] = name
            if rows == hidden:
                ups.setdefault(cols, []).append(op.inputs[0])
        if not found:
            return None
        ffn = max(found)
        return ffn, ups[found[ffn]], found[ffn] == 2 * ffn, downs[ffn]

    def _after_attention(self, tensor: str, core: AttentionCore) -> bool:
        """Whether ``tensor`` is computed from ``core``'s output projection: a sequential block. Not
        (a parallel residual): the FFN reads the block's input, through one norm shared with attention
        (GPT-J, Phi) or a norm of its own (GPT-NeoX; an exporter that merges equal norms makes it one)."""
        if core.out_projection is None:  # nothing to follow: parallel where both read one tensor
            return tensor != self.g.op(core.q_projection).inputs[0]
        start = min(self.m.position[p] for p in core.projections)
        stack, seen = [tensor], set()
        while stack:
            op = self.m.producer(stack.pop())
            if op is None or op.name in seen or self.m.position[op.name] < start or op.op_type in _SHAPE_ONLY:
                continue
            if op.name == core.out_projection:
                return True
            seen.add(op.name)
            stack.extend(t for t in op.inputs if t)
        return False

    def norm(self, core: AttentionCore) -> str | None:
        """The norm in front of ``core``'s projections: an operator, or decomposed (a ReduceMean of
        the input minus its mean: LayerNorm; of its square: RMSNorm)."""
        tensor = self.g.op(core.q_projection).inputs[0]
        for _ in range(12):
            op = self.m.producer(tensor)
            if op is None:
                return None
            if op.op_type in _NORMS:
                return _NORMS[op.op_type]
            if op.op_type in ("Div", "Mul") and (mean := self._mean_of(op)) is not None:
                return mean
            live = [t for t in op.inputs if t and not self.m.is_constant(t)]
            if op.op_type not in ("Mul", "Div", "Add", "Cast", "Identity", "Reshape") or not live:
                return None
            tensor = live[-1] if op.op_type == "Mul" and len(live) == 2 else live[0]
        return None

    def _mean_of(self, op: OpNode) -> str | None:
        """layernorm or rmsnorm when ``op`` divides by (or multiplies with 1/) a root of a mean."""
        seen, queue = 0, list(op.inputs)
        kinds = set()
        while queue and seen < 40:
            t = queue.pop()
            seen += 1
            p = self.m.producer(t)
            if p is None:
                continue
            kinds.add(p.op_type)
            if p.op_type == "ReduceMean":
                inner = self.m.producer(p.inputs[0])
                if inner is not None and inner.op_type in ("Pow", "Mul"):
                    source = self.m.producer(inner.inputs[0])
                    return "layernorm" if source is not None and source.op_type == "Sub" else "rmsnorm"
            if p.op_type in ("Sqrt", "Reciprocal", "Add", "Cast", "Pow"):
                queue += [x for x in p.inputs if x]
        return None

    def vocab(self, hidden: int) -> tuple[int | None, bool]:
        """``(vocab, tied)``: from the LM head (the projection the first output is computed by),
        else the token embedding."""
        embedding = self.embedding(hidden)
        head, tensor = None, next(iter(self.g.outputs))
        for _ in range(8):
            op = self.m.producer(tensor)
            if op is None:
                break
            if (w := self.m.weight_of(op)) is not None:
                head = w if w[1] == hidden else None
                break
            live = [t for t in op.inputs if t and not self.m.is_constant(t)]
            if op.op_type not in ("Add", "Mul", "Div", "Reshape", "Cast", "Identity", "Squeeze") or not live:
                break
            tensor = live[0]
        if head is None:
            return (None, False) if embedding is None else (embedding[1], True)
        return head[2], embedding is not None and self._same(head[0], embedding[0])

    def embedding(self, hidden: int) -> tuple[str, int] | None:
        """The token embedding: a ``Gather`` from a ``[vocab, hidden]`` initializer by a graph input."""
        for op in self.g.ops():
            if op.op_type != "Gather" or len(op.inputs) < 2:
                continue
            info = self.g.initializers.get(op.inputs[0])
            if info is None or info.shape is None or len(info.shape) != 2 or info.shape[1] != hidden:
                continue
            if self._from_input(op.inputs[1]):
                return op.inputs[0], int(info.shape[0])
        return None

    def added_positions(self, hidden: int) -> bool:
        """Whether a constant ``[S, hidden]`` is added to the token embedding: a learned position
        table an exporter sliced and folded for the fixed length it traced."""
        embedding = self.embedding(hidden)
        if embedding is None:
            return False
        for op in self.g.ops():
            if op.op_type != "Gather" or op.inputs[0] != embedding[0]:
                continue
            tensor = op.outputs[0]
            for _ in range(4):
                readers = [self.g.op(c) for c in self.g.consumers.get(tensor, ())]
                for add in (r for r in readers if r.op_type == "Add"):
                    other = next((t for t in add.inputs if t != tensor), None)
                    shape = None if other is None else self.m.shape(other)
                    if other and self.m.is_constant(other) and shape and len(shape) >= 2:
                        if shape[-1] == hidden and shape[-2] >= 2:
                            return True
                scaled = [r for r in readers if r.op_type in ("Cast", "Mul", "Identity")]
                if len(scaled) != 1:
                    break
                tensor = scaled[0].outputs[0]
        return False

    def _from_input(self, tensor: str) -> bool:
        for _ in range(4):
            if tensor in self.g.inputs:
                return True
            op = self.m.producer(tensor)
            if op is None or op.op_type not in ("Cast", "Identity", "Reshape", "Unsqueeze"):
                return False
            tensor = op.inputs[0]
        return False

    def _same(self, head: str, embedding: str) -> bool:
        """Tied: one initializer, or the head's weight the embedding transposed (as exporters write
        a tied head: a second, transposed copy)."""
        if head == embedding:
            return True
        a, b = self.m.array(head), self.m.array(embedding)
        return a is not None and b is not None and a.shape == b.T.shape and bool(np.array_equal(a, b.T))


def _shown(value: float | None) -> float | None:
    """A fitted constant as a reader wants it (6 significant digits)."""
    return None if value is None else float(f"{value:.6g}")


def position_limit(graph: Graph, hidden: int) -> int | None:
    """Rows of the model's learned position table: the positions a request may hold (prompt and
    generated tokens fed back). None when there is none (rotary or sinusoidal positions have no table
    to run past)."""
    rows = [int(graph.initializers[op.inputs[0]].shape[0]) for op in position_tables(graph, hidden)]
    return min(rows) if rows else None


def position_tables(graph: Graph, hidden: int) -> list[OpNode]:
    """The ``Gather``s that read a learned position table: from an initializer ``[P, hidden]`` other
    than the token embedding (the one indexed by a graph input), by indices no activation chose (an
    expert's bias ``[E, hidden]`` gathered by the router's picks is no position table)."""
    token = _Layers(Matcher(graph)).embedding(hidden)
    return [
        op
        for op in graph.ops()
        if op.op_type == "Gather"
        and len(op.inputs) > 1
        and (token is None or op.inputs[0] != token[0])
        and (info := graph.initializers.get(op.inputs[0])) is not None
        and info.shape is not None
        and len(info.shape) == 2
        and info.shape[1] == hidden
        and not _chosen_by_activations(graph, op.inputs[1])
    ]


def _chosen_by_activations(graph: Graph, tensor: str) -> bool:
    """Whether ``tensor`` is computed from a product, a Softmax or a pick (TopK, ArgMax): indices a
    model's values chose, not positions."""
    stack, seen = [tensor], set()
    while stack and len(seen) < 256:
        node = graph.producer.get(stack.pop())
        if node is None or node in seen:
            continue
        seen.add(node)
        op = graph.op(node)
        if op.op_type in ("MatMul", "Gemm", "Softmax", "TopK", "ArgMax"):
            return True
        if op.op_type not in _SHAPE_ONLY:  # a shape carries no values
            stack.extend(t for t in op.inputs if t)
    return False


def recognize_llm(graph: Graph, *, name: str | None = None) -> LlmConfig:
    """The :class:`LlmConfig` of a decoder-only transformer ONNX model (see :func:`recognize_decoder`)."""
    return recognize_decoder(graph, name=name).config


def recognize_decoder(graph: Graph, *, name: str | None = None) -> Decoder:
    """The decoder-only transformer in ``graph``: its config, attention cores and block structure.

    Raises :class:`InputError` (exit 2) saying why when the graph is not one, naming the node where
    the match failed: no attention, no causal mask (an encoder such as BERT), cross-attention, no
    FFN, layers of different sizes, or metadata that contradicts the weights.
    """
    m = Matcher(graph)
    layers = _Layers(m)
    cores, failed = m.cores()
    check_cores(graph, cores, failed)
    check_causal(graph, m, cores)
    if (before := layers.before_attention(cores[0])) is not None:
        raise InputError(
            f"not a decoder-only transformer tessera decodes: a feed-forward block (its node {before}) "
            f"comes before the first attention ({cores[0].softmax}): a layer without attention (a "
            "recurrence, linear attention, a convolution) carries the sequence there",
            source=graph.source,
        )
    ffns: list[Ffn] = []
    for i, core in enumerate(cores):
        stop = (
            min(m.position[p] for p in cores[i + 1].projections) if i + 1 < len(cores) else len(graph.order)
        )
        found = layers.ffn(core, stop)
        if found is None:
            raise InputError(
                f"not a decoder-only transformer: attention {core.softmax} has no feed-forward block "
                f"after it (a MatMul {core.hidden}×F then F×{core.hidden})",
                source=graph.source,
            )
        ffns.append(found)
    first = cores[0]
    # Layers without rotary positions beside rotary ones (Exaone 4, SmolLM3: "NoPE" layers) are
    # one model; the rotary ones share one width.
    rotary = next((core.rotary_dim for core in cores if core.rotary_dim is not None), None)
    # A mixture of experts may keep a dense FFN in some layers (DeepSeek's and Ernie 4.5's first ones,
    # Llama 4's every other one): the layers then compare with the first of their own kind.
    experts = next((ffn for ffn in ffns if ffn.experts > 1), ffns[0])
    dense = [ffn for ffn in ffns if ffn.experts == 1] if experts.experts > 1 else []
    # KV heads may differ between layers (MiMo's windowed layers hold twice its global ones'): the KV
    # cache is held per layer as each writes it; the config counts the most any layer holds.
    for i, (core, ffn) in enumerate(zip(cores, ffns, strict=True)):
        kind = dense[0] if ffn.experts == 1 and dense else experts
        sizes = (core.hidden, core.heads, core.head_dim, core.rotary_dim or rotary, *ffn)
        want = (first.hidden, first.heads, first.head_dim, rotary, *kind)
        if sizes != want:
            other = ffns.index(kind)  # the first layer of this FFN's kind; attention compares with layer 0
            raise InputError(
                f"layers differ in size: layer {i} ({core.softmax}) has hidden, heads, head_dim, "
                f"rotary dim, ffn, gated, parallel, experts, experts per token, shared FFN = {sizes}, "
                f"layer 0{f' (the FFN: layer {other})' if other else ''} has {want}",
                source=graph.source,
            )
    if dense and (dense[0].gated, dense[0].parallel) != (experts.gated, experts.parallel):
        raise InputError(
            f"layer {ffns.index(dense[0])}'s dense FFN (gated {dense[0].gated}, parallel {dense[0].parallel}) and "
            f"layer {ffns.index(experts)}'s experts (gated {experts.gated}, parallel {experts.parallel}) differ "
            "in kind",
            source=graph.source,
        )
    vocab, tied = layers.vocab(first.hidden)
    if vocab is None:
        raise InputError(
            "cannot read the vocabulary size: no token-embedding Gather and no LM head", source=graph.source
        )
    found = {
        "layers": len(cores), "hidden": first.hidden, "heads": first.heads,
        "kv_heads": max(core.kv_heads for core in cores),
        "head_dim": first.head_dim, "ffn": experts.width, "vocab": vocab,
    }  # fmt: skip
    meta = {p.key: p.value for p in graph.model.metadata_props}
    for key, value in found.items():
        given = meta.get(f"tessera.{key}")
        if given is not None and given.strip().isdigit() and int(given) != value:
            raise InputError(
                f"metadata tessera.{key}={given} disagrees with the graph's structure, which gives {value}",
                source=graph.source,
            )
    config = LlmConfig(
        name=name or meta.get("tessera.model") or graph.model.graph.name or "onnx-model",
        dtype=first.dtype,  # type: ignore[arg-type]
        gated_ffn=experts.gated,
        tied_embeddings=tied,
        experts=experts.experts,
        experts_per_token=experts.experts_per_token,
        shared_ffn=experts.shared,
        dense_layers=len(dense),
        dense_ffn=dense[0].width if dense else 0,
        **found,
    )
    return Decoder(
        config=config,
        cores=tuple(cores),
        positions=position_limit(graph, first.hidden),
        rotary_dim=rotary,
        norm=layers.norm(first),
        parallel_residual=experts.parallel,
        qkv="fused" if len(first.projections) == 1 else "separate",
        fixed_length=fixed_length(graph, m),
        position_constant=layers.added_positions(first.hidden),
    )
