"""The model zoo: every model checks, runs, is deterministic; paper sizes are lazy and counted right."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from tessera.core.errors import InputError
from tessera.models import LAZY_LOCATION, ZOO, build, is_lazy, materialize, parameter_count

NAMES = sorted(ZOO)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _feeds(model: onnx.ModelProto, batch: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for ``model``; integer inputs index rows of the table they are gathered from."""
    rng = np.random.default_rng(seed)
    initializers = {t.name: t for t in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        shape = [batch if d.dim_param else d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.type.tensor_type.elem_type == TensorProto.INT64:
            gather = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == value.name)
            rows = initializers[gather.input[0]].dims[0]
            feeds[value.name] = rng.integers(0, rows, shape, dtype=np.int64)
        else:
            feeds[value.name] = rng.standard_normal(shape, dtype=np.float32)
    return feeds


def _metadata(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


# --- tiny: valid, runnable, well named ---------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_tiny_checks_and_runs(name: str) -> None:
    model = build(name, "tiny")
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert all(node.domain == "" for node in model.graph.node)
    assert not is_lazy(model)
    assert len(model.SerializeToString()) < 400_000

    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        assert dims[0].dim_param == "batch", value.name
        assert all(d.dim_value > 0 for d in dims[1:]), value.name

    node_names = [node.name for node in model.graph.node]
    assert all(node_names) and len(set(node_names)) == len(node_names)
    assert all(t.data_type in (TensorProto.FLOAT, TensorProto.INT64) for t in model.graph.initializer)

    outputs = _session(model).run(None, _feeds(model, batch=2))
    for value, out in zip(model.graph.output, outputs, strict=True):
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim[1:]]
        assert out.shape == (2, *dims), value.name
        assert out.dtype == np.float32 and np.isfinite(out).all(), value.name


@pytest.mark.parametrize("name", NAMES)
def test_deterministic(name: str) -> None:
    first = build(name, "tiny", seed=7).SerializeToString()
    assert build(name, "tiny", seed=7).SerializeToString() == first
    assert build(name, "tiny", seed=8).SerializeToString() != first
    assert build(name, "paper").SerializeToString() == build(name, "paper").SerializeToString()


# --- paper: lazy, fast, small, counted ---------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_paper_is_lazy_and_fast(name: str, tmp_path: Path) -> None:
    start = time.perf_counter()
    model = build(name, "paper")
    assert time.perf_counter() - start < 5.0
    assert is_lazy(model)
    assert len(model.SerializeToString()) < 1_000_000

    onnx.checker.check_model(model, full_check=True)
    # Saved and loaded as the graph loader does: without external data, checked in memory.
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    loaded = onnx.load(path, load_external_data=False)
    onnx.checker.check_model(loaded)
    inferred = onnx.shape_inference.infer_shapes(loaded, check_type=True, strict_mode=True)
    assert len(inferred.graph.value_info) > 0

    # Every parameter is lazy (real dims, no data); constants are inline and few.
    lazy = [t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert all({e.key: e.value for e in t.external_data}["location"] == LAZY_LOCATION for t in lazy)
    assert all(not t.raw_data for t in lazy)
    assert sum(math.prod(t.dims) for t in lazy) == parameter_count(model)


def _transformer_layer_params(hidden: int, ffn: int, kv_dim: int | None = None) -> int:
    kv_dim = hidden if kv_dim is None else kv_dim
    attention = 2 * (hidden * hidden + hidden) + 2 * (hidden * kv_dim + kv_dim)
    feed_forward = hidden * ffn + ffn + ffn * hidden + hidden
    return 2 * 2 * hidden + attention + feed_forward  # two LayerNorms (scale, bias)


def _mlp_params(widths: list[int]) -> int:
    return sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))


def test_paper_parameter_counts() -> None:
    # MMT (GraphPipe A.2): 4 branches x (8 layers + final LayerNorm), head 4*1024 -> 1000 classes.
    mmt = 4 * (8 * _transformer_layer_params(1024, 4096) + 2 * 1024) + 4096 * 1000 + 1000
    assert mmt == 407_184_360
    # CANDLE-Uno (GraphPipe A.2): 7 branches of 4 x 4096, top 4 x 4096 on the concat, head -> 1.
    candle = 7 * _mlp_params([4096] * 5) + _mlp_params([7 * 4096, 4096, 4096, 4096, 4096, 1])
    assert candle == 637_669_377
    # GPT-2 small is 124,439,808 with the LM head tied to the token embedding; ours is untied.
    gpt = 50257 * 768 + 1024 * 768 + 12 * _transformer_layer_params(768, 3072) + 2 * 768 + 768 * 50257
    assert gpt == 124_439_808 + 768 * 50257
    # DLRM (GraphPipe A.2): 7 dense branches of 4 x 4096, 7 tables of 1M x 64 (bag 100), top 4 x 4096.
    dlrm = 7 * _mlp_params([4096] * 5) + 7 * 1_000_000 * 64
    dlrm += _mlp_params([7 * 4096 + 7 * 100 * 64, 4096, 4096, 4096, 4096, 1])
    # BERT-base is 109,482,240 with 512 positions; ours has a position table of seq (128) rows.
    bert = 109_482_240 - (512 - 128) * 768
    expected = {"mmt": mmt, "candle_uno": candle, "gpt": gpt, "dlrm": dlrm, "bert": bert}
    for name, count in expected.items():
        assert parameter_count(build(name, "paper")) == count, name

    # ResNeXt-50 32x4d has 25,028,904 trainable parameters (torchvision); we add BN running stats.
    resnext = build("resnext", "paper")
    stats = sum(
        math.prod(t.dims) for t in resnext.graph.initializer if t.name.endswith(("bn_mean", "bn_var"))
    )
    assert parameter_count(resnext) - stats == 25_028_904


# --- lazy weights ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_materialize_equals_eager_build(name: str) -> None:
    lazy = build(name, "tiny", seed=3, lazy=True)
    assert is_lazy(lazy)
    onnx.checker.check_model(lazy, full_check=True)
    real = materialize(lazy)
    assert not is_lazy(real) and is_lazy(lazy)  # materialize copies
    assert real.SerializeToString() == build(name, "tiny", seed=3).SerializeToString()
    outputs = _session(real).run(None, _feeds(real))
    assert all(np.isfinite(out).all() for out in outputs)


# --- GPT: structure a recognizer can rely on ---------------------------------------------------


def _gpt_reference(model: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    """GPT forward pass in numpy from the model's own weights and recorded config."""
    meta = {k.removeprefix("tessera."): v for k, v in _metadata(model).items()}
    layers, heads, kv_heads, head_dim = (int(meta[k]) for k in ("layers", "heads", "kv_heads", "head_dim"))
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    seq = ids.shape[1]

    def norm(x: np.ndarray, p: str) -> np.ndarray:
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-5) * w[f"{p}/scale"] + w[f"{p}/bias"]

    def linear(x: np.ndarray, p: str) -> np.ndarray:
        return x @ w[f"{p}/weight"] + w[f"{p}/bias"]

    def split(x: np.ndarray, n: int) -> np.ndarray:  # [b, s, n*d] -> [b, heads, s, d]
        x = x.reshape(x.shape[0], seq, n, head_dim).transpose(0, 2, 1, 3)
        return np.repeat(x, heads // n, axis=1)

    x = w["embed/token/weight"][ids] + w["embed/position/weight"][:seq]
    future = np.triu(np.ones((seq, seq), dtype=bool), k=1)
    for i in range(layers):
        p = f"layer{i}"
        h = norm(x, f"{p}/ln1")
        q = split(linear(h, f"{p}/attn/q"), heads)
        k = split(linear(h, f"{p}/attn/k"), kv_heads)
        v = split(linear(h, f"{p}/attn/v"), kv_heads)
        scores = np.where(future, -np.inf, q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim))
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(x.shape)
        x = x + linear(context, f"{p}/attn/out")
        h = linear(norm(x, f"{p}/ln2"), f"{p}/ffn/fc1")
        h = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
        x = x + linear(h, f"{p}/ffn/fc2")
    return norm(x, "final_norm") @ w["lm_head/weight"]


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_gpt_matches_reference_and_is_causal(kv_heads: int) -> None:
    model = build("gpt", "tiny", kv_heads=kv_heads)
    onnx.checker.check_model(model, full_check=True)
    ids = _feeds(model)["input_ids"]
    logits = _session(model).run(None, {"input_ids": ids})[0]
    np.testing.assert_allclose(logits, _gpt_reference(model, ids.astype(np.int64)), rtol=1e-4, atol=1e-4)

    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % 128  # a different last token changes only the last position
    changed_logits = _session(model).run(None, {"input_ids": changed})[0]
    np.testing.assert_allclose(changed_logits[:, :-1], logits[:, :-1], rtol=0, atol=1e-6)
    assert not np.allclose(changed_logits[:, -1], logits[:, -1])


def test_gpt_records_its_config() -> None:
    meta = _metadata(build("gpt", "paper"))
    expected = {"layers": 12, "hidden": 768, "heads": 12, "kv_heads": 12, "head_dim": 64, "ffn": 3072}
    expected |= {"vocab": 50257, "seq": 1024}
    assert {k: int(meta[f"tessera.{k}"]) for k in expected} == expected
    assert meta["tessera.model"] == "gpt" and meta["tessera.size"] == "paper"

    names = {node.name for node in build("gpt", "tiny").graph.node}
    for part in ("ln1/layer_norm", "attn/qk_matmul", "attn/qk_scale", "attn/mask_add", "attn/softmax"):
        assert {f"layer{i}/{part}" for i in range(2)} <= names
    assert {"embed/token/gather", "final_norm/layer_norm", "lm_head/matmul"} <= names


# --- errors ------------------------------------------------------------------------------------


def test_unknown_name_size_or_field_is_an_input_error() -> None:
    with pytest.raises(InputError, match="gpt"):
        build("gpt3")
    with pytest.raises(InputError, match="tiny, paper"):
        build("gpt", "huge")
    with pytest.raises(InputError, match="kv_heads"):
        build("gpt", kv_heads=3)
    with pytest.raises(InputError, match="heads"):
        build("gpt", heads_count=3)
    with pytest.raises(InputError, match="seed"):
        build("mmt", seed=-1)


def test_zoo_lists_every_model_with_both_sizes() -> None:
    assert set(ZOO) == {"mmt", "dlrm", "candle_uno", "resnext", "bert", "gpt"}
    for spec in ZOO.values():
        assert spec.sizes == ("tiny", "paper") and spec.description
