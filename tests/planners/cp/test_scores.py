"""What an attention core does to its scores, found by evaluation (planners/cp/scores.py), and the
decode attention that reproduces it over a sharded KV cache (executor/graph_decode_worker.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessera.core.graph import load_graph
from tessera.planners.cp.scores import ScoreError, ScoreMod, ScoreProbe

Nodes = list
# A score path: (nodes, initializers, output) from the raw scores "scores" [1, 2, S, S] and "dist"
# (j - i, int64 [S, S], built from the scores' own shape as exporters do).
Path = Callable[[], tuple[Nodes, list, str]]


def _core(path: Path, dtype=np.float32) -> ScoreProbe:
    """x [1, S, 8] → two heads of 4 → q·kᵀ → ``path`` → Softmax → ·v; the probe of that core."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(8, 8)).astype(dtype), w) for w in ("wq", "wk", "wv")]
    inits += [
        numpy_helper.from_array(np.array([1, -1, 2, 4], np.int64), "heads_shape"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "ax0"),
        numpy_helper.from_array(np.array([1], np.int64), "ax1"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q0"], name="q_proj"),
        helper.make_node("MatMul", ["x", "wk"], ["k0"], name="k_proj"),
        helper.make_node("MatMul", ["x", "wv"], ["v0"], name="v_proj"),
        helper.make_node("Reshape", ["q0", "heads_shape"], ["q1"]),
        helper.make_node("Reshape", ["k0", "heads_shape"], ["k1"]),
        helper.make_node("Reshape", ["v0", "heads_shape"], ["v1"]),
        helper.make_node("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
        helper.make_node("Shape", ["scores"], ["len1"], start=-1),
        helper.make_node("Squeeze", ["len1", "ax0"], ["length"]),
        helper.make_node("Range", ["zero", "length", "one"], ["pos"]),
        helper.make_node("Unsqueeze", ["pos", "ax1"], ["q_pos"]),
        helper.make_node("Unsqueeze", ["pos", "ax0"], ["k_pos"]),
        helper.make_node("Sub", ["k_pos", "q_pos"], ["dist"]),
    ]
    more, extra, out = path()
    nodes += [*more, helper.make_node("Softmax", [out], ["p"], axis=-1, name="softmax")]
    nodes.append(helper.make_node("MatMul", ["p", "v"], ["y"], name="pv"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), [1, "s", 8])],
        [
            helper.make_tensor_value_info(
                "y", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), [1, 2, "s", 4]
            )
        ],
        inits + extra,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ScoreProbe(load_graph(model), "qk", "softmax")


def _scalar(name: str, value: float, dtype=np.float32):
    return numpy_helper.from_array(np.array(value, dtype), name)


def _scaled_masked(
    scale: float = 0.5, *, window: int | None = None, causal: bool = True, softcap: float | None = None,
    slopes: tuple[float, ...] | None = None, bias_power: int = 1, extra_hidden: int | None = None,
    dtype=np.float32,
) -> Path:  # fmt: skip
    """scores·scale [→ soft-cap] [+ slope·dist^power] masked where dist > 0 [or dist <= -window]
    (with -inf, or with fp16's lowest value as transformers masks fp16 scores)."""
    fill = -np.inf if dtype == np.float32 else np.finfo(dtype).min

    def path() -> tuple[Nodes, list, str]:
        nodes = [helper.make_node("Mul", ["scores", "scale"], ["s0"])]
        inits = [
            _scalar("scale", scale, dtype),
            _scalar("neg_inf", fill, dtype),
            _scalar("izero", 0, np.int64),
        ]
        out = "s0"
        if softcap is not None:
            inits.append(_scalar("cap", softcap, dtype))
            nodes += [
                helper.make_node("Div", [out, "cap"], ["s_div"]),
                helper.make_node("Tanh", ["s_div"], ["s_tanh"]),
                helper.make_node("Mul", ["s_tanh", "cap"], ["s_cap"]),
            ]
            out = "s_cap"
        if slopes is not None:
            inits += [
                numpy_helper.from_array(np.array(slopes, np.float32).reshape(1, -1, 1, 1), "slopes"),
                _scalar("power", float(bias_power)),
            ]
            nodes += [
                helper.make_node("Cast", ["dist"], ["fdist"], to=TensorProto.FLOAT),
                helper.make_node("Pow", ["fdist", "power"], ["pdist"]),
                helper.make_node("Mul", ["pdist", "slopes"], ["bias"]),
                helper.make_node("Add", [out, "bias"], ["s_bias"]),
            ]
            out = "s_bias"
        if not causal:
            return nodes, inits, out
        nodes.append(helper.make_node("Greater", ["dist", "izero"], ["hidden0"]))
        hidden = "hidden0"
        for i, (op, bound) in enumerate([("LessOrEqual", window), ("Equal", extra_hidden)]):
            if bound is None:
                continue
            inits.append(_scalar(f"bound{i}", -bound, np.int64))
            nodes += [
                helper.make_node(op, ["dist", f"bound{i}"], [f"far{i}"]),
                helper.make_node("Or", [hidden, f"far{i}"], [f"hidden{i + 1}"]),
            ]
            hidden = f"hidden{i + 1}"
        nodes.append(helper.make_node("Where", [hidden, "neg_inf", out], ["masked"]))
        return nodes, inits, "masked"

    return path


def test_a_scaled_causal_core() -> None:
    assert _core(_scaled_masked(0.5)).classify() == ScoreMod(scale=0.5, causal=True)


@pytest.mark.parametrize("window", [3, 12])  # 12: wider than the lengths tried, found from the constant
def test_a_sliding_window_is_read_off_the_mask(window: int) -> None:
    mod = _core(_scaled_masked(0.25, window=window)).classify()
    assert (mod.causal, mod.window, mod.scale) == (True, window, 0.25)


def test_a_soft_cap_is_fitted_with_its_scale() -> None:
    mod = _core(_scaled_masked(0.25, softcap=20.0)).classify()
    assert mod.softcap == pytest.approx(20.0, rel=1e-4) and mod.scale == pytest.approx(0.25, rel=1e-4)


@pytest.mark.parametrize(
    ("kw", "want"),
    [({}, (None, None)), ({"window": 12}, (12, None)), ({"softcap": 20.0}, (None, 20.0))],
    ids=["scaled", "window", "softcap"],
)
def test_fp16_scores_masked_with_the_lowest_fp16_are_classified(kw: dict, want: tuple) -> None:
    """fp16 holds no raw score of 1e5 (the probe's largest is cut to what it holds), and the mask's
    fill, -65504, is an integer but no window."""
    mod = _core(_scaled_masked(0.25, dtype=np.float16, **kw), np.float16).classify()
    assert (mod.causal, mod.window) == (True, want[0]) and mod.scale == pytest.approx(0.25, rel=1e-2)
    assert mod.softcap == (None if want[1] is None else pytest.approx(want[1], rel=1e-2))


def test_alibi_slopes_are_read_per_head() -> None:
    mod = _core(_scaled_masked(0.5, slopes=(-0.5, -0.125))).classify()
    assert mod.alibi == pytest.approx((-0.5, -0.125), rel=1e-5) and mod.window is None


def test_no_mask_is_not_causal() -> None:
    assert not _core(_scaled_masked(causal=False)).classify().causal


def test_a_bias_that_is_not_linear_in_the_distance_is_refused() -> None:
    with pytest.raises(ScoreError, match="not linear in the distance"):
        _core(_scaled_masked(0.5, slopes=(0.1, 0.2), bias_power=2)).classify()


def test_a_mask_that_is_no_window_is_refused() -> None:
    with pytest.raises(ScoreError, match="hides more than a sliding window"):
        _core(_scaled_masked(0.5, extra_hidden=2)).classify()
