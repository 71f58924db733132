"""Each available backend runs subgraphs cut from zoo models and matches onnxruntime's full model.

Tolerance: fp32, relative 1e-4 with an absolute floor of 1e-5 (values of order 1): the backends
reorder reductions (matmul, layer norm, softmax), nothing more.
"""

from __future__ import annotations

import numpy as np
import pytest

from tessera.backends.base import BackendUnavailable
from tessera.backends.cudnn import CudnnBackend
from tessera.backends.onnxruntime import OnnxRuntimeBackend
from tessera.backends.openvino import OpenVinoBackend
from tessera.backends.tensorrt import TensorRtBackend
from tessera.backends.tvm import TvmBackend

RTOL, ATOL = 1e-4, 1e-5
CPU_BACKENDS = {"onnxruntime": OnnxRuntimeBackend, "openvino": OpenVinoBackend, "tvm": TvmBackend}


@pytest.fixture(scope="module")
def gpt_feeds(gpt_model):
    rng = np.random.default_rng(0)
    (ids,) = [i.name for i in gpt_model.graph.input]
    return {ids: rng.integers(0, 50, (1, 16), dtype=np.int64)}


@pytest.fixture(scope="module")
def resnext_feeds(resnext_model):
    (x,) = [i.name for i in resnext_model.graph.input]
    return {x: np.random.default_rng(0).standard_normal((1, 3, 32, 32), dtype=np.float32)}


@pytest.fixture(scope="module")
def cases(gpt, gpt_model, gpt_feeds, resnext, resnext_model, resnext_feeds, ort_values):
    """(graph, nodes, sub-model, sub-model feeds, expected outputs) for a transformer layer and a conv block."""
    out = {}
    for label, graph, model, feeds, prefix in (
        ("gpt-layer0", gpt, gpt_model, gpt_feeds, "layer0/"),
        ("resnext-block", resnext, resnext_model, resnext_feeds, "stage1/block0/"),
    ):
        nodes = [n for n in graph.order if n.startswith(prefix)]
        ins, outs = graph.boundary(nodes)
        values = ort_values(model, feeds, [*ins, *outs])
        sub = graph.extract(nodes)
        sub_ins = [i.name for i in sub.graph.input if i.name not in {t.name for t in sub.graph.initializer}]
        out[label] = (graph, nodes, sub, {k: values[k] for k in sub_ins}, {k: values[k] for k in outs})
    return out


@pytest.fixture(scope="module", params=sorted(CPU_BACKENDS))
def backend(request, tmp_path_factory):
    cls = CPU_BACKENDS[request.param]
    b = cls(work_dir=tmp_path_factory.mktemp("tvm")) if cls is TvmBackend else cls()
    ok, reason = b.available()
    assert ok, f"{b.name} should be available in the test environment: {reason}"
    return b


@pytest.mark.parametrize("case", ["gpt-layer0", "resnext-block"])
def test_subgraph_matches_full_model(backend, cases, case) -> None:
    graph, nodes, sub, feeds, expected = cases[case]
    assert backend.supports(graph, nodes)
    runnable = backend.compile(sub)
    assert set(runnable.input_names) == set(feeds)
    got = runnable.run(feeds)
    assert set(got) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(
            got[name], want, rtol=RTOL, atol=ATOL, err_msg=f"{backend.name} {case} {name}"
        )
    again = runnable.run(feeds)  # a second run gives fresh, equal outputs
    for name in expected:
        np.testing.assert_array_equal(again[name], got[name])


def test_capabilities_are_known_up_front(gpt) -> None:
    ort_cap = OnnxRuntimeBackend().capability()
    assert {"MatMul", "Conv", "LayerNormalization", "Softmax"} <= ort_cap.op_types
    assert "float32" in ort_cap.dtypes
    tvm_cap = TvmBackend().capability()
    assert {"MatMul", "Conv", "Erf", "Trilu"} <= tvm_cap.op_types
    assert OpenVinoBackend().capability().query is not None
    # A bool-only custom op is not supported by anyone; a plain MatMul by everyone.
    for cls in CPU_BACKENDS.values():
        assert cls().supports(gpt, ["layer0/attn/q/matmul"])


def test_openvino_query_rejects_unsupported(make_graph) -> None:
    graph = make_graph(
        [("fft", "DFT", ["x"], ["y"], {"onesided": 0}), ("relu", "Relu", ["y"], ["z"])],
        {"x": [1, 8, 2]},
        ["z"],
    )
    ov = OpenVinoBackend()
    assert ov.supports(graph, ["relu"])
    assert isinstance(ov.supports(graph, ["fft"]), bool)  # OpenVINO's own answer, whatever it is


def test_gpu_backends_unavailable_here_say_why() -> None:
    for b in (CudnnBackend(), TensorRtBackend()):
        ok, reason = b.available()
        if ok:
            continue
        assert reason
        assert not b.supports.__self__.available()[0]
        with pytest.raises(BackendUnavailable, match=reason.split(";")[0][:20]):
            b.compile(None)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [CudnnBackend, TensorRtBackend])
def test_gpu_backend_matches_full_model(cls, cases, tmp_path) -> None:
    b = cls(cache_dir=tmp_path) if cls is TensorRtBackend else cls()
    ok, reason = b.available()
    if not ok:
        pytest.skip(reason)
    graph, nodes, sub, feeds, expected = cases["resnext-block"]
    assert b.supports(graph, nodes)
    got = b.compile(sub).run(feeds)
    for name, want in expected.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-2, atol=1e-3)  # TF32 / cuDNN algorithms
    if cls is TensorRtBackend:
        assert list(tmp_path.glob("*.engine")), "the engine is cached"
