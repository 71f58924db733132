"""Decode from a decoder's own ONNX graph: everything the exporter wrote (embeddings, norms, rotary,
MLP, head) runs as written in the torch interpreter, and each recognized attention core's output is
replaced by attention over a KV cache, which the caller's ``attend`` owns (whole, a rank's heads, or a
rank's KV shard: executor/decode_worker.py). Positions: the graph's position ``Range``s are offset by
the tokens already cached. Matching and limits: docs/executor.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx
import torch
from torch import Tensor

from tessera.backends.torch_module import NodeHook, OnnxModule, to_torch
from tessera.backends.torch_ops.attention import heads_first
from tessera.backends.torch_ops.collectives import use_group
from tessera.core.errors import InputError
from tessera.core.graph import Graph
from tessera.core.tensor_parallel import TpSplit, tensor_parallel
from tessera.core.tp_program import local_model
from tessera.core.weights import is_lazy, materialize
from tessera.planners.cp.recognize import Decoder
from tessera.planners.cp.scores import ScoreMod, input_role

__all__ = ["DECODE_GROUP", "Attend", "GraphDecoder", "Reduce"]

# attend(layer, q, k, v, scores, past) -> o: q, k, v, o [B, H, S, D] (K and V as the graph hands them
# to the core: rotary applied, grouped-query heads repeated, or one head to broadcast); ``scores``:
# what the graph does to Q·Kᵀ (scale, soft-cap, ALiBi, window); S new tokens after ``past`` cached.
Attend = Callable[[int, Tensor, Tensor, Tensor, ScoreMod, int], Tensor]
Observer = Callable[[str, Sequence[Tensor]], None]
Reduce = Callable[[Tensor], Tensor]  # every tensor-parallel rank's partial sums, summed
DECODE_GROUP = "decode"  # the collectives' group name of a sharded decoder (shard())
_POSITION_OPS = ("Range", "CumSum")
_PROBES = (3, 5)  # the sequence lengths the graph is run at to find its positions


@dataclass(frozen=True)
class _Core:
    qk: str  # the Q·Kᵀ MatMul: its inputs are Q [B, H, S, D] and Kᵀ [B, H, D, S]
    av: str  # the ·V MatMul: its output is replaced
    scores: ScoreMod  # what the graph does to Q·Kᵀ before the Softmax (evaluated at recognition)
    sink_scale: tuple[str, int] | None = None  # a Mul by sigmoid(lse − sink): passes that input on


class GraphDecoder:
    """An exported decoder's graph as a decode step: ``logits(tokens, past, attend)``."""

    def __init__(self, graph: Graph, decoder: Decoder) -> None:
        self.label = graph.source
        self.side = _side_inputs(graph)  # an attention mask (all ones), positions (past + 0..S-1)
        tokens = [name for name in graph.inputs if name not in self.side]
        if len(tokens) != 1 or not graph.inputs[tokens[0]].dtype.startswith("int"):
            raise InputError(
                f"decoding feeds token ids, and optionally an attention mask and position ids; the model has "
                f"{len(graph.inputs)} input(s) ({', '.join(graph.inputs)}), of which {len(tokens)} other than "
                "a mask or positions: export it with input_ids (and attention_mask) alone",
                source=self.label,
            )
        self.token_input = tokens[0]
        self.fixed_batch = graph.fixed_batch.get(self.token_input)  # requests per pass; None: any
        self.logits_output = next(iter(graph.outputs))
        model = materialize(graph.model) if is_lazy(graph.model) else graph.model
        self.module: OnnxModule = to_torch(model, label=self.label).train(False)
        self.vocab = decoder.config.vocab
        # An Attention operator's head counts, for 3-D inputs ([B, S, H·D]).
        self.op_heads = {
            core.av_matmul: (core.heads, int(graph.op(core.av_matmul).attributes.get("kv_num_heads", 0) or 0))
            for core in decoder.cores
            if core.qk_matmul == core.av_matmul
        }
        self.cores = [
            _Core(core.qk_matmul, core.av_matmul, mod, core.sink_scale)
            for core, mod in zip(decoder.cores, decoder.scores, strict=True)
        ]
        # a sink's scaling Mul -> its input that is the attention's output, passed on (the sink is in
        # the attention: ScoreMod.sinks)
        self.passed = dict(core.sink_scale for core in self.cores if core.sink_scale is not None)
        self.needed = _needed(
            graph.producer, lambda n: graph.op(n).inputs, decoder, self.logits_output, self.passed
        )
        self.sharded: frozenset[int] = frozenset()  # the cores whose heads this rank alone holds (shard())
        self.reduces: frozenset[str] = frozenset()  # a sharded rank's all-reduces of partial sums
        self.reduce: Reduce | None = None  # and what sums them
        self.programs: dict[tuple[int, int], Any] = {}  # (batch, new tokens) -> its StepProgram
        gathers = {  # positions index some (a learned table, a rotary cache, GPT-J's sin/cos rows)
            op.name: int(op.attributes.get("axis", 0))
            for op in graph.ops()
            if op.op_type in ("Gather", "GatherElements")
            or op.op_type == "GatherND"
            and not op.attributes.get("batch_dims", 0)  # rows of axis 0
        }
        try:
            found, tables = self._probe(gathers)
        except RuntimeError as exc:  # the graph runs only at the sequence length it was exported at
            declared = graph.declared_shapes.get(self.token_input) or ()
            fixed = f" of {declared[1]}" if len(declared) == 2 and isinstance(declared[1], int) else ""
            why = " ".join(str(exc).removeprefix(f"{self.label}: ").split())[:160]
            raise InputError(
                f"the model runs only at its exported sequence length{fixed} ({why}), "
                "but decoding feeds one token at a time: export with a dynamic sequence axis (dynamic_axes="
                f"{{{self.token_input!r}: {{0: 'batch', 1: 'sequence'}}}}, or dynamic_shapes= with the dynamo "
                "exporter)",
                source=self.label,
            ) from None
        self.positions = [name for name in found if name in self.needed]
        fed = any(kind == "positions" for kind, _ in self.side.values())  # position ids as an input
        if (
            not self.positions
            and not fed
            and (decoder.positions is not None or decoder.rotary_dim is not None)
        ):
            raise InputError(
                "cannot find where the graph counts token positions (a Range or CumSum over the sequence "
                "that its position embedding reads): decoding could not place new tokens",
                source=self.label,
            )
        # The positions a request may hold: the rows of each table the positions index (a learned
        # table, a rotary cache) less the row position 0 reads there (OPT's 2), and the recognized
        # limit; None: no limit.
        rows = [size - first for first, size in tables.values()]
        self.max_positions = min([*rows, *filter(None, [decoder.position_limit])], default=None)

    def shard(self, graph: Graph, decoder: Decoder, t: int, index: int, reduce: Reduce) -> None:
        """Make this decoder rank ``index`` of ``t`` tensor-parallel ranks: it holds its block of every
        product the dataflow split finds among what the logits need (:mod:`tessera.core.tensor_parallel`:
        column-parallel Q/K/V and up, row-parallel O and down), runs its copy of the graph
        (:func:`~tessera.core.tp_program.local_model`), and sums the row products' partial sums with
        ``reduce`` (every rank's, in one order; a bf16 model's in fp32, rounded once). The cores inside
        a split attend with this rank's heads alone (``sharded``); the others see every head.
        ``graph``, ``decoder``: what it was built from."""
        keep, split = self.tp_split(graph, t)
        if not split.regions:
            return
        model = local_model(graph, keep, split, index, group=DECODE_GROUP, widen=True)
        use_group(DECODE_GROUP, reduce)
        self.reduce = reduce
        device = next(iter(self.module.initializers().values())).device
        self.module = to_torch(model, label=self.label).train(False).to(device)
        producer = {o: node.name for node in model.graph.node for o in node.output if o}
        inputs = {node.name: tuple(node.input) for node in model.graph.node}
        self.needed = _needed(producer, inputs.__getitem__, decoder, self.logits_output, self.passed)
        self.sharded = frozenset(layer for layer, core in enumerate(self.cores) if core.av in split.nodes)
        self.reduces = frozenset(n.name for n in model.graph.node if n.op_type == "TpReduce") & self.needed
        for layer in self.sharded:  # the core's per-head scores and an operator's head counts: this rank's
            core = self.cores[layer]
            self.cores[layer] = replace(core, scores=_heads_of(core.scores, t, index))
            if core.av in self.op_heads:
                self.op_heads[core.av] = tuple(h // t for h in self.op_heads[core.av])  # type: ignore[assignment]

    def tp_split(self, graph: Graph, t: int) -> tuple[frozenset[str], TpSplit]:
        """The nodes of ``graph`` the logits need (the graph's own attention included) and their
        ``t``-way tensor-parallel split, the logits whole: what :meth:`shard` holds."""
        end = graph.producer[self.logits_output]
        keep = frozenset(nx.ancestors(graph.dag, end)) | {end}
        return keep, tensor_parallel(graph, t, within=keep, outputs=(self.logits_output,))

    @torch.no_grad()
    def logits(self, tokens: Tensor, past: int, attend: Attend) -> Tensor:
        """``[B, S, vocab]`` logits of ``tokens`` ``[B, S]`` at positions ``past .. past + S - 1``:
        the step's program where one was compiled (:func:`~tessera.executor.decode_program.compile_step`),
        else the graph interpreted."""
        program = self.programs.get(tuple(tokens.shape))
        if program is not None:
            return self._checked(program.run(tokens, past, attend))
        return self.interpret(tokens, past, attend)

    @torch.no_grad()
    def interpret(self, tokens: Tensor, past: int, attend: Attend, observe: Observer | None = None) -> Tensor:
        """:meth:`logits`, the graph run node by node (each core's output replaced by ``attend``);
        ``observe(node, outputs)`` sees what every node the step runs hands on."""
        hooks: dict[str, NodeHook] = {name: _offset(past) for name in self.positions}
        batch = tokens.shape[0]
        for layer, core in enumerate(self.cores):
            if core.qk == core.av:  # an Attention operator: Q, K, V are its inputs
                hooks[core.av] = _op_hook(self, layer, attend, past, batch)
                continue
            held: dict[str, Tensor] = {}
            hooks[core.qk] = _keep(held)
            hooks[core.av] = _av_hook(self, layer, held, attend, past, batch)
        for mul, kept in self.passed.items():  # attend applied the sink: the output passes on
            hooks[mul] = lambda args, outs, kept=kept: (args[kept],)
        if observe is not None:
            hooks = {name: _observed(name, hooks.get(name), observe) for name in self.needed}
        out = self.module.run(
            self.feeds(tokens, past), after=hooks, only=self.needed, tensors=(self.logits_output,)
        )[self.logits_output]  # the other outputs (a KV cache the export returns) are not computed
        return self._checked(out)

    def core_output(
        self, layer: int, a: Tensor, b: Tensor, v: Tensor, attend: Attend, past: int, batch: int
    ) -> Tensor:
        """What core ``layer``'s output node computes, as attention over the cache: ``a``, ``b``,
        ``v`` its Q·Kᵀ MatMul's inputs (Q, Kᵀ) and V, or an Attention operator's Q, K, V. Cores whose
        heads are folded into the batch (``[B·H, S, D]``, as a ``baddbmm`` exports) attend as
        ``[B, H, S, D]``; an operator's grouped KV heads are repeated to the query heads, as it does."""
        core = self.cores[layer]
        if core.qk != core.av:
            q, k = a, b.transpose(-1, -2)
            if q.dim() == 3:
                q, k, v = (t.reshape(batch, -1, *t.shape[1:]) for t in (q, k, v))
                o = attend(layer, q, k, v, core.scores, past)
                return o.reshape(-1, *o.shape[2:]).to(v.dtype)
            return attend(layer, q, k, v, core.scores, past).to(v.dtype)
        heads, kv_heads = self.op_heads[core.av]
        q = heads_first(a, heads)
        k, v_ = (heads_first(t, kv_heads) for t in (b, v))
        if 1 < k.shape[1] < q.shape[1]:  # one KV head is broadcast; more are repeated per group
            k, v_ = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v_))
        o = attend(layer, q, k, v_, core.scores, past).to(v.dtype)
        return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1) if a.dim() == 3 else o

    def _checked(self, out: Tensor) -> Tensor:
        if out.dim() != 3 or out.shape[-1] != self.vocab:
            raise InputError(
                f"output {self.logits_output!r} is {tuple(out.shape)}, not [batch, sequence, {self.vocab}] "
                "logits",
                source=self.label,
            )
        return out

    def feeds(self, tokens: Tensor, past: int) -> dict[str, Tensor]:
        """The graph's inputs for ``tokens`` at positions ``past ..``: an all-ones mask over the new
        tokens (the cache's attention does the masking), position ids counted from ``past``."""
        feeds = {self.token_input: tokens}
        b, s = tokens.shape
        for name, (kind, dtype) in self.side.items():
            if kind == "mask":
                feeds[name] = torch.ones(b, s, dtype=dtype, device=tokens.device)
            else:
                feeds[name] = torch.arange(past, past + s, device=tokens.device).to(dtype).expand(b, s)
        return feeds

    def _probe(self, gathers: dict[str, int]) -> tuple[list[str], dict[str, tuple[int, int]]]:
        """The graph run as written at two lengths (:data:`_PROBES`): the ``Range``/``CumSum`` nodes
        that count the sequence's positions (0..S-1, or 1..S: their output follows the length), and
        of the ``gathers`` (name: axis) those that read a table by position (rows o..o+S-1 at both
        lengths, for one o, of a table whose size does not follow the length): (o, the table's
        rows)."""
        seen: dict[str, list[bool]] = {}
        read: dict[str, list[tuple[int, int] | None]] = {}  # per run: (first row, rows) if positions
        types = self.module.node_types()

        def whole(
            args: Sequence[Tensor | None], outs: tuple[Tensor, ...], node: str, s: int
        ) -> tuple[Tensor, ...]:
            flat = outs[0].reshape(-1)
            counts = flat.numel() == s and bool(
                torch.equal(flat, torch.arange(s, dtype=flat.dtype))
                or torch.equal(flat, torch.arange(1, s + 1, dtype=flat.dtype))
            )
            seen.setdefault(node, []).append(counts)
            return outs

        def indexed(
            args: Sequence[Tensor | None], outs: tuple[Tensor, ...], node: str, s: int
        ) -> tuple[Tensor, ...]:
            data, index = args[0], args[1]
            if index is not None and index.dim() and types[node] == "GatherND":
                index = index if index.shape[-1] == 1 else None  # one index: a row of axis 0
            rows = torch.unique(index) if data is not None and index is not None and index.numel() else None
            counted = rows is not None and len(rows) == s and int(rows[-1] - rows[0]) == s - 1
            size = data.shape[gathers[node]] if data is not None and data.dim() else 0
            read.setdefault(node, []).append((int(rows[0]), size) if counted and rows is not None else None)
            return outs

        candidates = [name for name, op in types.items() if op in _POSITION_OPS]
        for s in _PROBES:
            hooks: dict[str, NodeHook] = {
                name: (lambda a, o, name=name, s=s: whole(a, o, name, s)) for name in candidates
            }
            hooks.update({name: (lambda a, o, name=name, s=s: indexed(a, o, name, s)) for name in gathers})
            for core in self.cores:  # the probe runs the graph as written: its own attention
                hooks.pop(core.av, None)
            self.module.run(self.feeds(torch.zeros(1, s, dtype=torch.long), 0), after=hooks)
        first = {
            name: runs[0]
            for name, runs in read.items()
            if len(runs) == len(_PROBES) and runs[0] is not None and len(set(runs)) == 1
        }
        return [name for name, runs in seen.items() if len(runs) == 2 and all(runs)], first


def _heads_of(scores: ScoreMod, t: int, index: int) -> ScoreMod:
    """``scores`` of rank ``index``'s block of the heads (of ``t`` equal blocks): its slopes and sinks."""

    def block(values: tuple[float, ...] | None) -> tuple[float, ...] | None:
        per = len(values) // t if values is not None else 0
        return values[index * per : (index + 1) * per] if values is not None else None

    return replace(scores, alibi=block(scores.alibi), sinks=block(scores.sinks))


def _side_inputs(graph: Graph) -> dict[str, tuple[str, torch.dtype]]:
    """The inputs besides the token ids decoding feeds: ``{name: ("mask" | "positions", dtype)}``,
    told by name (attention_mask, position_ids as transformers exports them) and a ``[batch, seq]``
    shape."""
    return {
        name: (input_role(name), getattr(torch, info.dtype, torch.float32))
        for name, info in graph.inputs.items()
        if input_role(name) != "tokens" and info.shape is not None and len(info.shape) == 2
    }


def _needed(
    producer: Mapping[str, str],
    inputs_of: Callable[[str], Sequence[str]],
    decoder: Decoder,
    output: str,
    scaled: dict[str, int],
) -> frozenset[str]:
    """The nodes the logits need once each core's output is attention over Q, K and V: the masks,
    scores and Softmaxes of the graph's own attention are not run (nor the positions they index), nor
    what a sink's scaling ``Mul`` (``scaled``: the input it passes on) multiplies by. ``producer``:
    tensor → node, ``inputs_of``: node → its inputs (the whole graph's, or a rank's copy of it)."""
    replaced = {core.av_matmul: core.qk_matmul for core in decoder.cores}
    needed: set[str] = set()
    stack = [output]
    while stack:
        node = producer.get(stack.pop())
        if node is None or node in needed:
            continue
        needed.add(node)
        inputs = inputs_of(node)
        if node in replaced and replaced[node] == node:  # an Attention operator: Q, K, V (no mask)
            inputs = inputs[:3]
        elif node in replaced:  # ·V: V, and the Q·Kᵀ MatMul that hands Q and Kᵀ to the hook
            needed.add(replaced[node])
            inputs = (inputs[1], *inputs_of(replaced[node]))
        elif node in scaled:  # a sink's scaling: the attention's output alone
            inputs = (inputs[scaled[node]],)
        stack.extend(t for t in inputs if t)
    return frozenset(needed)


def _observed(name: str, hook: NodeHook | None, observe: Observer) -> NodeHook:
    def observed(args: Sequence[Tensor | None], outs: tuple[Tensor, ...]) -> Sequence[Tensor]:
        outs = tuple(outs if hook is None else hook(args, outs))
        observe(name, outs)
        return outs

    return observed


def _offset(past: int) -> NodeHook:
    return lambda args, outs: (outs[0] + past, *outs[1:])


def _keep(held: dict[str, Tensor]) -> NodeHook:
    def hook(args: Sequence[Tensor | None], outs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        assert args[0] is not None and args[1] is not None
        held["q"], held["kt"] = args[0], args[1]
        return outs

    return hook


def _av_hook(
    decoder: GraphDecoder, layer: int, held: dict[str, Tensor], attend: Attend, past: int, batch: int
) -> NodeHook:
    """The hook on a core's ·V MatMul: attention over the cache in its place."""

    def hook(args: Sequence[Tensor | None], outs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        assert args[1] is not None
        return (decoder.core_output(layer, held.pop("q"), held.pop("kt"), args[1], attend, past, batch),)

    return hook


def _op_hook(decoder: GraphDecoder, layer: int, attend: Attend, past: int, batch: int) -> NodeHook:
    """The hook on an ``Attention`` operator: attention over the cache in its place."""

    def hook(args: Sequence[Tensor | None], outs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        q, k, v = args[:3]
        assert q is not None and k is not None and v is not None
        return (decoder.core_output(layer, q, k, v, attend, past, batch),)

    return hook
