"""What a graph does to its attention scores, found by evaluating it, not by matching op patterns.

Between an attention core's Q·Kᵀ ``MatMul`` and its ``Softmax`` an exporter may scale, soft-cap, add a
mask or a position bias, in whatever ops it likes. All of it is a function of the raw scores and of
token positions, so it is evaluated: the sub-graph from the raw scores (and the graph inputs the
mask is built from) to the Softmax's input runs in onnxruntime with the raw scores set to chosen
constants, at several sequence lengths, and the result is classified as a :class:`ScoreMod`:
``φ(s) + bias(h, i, j)``, masked where the mask is, with φ a scaling or a soft-cap
(``c·tanh(α·s/c)``), the bias none or a per-head linear position bias (ALiBi), the mask causal,
causal within a sliding window, or none (bidirectional: an encoder). Anything else is refused,
naming the node. Details: docs/cp.md ("Recognition by evaluation").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tessera.backends.model_run import ModelRun
from tessera.core.cache_inputs import input_role
from tessera.core.graph import Graph
from tessera.core.weights import is_lazy_tensor, lazy_values
from tessera.planners.cp.softmax_input import constant_value, softmax_scores

__all__ = [
    "GraphRun", "OpScoreProbe", "ScoreError", "ScoreMod", "ScoreProbe", "bound_batch", "constant_value",
    "declared_length", "input_role", "probe_feeds", "token_input",
]  # fmt: skip

LENGTHS = (5, 9)  # sequence lengths the score path is evaluated at (a window below 8 shows)
# Raw-score values fed to the path: φ is read at each (0 gives the bias and the mask).
_VALUES = (0.0, 1.0, -1.0, 0.5, 3.0, -30.0, 300.0)
_LARGE = 1e5  # a raw score a soft-cap saturates at; less where the scores' dtype cannot hold it (fp16)
_MASKED = -1e4  # a score at or below this after the path is masked (exporters use -inf, finfo.min, -1e9)
_MAX_PROBE_ELEMENTS = 1 << 25  # scores of one probe run: 128 MiB of fp32
_MAX_WINDOW = 1 << 20
_AFFINE = frozenset(
    {"Add", "Sub", "Mul", "Div", "Where", "Cast", "CastLike", "Identity", "Reshape", "Expand", "Squeeze",
     "Unsqueeze", "Transpose", "Shape", "Neg"}
)  # fmt: skip
_MAX_RUN_BYTES = 1 << 30  # weights of a graph run whole to read values (heads, causality)


@dataclass(frozen=True)
class ScoreMod:
    """What the graph does to raw scores ``s = q·k`` of a query at position ``i`` and a key at ``j``:
    ``φ(s) + slope_h·(j − i)``, masked where ``j > i`` (causal) and where ``i − j ≥ window``;
    ``φ(s) = scale·s``, or ``softcap·tanh(scale·s/softcap)``."""

    scale: float
    causal: bool
    softcap: float | None = None
    window: int | None = None  # a query sees the ``window`` most recent positions, itself included
    alibi: tuple[float, ...] | None = None  # per-head slopes of the linear position bias
    max_length: int | None = None  # the score path does not run past this many positions
    sinks: tuple[float, ...] | None = None  # per-head logits of a sink: one more key, of value 0

    @property
    def plain(self) -> bool:
        """Causal attention with a scale alone: what every decode-attention kernel computes."""
        return (
            self.causal
            and self.softcap is None
            and self.window is None
            and self.alibi is None
            and self.sinks is None
        )


class ScoreError(Exception):
    """Why the score path cannot be reproduced; ``node`` names where."""

    def __init__(self, node: str, why: str) -> None:
        super().__init__(f"at {node}: {why}")
        self.node, self.why = node, why


def token_input(graph: Graph) -> str | None:
    """The graph input of token ids: the first integer input that is no mask or positions."""
    return next(
        (n for n, info in graph.inputs.items() if input_role(n) == "tokens" and info.dtype.startswith("int")),
        None,
    )


def declared_length(graph: Graph) -> int | None:
    """The sequence length a graph input declares as a number (an export of a fixed length); None
    where it is free. Such a graph may still run at others (tessera's zoo GPT does)."""
    for name in graph.inputs:
        declared = graph.declared_shapes.get(name)
        if declared and len(declared) == 2 and isinstance(declared[1], int):
            return int(declared[1])
    return None


def probe_feeds(graph: Graph, inputs: Iterable[str], batch: int, length: int) -> dict[str, np.ndarray]:
    """Inputs for running ``graph`` on ``batch`` requests of ``length`` tokens: token ids (zeros), an
    all-ones attention mask, positions ``0..length-1``; by each input's name and element type."""
    feeds: dict[str, np.ndarray] = {}
    for name in inputs:
        info = graph.inputs[name]
        dtype = np.dtype(info.dtype)
        rank = len(info.shape) if info.shape is not None else 2
        role = input_role(name)
        if role == "mask":
            feeds[name] = np.ones((batch, length) if rank == 2 else (batch, 1, length, length), dtype=dtype)
        elif role == "positions":
            feeds[name] = np.broadcast_to(np.arange(length, dtype=dtype), (batch, length)).copy()
        else:
            feeds[name] = np.zeros((batch, length), dtype=dtype)
    return feeds


class GraphRun:
    """The whole graph in onnxruntime, at its declared shapes, for reading what it computes: any
    tensors it computes, on ``batch`` requests of given tokens. ``None`` from :meth:`of` when its
    weights are not in the file (lazy or external) or too large to run here."""

    def __init__(self, graph: Graph, session: Any, tensors: Sequence[str]) -> None:
        self.g, self.session, self.tensors = graph, session, list(tensors)
        self.batch = bound_batch(graph)

    @classmethod
    def of(cls, graph: Graph, tensors: Sequence[str]) -> GraphRun | None:
        from tessera.core.onnx_io import restore_declared_shapes

        protos = graph.model.graph.initializer
        if (
            any(p.data_location == onnx.TensorProto.EXTERNAL for p in protos)
            or graph.param_bytes > _MAX_RUN_BYTES
        ):
            return None
        model = restore_declared_shapes(graph.model, graph.declared_shapes)
        have = {o.name for o in model.graph.output}
        model.graph.output.extend(
            helper.make_tensor_value_info(
                t, helper.np_dtype_to_tensor_dtype(np.dtype(graph.tensors[t].dtype)), None
            )
            for t in tensors
            if t not in have
        )
        try:
            session = ModelRun(model)
        except Exception:  # noqa: BLE001 - a graph no runtime here can load: its values are not read
            return None
        return cls(graph, session, tensors)

    def run(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """The graph's outputs and the requested tensors for ``tokens`` ``[batch, length]``."""
        feeds = probe_feeds(self.g, self.g.inputs, tokens.shape[0], tokens.shape[1])
        token = token_input(self.g)
        if token is not None:
            feeds[token] = tokens.astype(feeds[token].dtype)
        names = self.session.output_names
        return dict(zip(names, self.session.run(names, feeds), strict=True))

    def length(self) -> int:
        """The sequence length to run at: the declared one when fixed (onnxruntime holds the graph
        to its declared shapes), else the longest of :data:`LENGTHS`."""
        return declared_length(self.g) or max(LENGTHS)


def bound_batch(graph: Graph) -> int:
    """The batch the graph's token input is loaded at (1 where it is free)."""
    token = token_input(graph)
    shape = graph.inputs[token].shape if token is not None else None
    return int(shape[0]) if shape and isinstance(shape[0], int) else 1


class ScoreProbe:
    """Evaluates the score path of one attention core (``qk``: its Q·Kᵀ MatMul; ``softmax``)."""

    def __init__(self, graph: Graph, qk: str, softmax: str) -> None:
        self.g, self.qk, self.softmax = graph, qk, softmax
        self.raw = graph.op(qk).outputs[0]
        self.target = softmax_scores(graph, softmax).scores  # (a shift by the maximum changes nothing)
        self.nodes, self.inputs = self._subgraph()
        shape = graph.tensors.get(self.raw)
        if shape is None or shape.shape is None or not all(isinstance(d, int) for d in shape.shape):
            raise ScoreError(qk, "the shape of the scores is unknown (bind the inputs with --input-shape)")
        self.lead = tuple(int(d) for d in shape.shape[:-2])  # batch and heads, as loaded
        self.dtype = np.dtype(shape.dtype)
        self.batch = bound_batch(graph)
        self._session: Any = None

    def classify(self) -> ScoreMod:
        """The :class:`ScoreMod` the path computes; :class:`ScoreError` when it is none."""
        lengths, fixed = list(LENGTHS), declared_length(self.g)
        try:
            found = [self._at(n) for n in lengths]
        except ScoreError:
            if fixed is None:  # the graph's own length is the only other one it may run at
                raise
            lengths, found = [fixed], [self._at(fixed)]
        first = found[0]
        for n, other in zip(lengths[1:], found[1:], strict=True):
            same_cap = (other.softcap is None) == (first.softcap is None) and (
                first.softcap is None or np.isclose(other.softcap, first.softcap, rtol=1e-5)
            )
            if (
                other.causal != first.causal
                or not same_cap
                or not np.isclose(other.scale, first.scale, rtol=1e-5)
            ):
                raise ScoreError(self.softmax, f"the scores are modified differently at {n} tokens")
        windows = {m.window for m in found if m.window is not None}
        if len(windows) > 1:
            raise ScoreError(self.softmax, f"the window differs between lengths: {sorted(windows)}")
        window, limit = next(iter(windows), None), None
        if window is None:
            window, limit = self._hidden_window(max(lengths))
        slopes = {m.alibi for m in found}
        if len(slopes) > 1 and not _close_slopes(slopes):
            raise ScoreError(
                self.softmax, "the position bias is not the same linear function at every length"
            )
        return ScoreMod(first.scale, first.causal, first.softcap, window, found[0].alibi, limit)

    # -- the sub-graph --

    def _subgraph(self) -> tuple[list[str], list[str]]:
        """The nodes from the raw scores and the graph inputs to the Softmax's input, in order, and
        the graph inputs they read."""
        needed: set[str] = set()
        inputs: set[str] = set()
        stack = [self.target]
        while stack:
            tensor = stack.pop()
            if tensor == self.raw:
                continue
            if tensor in self.g.inputs:
                inputs.add(tensor)
                continue
            node = self.g.producer.get(tensor)
            if node is None or node in needed:
                continue
            needed.add(node)
            op = self.g.op(node)
            stack.extend(t for t in (*op.inputs, *op.implicit_inputs) if t)
        order = [n for n in self.g.order if n in needed]
        return order, [n for n in self.g.inputs if n in inputs]

    def _model(self) -> onnx.ModelProto:
        protos = {n.name: n for n in self.g.model.graph.node}
        nodes = [protos[n] for n in self.nodes]
        used = {t for n in nodes for t in n.input if t} | {
            t for n in self.nodes for t in self.g.op(n).implicit_inputs
        }
        inits = []
        for name in sorted(used):
            proto = self.g.initializer_protos.get(name)
            if proto is None:
                continue
            if is_lazy_tensor(proto):
                proto = numpy_helper.from_array(lazy_values(proto), name)
            inits.append(proto)

        def free(name: str, dtype: np.dtype) -> onnx.ValueInfoProto:
            return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(dtype), None)

        graph = helper.make_graph(
            nodes,
            "score_path",
            [
                *([free(self.raw, self.dtype)] if self.raw else []),
                *(free(n, np.dtype(self.g.inputs[n].dtype)) for n in self.inputs),
            ],
            [free(self.target, np.dtype(self.g.tensors[self.target].dtype))],
            initializer=inits,
        )
        model = helper.make_model(graph, opset_imports=list(self.g.model.opset_import))
        model.ir_version = self.g.model.ir_version
        return model

    def _run(self, raw: np.ndarray, length: int, *, exact: bool = True) -> np.ndarray:
        if self._session is None:
            try:
                self._session = ModelRun(self._model(), threads=1)
            except Exception as exc:  # noqa: BLE001 - onnxruntime's own error, one line, with the node
                why = " ".join(str(exc).split())[:200]
                raise ScoreError(self.softmax, f"the score path does not load: {why}") from None
        feeds = probe_feeds(self.g, self.inputs, self.batch, length)
        if self.raw:
            feeds[self.raw] = raw
        try:
            out = self._session.run([self.target], feeds)[0]
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own error, one line, with the node
            why = " ".join(str(exc).split())[:200]
            raise ScoreError(self.softmax, f"the score path does not run: {why}") from None
        return np.asarray(out, dtype=np.float64) if exact else np.asarray(out)

    # -- classification --

    def _at(self, n: int) -> ScoreMod:
        """Evaluate at ``n`` tokens and classify."""
        large = _LARGE if self.dtype.kind != "f" else min(_LARGE, float(np.finfo(self.dtype).max) / 4)
        outs = {c: self._scores(c, n) for c in (*_VALUES, large)}
        zero = outs[0.0]
        if np.isnan(zero).any() or np.isnan(outs[1.0]).any():
            raise ScoreError(self.softmax, "the score path computes NaN")
        masked = zero <= _MASKED
        for c, out in outs.items():
            if not np.array_equal(out <= _MASKED, masked) and abs(c) < 1e4:
                raise ScoreError(self.softmax, f"what is masked depends on the scores (raw score {c})")
        phi = {c: self._phi(out, zero, ~masked, c) for c, out in outs.items()}
        scale, softcap = self._fit_phi(phi)
        causal, window = self._mask(masked, n)
        return ScoreMod(scale, causal, softcap, window, self._bias(zero, masked, n))

    def _scores(self, value: float, n: int) -> np.ndarray:
        shape = (*self.lead, n, n)
        if int(np.prod(shape)) > _MAX_PROBE_ELEMENTS:
            raise ScoreError(self.qk, f"scores of {shape} are too large to evaluate")
        out = self._run(np.full(shape, value, dtype=self.dtype), n)
        if out.shape[-2:] != (n, n):
            raise ScoreError(self.softmax, f"the Softmax's input is {out.shape}, not [..., {n}, {n}]")
        return out.reshape(-1, n, n)

    def _phi(self, out: np.ndarray, zero: np.ndarray, open_: np.ndarray, c: float) -> float:
        """φ(c): what a raw score of ``c`` adds to every open cell (the same for all, or refused)."""
        cells = np.broadcast_to(open_, out.shape)
        delta = out[cells] - zero[cells]
        if delta.size == 0:
            raise ScoreError(self.softmax, "every score is masked")
        mid = float(np.median(delta))
        if float(np.max(np.abs(delta - mid))) > self._tolerance(mid):
            raise ScoreError(
                self.softmax, "the scores are modified by position, not by one function of the score alone"
            )
        return mid

    def _fit_phi(self, phi: dict[float, float]) -> tuple[float, float | None]:
        """``(scale, softcap)``: φ(c) = scale·c, or softcap·tanh(scale·c/softcap)."""
        scale = phi[1.0]
        if all(abs(phi[c] - scale * c) <= self._tolerance(scale * c) for c in phi):
            return scale, None
        cap = abs(phi[max(phi)])
        if cap > 0 and abs(phi[0.5]) < cap:
            alpha = float(np.arctanh(phi[0.5] / cap) * cap / 0.5)
            if all(abs(phi[c] - cap * np.tanh(alpha * c / cap)) <= self._tolerance(cap) for c in phi):
                return alpha, cap
        shown = ", ".join(f"{c:g}->{phi[c]:.4g}" for c in sorted(phi))
        raise ScoreError(
            self._culprit(), f"the scores are transformed by neither a scale nor a soft-cap ({shown})"
        )

    def _culprit(self) -> str:
        """The first op on the scores' own path that is neither affine nor a layout op: where an
        unclassified transform most likely is (the Softmax when there is none)."""
        carried, plain = {self.raw}, _AFFINE | {"Tanh"}
        for node in self.nodes:
            op = self.g.op(node)
            if any(t in carried for t in op.inputs):
                carried.update(op.outputs)
                if op.op_type not in plain:
                    return node
        return self.softmax

    def _tolerance(self, value: float) -> float:
        rel = 1e-5 if self.dtype == np.float32 or self.dtype == np.float64 else 1e-2
        return rel * (1.0 + abs(value))

    def _mask(self, masked: np.ndarray, n: int) -> tuple[bool, int | None]:
        """``(causal, window)`` of the masked cells (the same for every head and request)."""
        first = masked[0]
        if not all(np.array_equal(m, first) for m in masked[1:]):
            raise ScoreError(self.softmax, "the mask differs between heads or requests")
        if not first.any():
            return False, None
        future = np.triu(np.ones((n, n), dtype=bool), k=1)
        if np.diagonal(first).any():
            raise ScoreError(self.softmax, "the mask hides a token from itself")
        if not np.array_equal(first & future, future):
            raise ScoreError(self.softmax, "the mask is not causal: a query sees later positions")
        seen = int((~first[-1]).sum())
        if seen == n:
            if np.array_equal(first, future):
                return True, None
        elif np.array_equal(first, future | np.tril(np.ones((n, n), dtype=bool), k=-seen)):
            return True, seen
        raise ScoreError(self.softmax, "the mask is causal but hides more than a sliding window does")

    def _bias(self, zero: np.ndarray, masked: np.ndarray, n: int) -> tuple[float, ...] | None:
        """Per-head ALiBi slopes when the open scores carry a bias linear in ``j − i`` (up to a
        per-row constant, which the Softmax ignores); None when there is none."""
        open_ = ~masked
        diagonal = np.diagonal(zero, axis1=-2, axis2=-1)[..., :, None]
        rel = np.where(open_, zero - diagonal, 0.0)
        if float(np.max(np.abs(rel))) <= self._tolerance(float(np.max(np.abs(diagonal)))):
            return None
        distance = np.arange(n)[None, :] - np.arange(n)[:, None]  # j - i
        slopes = []
        for head in range(rel.shape[0]):
            row = open_[head, -1]
            j = int(np.argmax(row))  # the furthest key the last query sees
            if j == n - 1:
                raise ScoreError(self.softmax, "a position bias on a query that sees only itself")
            slope = rel[head, -1, j] / (j - (n - 1))
            if np.max(np.abs(np.where(open_[head], rel[head] - slope * distance, 0.0))) > self._tolerance(
                slope * n
            ):
                raise ScoreError(
                    self.softmax,
                    "the scores carry a position bias that is not linear in the distance (ALiBi)",
                )
            slopes.append(float(slope))
        heads = self.lead[-1] if len(self.lead) >= 2 else len(slopes) // max(1, self.batch)
        per_request = [tuple(slopes[i : i + heads]) for i in range(0, len(slopes), heads)]
        if any(not np.allclose(r, per_request[0], rtol=1e-5, atol=1e-7) for r in per_request):
            raise ScoreError(self.softmax, "the position bias differs between requests")
        return per_request[0]

    def _hidden_window(self, longest: int) -> tuple[int | None, int | None]:
        """``(window, limit)``: a window wider than every length evaluated shows only past it, so
        each integer constant on the mask's path that could be one is tried at a length just past
        it; ``limit``: the first such length the path does not run at (a position table's end)."""
        # One head of scores is enough to read a mask (it broadcasts over heads), and 32× smaller.
        narrow = (*self.lead[:-1], 1) if len(self.lead) == 2 else self.lead
        for width in self._window_candidates(longest):
            n = width + 1
            masked = None
            for lead in dict.fromkeys((narrow, self.lead)):
                if int(np.prod((*lead, n, n))) > _MAX_PROBE_ELEMENTS:
                    continue
                try:
                    masked = self._masked(lead, n)
                    break
                except ScoreError:
                    continue
            if masked is None:
                if int(np.prod((*self.lead, n, n))) > _MAX_PROBE_ELEMENTS:
                    raise ScoreError(
                        self.softmax,
                        f"the constant {width} on the mask's path may be a sliding window, too long to check "
                        f"at {n} tokens",
                    )
                return None, width
            _, window = self._mask(masked, n)
            if window is not None:
                return window, None
        return None, None

    def _masked(self, lead: tuple[int, ...], n: int) -> np.ndarray:
        """Which cells the path masks at ``n`` tokens, for raw scores of ``[*lead, n, n]``."""
        out = self._run(np.zeros((*lead, n, n), dtype=self.dtype), n, exact=False)
        if out.shape[-2:] != (n, n):
            raise ScoreError(self.softmax, f"the Softmax's input is {out.shape}, not [..., {n}, {n}]")
        return (out <= _MASKED).reshape(-1, n, n)

    def _window_candidates(self, longest: int) -> list[int]:
        values: set[int] = set()
        for node in self.nodes:
            op = self.g.op(node)
            for t in op.inputs:
                array = constant_value(self.g, t)
                if array is None or array.size != 1 or not np.issubdtype(array.dtype, np.number):
                    continue
                value = float(array.reshape(()))
                if array.dtype.kind == "f" and abs(value) == float(np.finfo(array.dtype).max):
                    continue  # a mask's fill, the dtype's extreme (fp16's is 65504, an integer)
                if value.is_integer() and longest - 1 <= abs(value) <= _MAX_WINDOW:
                    values.add(int(abs(value)))
        return sorted(values)


def _close_slopes(slopes: Sequence[tuple[float, ...] | None] | set) -> bool:
    values = [s for s in slopes]
    if any(s is None for s in values):
        return False
    return all(np.allclose(s, values[0], rtol=1e-5, atol=1e-7) for s in values)


class OpScoreProbe(ScoreProbe):
    """The scores of an ``Attention`` operator (opset 23): its attributes give φ (``scale``,
    ``softcap``) and the causal mask (``is_causal``); its ``attn_mask`` input, boolean or additive,
    is evaluated from the graph inputs as a score path is, so a window or a bias built into it is
    read the same way."""

    def __init__(self, graph: Graph, node: str, head_dim: int) -> None:
        op = graph.op(node)
        self.g, self.qk, self.softmax = graph, node, node
        self.attrs = op.attributes
        scale = self.attrs.get("scale")
        self.scale = float(scale) if scale is not None else 1 / float(np.sqrt(head_dim))
        cap = float(self.attrs.get("softcap", 0.0) or 0.0)
        self.cap = cap if cap > 0 else None
        self.raw = ""
        self.target = op.inputs[3] if len(op.inputs) > 3 and op.inputs[3] else ""
        self.nodes, self.inputs = self._subgraph() if self.target else ([], [])
        self.lead = (1,)  # the mask broadcasts over heads: one head of scores is read
        self.dtype = (
            np.dtype(graph.tensors[op.inputs[0]].dtype) if op.inputs[0] in graph.tensors else np.float32
        )
        self.batch = bound_batch(graph)
        self._session = None

    def _scores(self, value: float, n: int) -> np.ndarray:
        phi = self.scale * value
        if self.cap is not None:
            phi = self.cap * float(np.tanh(phi / self.cap))
        out = np.full((1, n, n), phi, dtype=np.float64)
        if self.target:
            mask = np.asarray(self._run(np.zeros(0), n, exact=False))
            if mask.shape[-2:] != (n, n) and mask.shape[-1] != n:
                raise ScoreError(
                    self.qk, f"the attention mask is {mask.shape} at {n} tokens, not [..., {n}, {n}]"
                )
            if mask.dtype == np.bool_:
                out = np.where(mask, out, -np.inf)
            else:
                out = out + mask.astype(np.float64)
        if self.attrs.get("is_causal", 0):
            out = np.where(np.triu(np.ones((n, n), dtype=bool), k=1), -np.inf, out)
        return out.reshape(-1, n, n)

    def _masked(self, lead: tuple[int, ...], n: int) -> np.ndarray:
        return self._scores(0.0, n) <= _MASKED
