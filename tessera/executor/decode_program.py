"""A decode step compiled: the decoder's graph at one (batch, new tokens) shape as one torch.fx
program of aten operations, with no per-node Python left.

The graph is run once at that shape; every value that depends on shapes and constants only (the
exporter's Shape/Gather/Concat arithmetic, the attention mask input, position ``Range``s before
their offset) is folded to a constant. The rest is traced with ``make_fx`` into aten operations;
each attention core is one call back into the caller's ``attend`` (the KV cache). The program is
checked against the interpreted graph at other tokens and positions before it is used: a value the
trace would have frozen refuses the program. Details: docs/executor.md ("Compiled decode steps").
"""

from __future__ import annotations

import copy
import itertools
import types
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, fx
from torch._library.custom_ops import get_library_allowing_overwrite
from torch.fx.experimental.proxy_tensor import make_fx

from tessera.executor.kv_cache import attention_partial
from tessera.planners.cp.cost import TpLaunch
from tessera.planners.cp.scores import ScoreMod

if TYPE_CHECKING:
    from tessera.core.graph import Graph
    from tessera.executor.graph_decoder import Attend, GraphDecoder
    from tessera.planners.cp.llm import LlmConfig

__all__ = [
    "GATHER_OPERATIONS",
    "REDUCE_OPERATIONS",
    "SCORED_OPERATIONS",
    "TP_DEGREES",
    "StepProgram",
    "Untraceable",
    "compile_step",
    "scored_operations",
    "self_attention",
    "step_operations",
    "tp_launch",
]

# Float initializers above this many elements are weights, read by the program; smaller ones
# (epsilons, scales, shape constants) fold with the shape arithmetic they meet.
WEIGHT_NUMEL = 4096
# What a decode step runs besides its program's aten calls, in operations of about the same cost:
# each core's callback (the cache write and read, the attention call, the layout changes) and the
# step's own (the positions tensor, the argmax, the tokens read back).
CORE_OPERATIONS = 12
STEP_OPERATIONS = 6
# What a gathered tp core (one the model's split does not reach) and a cp rank's core add to that
# (graph_decode_worker: the heads sliced and the outputs concatenated; the log-sum-exp column and the merge), with the gather's copies in and out: 48 and
# 74 us a layer over a dp core's 9 us, timed apart on a 2-core AMD EPYC VM (torch 2.13.0,
# 2026-11-29), in operations of the decode step's own (4.6 us there).
GATHER_OPERATIONS = (10, 16)
# What a core whose scores are not plain adds on a dp rank (kv_cache.whole_decode): a window reads
# the last slots (2 operations), ALiBi passes its bias to the fused kernel (6), soft-capping takes a
# softmax in fp32 (8), a sink the unfused scored path (16); timed on a 2-core AMD EPYC VM (torch
# 2.13.0, 2026-11-30) against the fused kernel's plain core, in operations of the step's own.
SCORED_OPERATIONS = {"sinks": 16, "softcap": 8, "alibi": 6, "window": 2}
# What each all-reduce of a sharded tp rank's partial sums adds (GraphDecoder.shard): the exchange's
# copies in and out, the stack's view, the sum and its cast, counted (not timed apart); with it the
# tp x2 rows of bench/results/decode_launch.md are predicted within 25% on 8 of 8 traced, 7 compiled.
REDUCE_OPERATIONS = 6
TP_DEGREES = (2, 4, 8)  # the tp degrees a plan records what the launch splits at (tp_launch)
_SHAPE_OPS = ("Shape", "Size")  # their outputs are fixed by the step's shapes
_PROGRAMS: weakref.WeakValueDictionary[int, StepProgram] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


class Untraceable(Exception):
    """The step cannot be compiled (the message says why); the graph is interpreted instead."""


def _call_core(a: Tensor, b: Tensor, v: Tensor, program: int, layer: int) -> Tensor:
    """A core's output: attention over the cache through the running step's ``attend``."""
    return _PROGRAMS[program].core(layer, a, b, v)


def _call_reduce(x: Tensor, program: int) -> Tensor:
    """A tensor-parallel rank's partial sums, every rank's summed (GraphDecoder.shard)."""
    return _PROGRAMS[program].decoder.reduce(x)


def _core_shape(a: Tensor, b: Tensor, v: Tensor, program: int, layer: int) -> Tensor:
    return _PROGRAMS[program].core_shape(layer, a, b, v)


def _operator(name: str, schema: str, kernel: Any, fake: Any) -> torch.library.Library:
    """``tessera::name``, whose kernel is ``kernel`` (Python), defined with torch.library's
    low-level API: a call costs 3 us where torch.library.custom_op's checked wrapper costs 10 (a
    decode step calls one a core and one an all-reduce). A module imported again replaces its
    operators, as custom_op does (through the same registry)."""
    lib = get_library_allowing_overwrite("tessera", name)
    lib.define(name + schema)
    lib.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"tessera::{name}", fake, lib=lib)
    return lib


# The two operators a traced step calls back through.
_LIBRARIES = (
    _operator(
        "attend_core",
        "(Tensor a, Tensor b, Tensor v, int program, int layer) -> Tensor",
        _call_core,
        _core_shape,
    ),
    _operator(
        "reduce_partials",
        "(Tensor x, int program) -> Tensor",
        _call_reduce,
        lambda x, program: torch.empty_like(x),
    ),
)


def compile_step(decoder: GraphDecoder, batch: int, length: int, *, inductor: bool = False) -> str | None:
    """Trace ``decoder``'s step of ``batch`` requests of ``length`` new tokens into a program it then
    runs (``inductor``: compiled further by torch.compile); None when it is used, else why that
    step stays interpreted."""
    try:
        decoder.programs[(batch, length)] = StepProgram(decoder, batch, length, inductor=inductor)
    except Untraceable as exc:
        return str(exc)
    return None


def step_operations(decoder: GraphDecoder) -> int | None:
    """The operations one batch-1 decode step of ``decoder`` runs (its traced program's, each core
    and the step counted as above, a core of scored attention more): what the cp cost model
    charges per step. None where the step cannot be traced."""
    if (1, 1) not in decoder.programs and compile_step(decoder, 1, 1) is not None:
        return None
    program = decoder.programs[(1, 1)]
    scored = sum(scored_operations(core.scores) for core in decoder.cores)
    return program.operations + len(decoder.cores) * (CORE_OPERATIONS - 1) + scored + STEP_OPERATIONS


def scored_operations(scores: ScoreMod) -> int:
    """What a core scored as ``scores`` adds to a plain one (the costliest of its modifications)."""
    kinds = (
        ("sinks", scores.sinks),
        ("softcap", scores.softcap),
        ("alibi", scores.alibi),
        ("window", scores.window),
    )
    return next((SCORED_OPERATIONS[k] for k, present in kinds if present is not None), 0)


def tp_launch(decoder: GraphDecoder, graph: Graph, llm: LlmConfig, t: int) -> TpLaunch:
    """What a ``t``-way tp launch of ``decoder`` (built from ``graph``) splits
    (:meth:`GraphDecoder.shard`), in the cost model's terms."""
    _, split = decoder.tp_split(graph, t)
    held = sum(graph.initializers[w].numel for w in split.weights)
    sharded = sum(1 for core in decoder.cores if core.av in split.nodes)
    return TpLaunch(
        t,
        whole=max(0.0, 1 - held / (llm.layers * llm.layer_params)),
        gathered=1 - sharded / max(len(decoder.cores), 1),
        reduces=sum(len(r.rows) for r in split.regions) / llm.layers,
    )


def self_attention(layer: int, q: Tensor, k: Tensor, v: Tensor, scores: ScoreMod, past: int) -> Tensor:
    """Attention of the new tokens over themselves alone (no cache), as the graph scores them: the
    stateless ``attend`` a program is traced and checked with."""
    pos = torch.arange(past, past + q.shape[2], device=q.device)
    return attention_partial(q, k, v, pos, pos, scores)[0]


class StepProgram:
    """``run(tokens, past, attend)``: the decoder's logits for ``tokens`` ``[batch, length]`` at
    positions ``past ..``, each core attending through ``attend`` (as :meth:`GraphDecoder.logits`)."""

    def __init__(self, decoder: GraphDecoder, batch: int, length: int, *, inductor: bool = False) -> None:
        self.decoder, self.batch, self.length = decoder, batch, length
        self.handle = next(_HANDLES)
        _PROGRAMS[self.handle] = self
        self._attend: Attend = self_attention
        self._past = 0
        device = next(iter(decoder.module.initializers().values())).device
        self.shapes: dict[int, tuple[int, ...]] = {}  # layer -> its core's output shape (traced)
        self.graph_module = _finished(self._trace(device), keep_cores=inductor)
        self.program: Any = self.graph_module
        if inductor:  # C++ kernels for everything between the cores (torch.compile, fixed shapes)
            self.program = torch.compile(self.graph_module, fullgraph=True, dynamic=False)
        self._check(device)
        if not inductor:
            self.program = self._bound(device)

    def _bound(self, device: torch.device) -> fx.GraphModule:
        """The program calling torch's own bindings of its operators (:func:`_bindings`), where
        they compute the same bits as the traced program; else the traced program."""
        bound = _bindings(self.graph_module)
        tokens, past = self._example(0, device)
        with torch.no_grad():
            want = self.run(tokens, int(past), self_attention)
            self.program = bound
            try:
                same = torch.equal(self.run(tokens, int(past), self_attention), want)
            except RuntimeError:
                same = False
        return bound if same else self.graph_module

    def run(self, tokens: Tensor, past: int, attend: Attend) -> Tensor:
        return self.run_at(tokens, torch.tensor(past, device=tokens.device), past, attend)

    def run_at(self, tokens: Tensor, at: Tensor, past: int, attend: Attend) -> Tensor:
        """:meth:`run` with the position also as a tensor ``at`` on the tokens' device (a buffer a
        captured step reads; ``past`` is what ``attend`` is told)."""
        self._attend, self._past = attend, past
        try:
            return self.program(tokens, at)
        finally:
            self._attend = self_attention

    def core(self, layer: int, a: Tensor, b: Tensor, v: Tensor) -> Tensor:
        out = self.decoder.core_output(layer, a, b, v, self._attend, self._past, self.batch)
        self.shapes.setdefault(layer, tuple(out.shape))
        return out

    def core_shape(self, layer: int, a: Tensor, b: Tensor, v: Tensor) -> Tensor:
        """A core's output without running it (what torch.compile traces with): its traced shape."""
        return v.new_empty(self.shapes[layer])

    @property
    def operations(self) -> int:
        """The aten operations one run calls (attention cores included)."""
        return sum(1 for n in self.graph_module.graph.nodes if n.op == "call_function")

    # -- building --

    @torch.no_grad()
    def _trace(self, device: torch.device) -> fx.GraphModule:
        d = self.decoder
        values, static = _fold(d, self._example(0, device), 0, self.batch)
        dynamic = [s for s in d.module.steps() if s.name in d.needed and not static.get(s.name, False)]
        read = {t for s in dynamic for t in s.inputs if t}
        consts = {t: values[t] for t in read if t in values and static.get(f"tensor:{t}", False)}
        weights = {t: w.detach() for t, w in d.module.initializers().items() if t in read and t not in consts}
        qk = {c.qk: layer for layer, c in enumerate(d.cores) if c.qk != c.av}
        av = {c.av: layer for layer, c in enumerate(d.cores)}
        positions = set(d.positions)
        counts = {
            s.name: values[s.outputs[0]]
            for s in dynamic
            if s.name in positions and all(static.get(f"tensor:{t}", False) for t in s.inputs if t)
        }
        handle = self.handle

        def step(tokens: Tensor, past: Tensor) -> Tensor:
            env: dict[str, Tensor] = {**consts, **weights, d.token_input: tokens}
            for name, (kind, dtype) in d.side.items():
                if kind == "positions":
                    count = torch.arange(self.length, device=tokens.device) + past
                    env[name] = count.to(dtype).expand(self.batch, self.length)
            held: dict[int, tuple[Tensor, Tensor]] = {}
            for s in dynamic:
                args = [env.get(t) if t else None for t in s.inputs]
                if s.name in qk:
                    held[qk[s.name]] = (args[0], args[1])  # type: ignore[assignment]
                    continue
                if s.name in av:
                    layer = av[s.name]
                    a, b, v = (*held.pop(layer), args[1]) if layer in held else args[:3]
                    env[s.outputs[0]] = torch.ops.tessera.attend_core(a, b, v, handle, layer)
                    continue
                if s.name in d.passed:  # a sink's scaling: attend applied the sink
                    env[s.outputs[0]] = args[d.passed[s.name]]  # type: ignore[assignment]
                    continue
                if s.name in d.reduces:  # a tensor-parallel rank's partial sums, every rank's summed
                    env[s.outputs[0]] = torch.ops.tessera.reduce_partials(args[0], handle)
                    continue
                if s.name in counts:  # positions counted from shapes: offset by the tokens cached
                    results = [counts[s.name]]
                else:
                    result = s.fn(args, s.attrs)
                    results = list(result) if isinstance(result, tuple) else [result]
                if s.name in positions:  # counted where shapes are (the CPU): moved to the step's device
                    results[0] = results[0].to(past.device) + past.to(results[0].dtype)
                env.update((t, r) for t, r in zip(s.outputs, results, strict=False) if t)
            return env[d.logits_output]

        try:
            return make_fx(step, tracing_mode="real")(*self._example(0, device))
        except Exception as exc:  # data-dependent Python in an operator: it stays interpreted
            raise Untraceable(f"tracing the step failed: {type(exc).__name__}: {str(exc)[:200]}") from None

    def _example(self, seed: int, device: torch.device) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.decoder.vocab, (self.batch, self.length), generator=g)
        # Positions the step can take: within a position table, when the model has one.
        limit = self.decoder.max_positions
        room = 3 + 5 * 2 if limit is None else max(0, limit - self.length)
        past = (min(3, room), room, room // 2)[seed]
        return tokens.to(device), torch.tensor(past, device=device)

    def _check(self, device: torch.device) -> None:
        """The program against the interpreted graph at other tokens and positions: anything the
        trace froze that should have followed them shows here, and the program is refused."""
        for seed in (1, 2):
            tokens, past = self._example(seed, device)
            try:
                want = self.decoder.interpret(tokens, int(past), self_attention)
                with torch.no_grad():
                    got = self.run(tokens, int(past), self_attention)
            except RuntimeError as exc:  # the graph itself fails there: no program to trust
                raise Untraceable(f"checking the traced step failed: {str(exc)[:200]}") from None
            finite = want[torch.isfinite(want)]  # a graph may compute NaN (Helium: a zero row's RMSNorm)
            scale = float(finite.abs().max()) if finite.numel() else 0.0
            if got.shape != want.shape or not torch.allclose(
                got, want, rtol=1e-4, atol=1e-5 * scale, equal_nan=True
            ):
                raise Untraceable(
                    "the traced step differs from the graph at other tokens or positions "
                    f"(max difference {float((got - want).abs().max()):.3g}): a value was frozen"
                )


def _fold(
    decoder: GraphDecoder, example: tuple[Tensor, Tensor], past: int, batch: int
) -> tuple[dict[str, Tensor], dict[str, bool]]:
    """Run the step's nodes once; return every tensor's value and which nodes and tensors are
    static (``static[node]``, ``static["tensor:" + name]``): fixed by the step's shapes alone."""
    d = decoder
    tokens = example[0]
    inits = {t: w.detach() for t, w in d.module.initializers().items()}
    values: dict[str, Tensor] = dict(inits)
    static: dict[str, bool] = {
        f"tensor:{t}": not (w.is_floating_point() and w.numel() > WEIGHT_NUMEL) for t, w in inits.items()
    }
    feeds = d.feeds(tokens, past)
    values.update(feeds)
    for name in feeds:
        static[f"tensor:{name}"] = d.side.get(name, ("tokens",))[0] == "mask"  # ones of a fixed shape
    qk = {c.qk: layer for layer, c in enumerate(d.cores) if c.qk != c.av}
    av = {c.av: layer for layer, c in enumerate(d.cores)}
    held: dict[int, tuple[Tensor, Tensor]] = {}
    for s in d.module.steps():
        if s.name not in d.needed:
            continue
        args = [values.get(t) if t else None for t in s.inputs]
        if s.name in qk:
            held[qk[s.name]] = (args[0], args[1])  # type: ignore[assignment]
            static[s.name] = False
            continue
        if s.name in av:
            layer = av[s.name]
            a, b, v = (*held.pop(layer), args[1]) if layer in held else (args[0], args[1], args[2])
            out = d.core_output(layer, a, b, v, self_attention, past, batch)  # type: ignore[arg-type]
            results = [out]
            static[s.name] = False
        elif s.name in d.passed:  # a sink's scaling: attend applied the sink
            results = [args[d.passed[s.name]]]
            static[s.name] = False
        else:
            result = s.fn(args, s.attrs)
            results = list(result) if isinstance(result, tuple) else [result]
            fixed = s.op_type in _SHAPE_OPS or all(static.get(f"tensor:{t}", False) for t in s.inputs if t)
            static[s.name] = fixed and s.name not in d.positions
        for t, r in zip(s.outputs, results, strict=False):
            if t:
                values[t] = r
                static[f"tensor:{t}"] = static[s.name]
    return values, static


def _finished(traced: fx.GraphModule, *, keep_cores: bool) -> fx.GraphModule:
    """The traced program with each core's node calling back into the cache directly and each
    all-reduce into the ranks' exchange (unless ``keep_cores``: torch.compile needs the operators),
    no per-run copies of its constants (``lift_fresh_copy``: nothing writes to them), and small host
    constants that meet device tensors moved there once (no host-to-device copy per run, which a
    CUDA graph cannot hold)."""
    moved = itertools.count()
    for node in list(traced.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.tessera.attend_core.default and not keep_cores:
            node.target = _call_core
        elif node.target is torch.ops.tessera.reduce_partials.default and not keep_cores:
            node.target = _call_reduce
        elif node.target is torch.ops.aten.lift_fresh_copy.default:
            node.replace_all_uses_with(node.args[0])
            traced.graph.erase_node(node)
        elif node.target is torch.ops.aten._to_copy.default and _host_constant(traced, node.args[0]):
            value = node.target(getattr(traced, node.args[0].target), *node.args[1:], **node.kwargs)
            name = f"_moved_constant{next(moved)}"
            traced.register_buffer(name, value)
            with traced.graph.inserting_before(node):
                node.replace_all_uses_with(traced.graph.get_attr(name))
            traced.graph.erase_node(node)
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return traced


def _bindings(traced: fx.GraphModule) -> fx.GraphModule:
    """``traced`` (sharing its weights) with each aten operator called through the binding torch
    generates for it from the same schema (``torch.mm``, ``torch._C._nn.gelu``, a tensor method),
    the same kernel without ``OpOverload``'s generic argument handling: 1.2-1.6 µs less a call on a
    2-core AMD EPYC VM (torch 2.13.0), a fifth of a traced step's host time. Operators without
    one (``slice``, ``_to_copy``) stay as they are."""
    graph = copy.deepcopy(traced.graph)
    for node in graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
            continue
        name = _SAME_VALUES.get(op.overloadpacket.__name__, op.overloadpacket.__name__)
        function = getattr(torch._C._VariableFunctions, name, None)
        if isinstance(function, types.BuiltinFunctionType) and getattr(torch, name, None) is function:
            node.target = function
        elif isinstance(getattr(torch._C._nn, name, None), types.BuiltinFunctionType):
            node.target = getattr(torch._C._nn, name)
        elif isinstance(getattr(torch._C.TensorBase, name, None), types.MethodDescriptorType):
            node.op, node.target = "call_method", name
    return fx.GraphModule(traced, graph)


# Operators whose binding has another name: the same values (a step's tensors need no autograd).
_SAME_VALUES = {"_unsafe_view": "reshape"}


def _host_constant(traced: fx.GraphModule, node: Any) -> bool:
    """``node`` reads a small constant of the program held on the CPU (shape arithmetic, a
    position count, an epsilon)."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    value = getattr(traced, node.target, None)
    return isinstance(value, Tensor) and value.device.type == "cpu" and value.numel() <= WEIGHT_NUMEL
