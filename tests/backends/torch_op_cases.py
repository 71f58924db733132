"""One-node cases for the torch operator table (``tessera.backends.torch_ops``): each case runs its
operator at every schema version its input form allows, against onnxruntime on the same one-node
model (forward), and, for differentiable inputs, against finite differences (backward, float64)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper

from tessera.backends.torch_ops import MAX_OPSET, MIN_OPSET, OPS, node_attributes, schema_version

RNG = np.random.default_rng(0)


def normal(*shape: int, scale: float = 1.0) -> np.ndarray:
    """Seeded fp32 samples."""
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@dataclass(frozen=True)
class Case:
    """``op`` on ``inputs`` (None: an input left out) with ``attrs``; ``grad`` lists the inputs
    checked against finite differences; ``opsets`` the opsets where this input form is valid;
    ``constants`` the inputs given as initializers (as exporters write shapes and scales)."""

    op: str
    inputs: Sequence[np.ndarray | None]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    grad: Sequence[int] = ()
    opsets: range = range(MIN_OPSET, MAX_OPSET + 1)
    outputs: int = 1
    rtol: float = 1e-5
    atol: float = 1e-6
    constants: Sequence[int] = ()

    @property
    def name(self) -> str:
        attrs = "-".join(f"{k}={v}" for k, v in self.attrs.items() if isinstance(v, int | float | str))
        return self.op + (f"-{attrs}" if attrs else "")

    def tested_opsets(self) -> list[int]:
        """One opset per schema version of ``op`` in use over ``opsets`` (the first that uses it)."""
        first: dict[int, int] = {}
        for opset in self.opsets:
            if (version := schema_version(self.op, opset)) is not None:
                first.setdefault(version, opset)
        return sorted(first.values())

    def node(self) -> onnx.NodeProto:
        names = ["" if v is None else f"x{i}" for i, v in enumerate(self.inputs)]
        return helper.make_node(self.op, names, [f"y{k}" for k in range(self.outputs)], **self.attrs)


def case(
    op: str,
    *inputs: np.ndarray | None,
    grad: Sequence[int] = (),
    opsets: range | None = None,
    outputs: int = 1,
    tol: tuple[float, float] = (1e-5, 1e-6),
    constants: Sequence[int] = (),
    **attrs: Any,
) -> Case:
    arrays = [None if v is None else np.asarray(v) for v in inputs]
    every = opsets or range(MIN_OPSET, MAX_OPSET + 1)
    return Case(op, arrays, attrs, tuple(grad), every, outputs, *tol, tuple(constants))


def at_opsets(cases: Sequence[Case]) -> list[Any]:
    """pytest params: every (case, opset) pair to run."""
    return [pytest.param(c, o, id=f"{c.name}@{o}") for c in cases for o in c.tested_opsets()]


def with_grad(cases: Sequence[Case]) -> list[Any]:
    """pytest params: the cases with differentiable inputs."""
    return [pytest.param(c, id=c.name) for c in cases if c.grad]


def run_torch(c: Case, inputs: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    out = OPS[c.op](list(inputs), node_attributes(c.node()))
    return (out if isinstance(out, tuple) else (out,))[: c.outputs]


def run_onnxruntime(c: Case, opset: int, outputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """onnxruntime on the one-node model at ``opset``; ``outputs`` (torch's) give the declared
    types."""
    given = {f"x{i}": v for i, v in enumerate(c.inputs) if v is not None}
    feeds = {n: v for n, v in given.items() if int(n[1:]) not in c.constants}
    graph = helper.make_graph(
        [c.node()],
        "one_node",
        [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in feeds.items()
        ],
        [
            helper.make_tensor_value_info(f"y{k}", helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for k, v in enumerate(outputs)
        ],
        [numpy_helper.from_array(v, n) for n, v in given.items() if n not in feeds],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)  # the form is valid at this opset
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def check_forward(c: Case, opset: int) -> None:
    got = run_torch(c, [None if v is None else torch.from_numpy(np.array(v)) for v in c.inputs])
    mine = [t.numpy() for t in got]
    want = run_onnxruntime(c, opset, mine)
    for g, w in zip(mine, want, strict=True):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        np.testing.assert_allclose(g, w, rtol=c.rtol, atol=c.atol)


def check_backward(c: Case) -> None:
    """gradcheck in float64 with respect to the inputs ``c.grad`` (fast mode: finite differences along
    random directions, not the full Jacobian, for time)."""
    tensors = [None if v is None else torch.from_numpy(np.array(v)) for v in c.inputs]
    tensors = [t.double() if t is not None and t.dtype == torch.float32 else t for t in tensors]
    free = [tensors[i].requires_grad_() for i in c.grad]  # type: ignore[union-attr]

    def fn(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        given = list(tensors)
        for i, t in zip(c.grad, args, strict=True):
            given[i] = t
        return tuple(t for t in run_torch(c, given) if t.is_floating_point())

    assert torch.autograd.gradcheck(fn, free, eps=1e-6, atol=1e-5, fast_mode=True)
