"""Decoding refuses a graph in which something besides attention carries earlier positions into a
step (executor/step_check.py): the zoo GPT with a causal convolution or a running sum over the
sequence added to its hidden state, or a node that fails on a step's one position, is refused at
plan time and at launch, naming the node."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_runner import run_cli
from onnx import helper, numpy_helper

from tessera.executor.graph_decode_worker import graph_decoder
from tessera.executor.step_check import NotStepwise
from tessera.models import build

HIDDEN = 32  # the zoo GPT tiny's


def _mixed(kind: str) -> onnx.ModelProto:
    """The zoo GPT whose embeddings get, added to them, a causal depthwise convolution over the
    sequence (kernel 3, as LFM2's and Mamba's short convolutions) or a running sum (a scan)."""
    model = build("gpt", "tiny", seed=3, kv_heads=2, seq=96)
    graph = model.graph
    source = "embed/position/add"  # [B, S, hidden]: the first layer reads it
    rng = np.random.default_rng(0)
    if kind == "conv":
        weight = rng.normal(0, 0.5, (HIDDEN, 1, 3)).astype(np.float32)
        graph.initializer.append(numpy_helper.from_array(weight, "mix/weight"))
        nodes = [
            helper.make_node("Transpose", [source], ["mix/channels"], perm=[0, 2, 1], name="mix/transpose"),
            helper.make_node("Conv", ["mix/channels", "mix/weight"], ["mix/conv"], group=HIDDEN, pads=[2, 0],
                             name="mix/conv"),
            helper.make_node("Transpose", ["mix/conv"], ["mix/out"], perm=[0, 2, 1], name="mix/back"),
        ]  # fmt: skip
    elif kind == "cumsum":
        graph.initializer.append(numpy_helper.from_array(np.array(1, np.int64), "mix/axis"))
        nodes = [helper.make_node("CumSum", [source, "mix/axis"], ["mix/out"], name="mix/cumsum")]
    elif kind == "gather":  # each position's hidden state picked by its absolute position (the
        # identity over a whole sequence; a step holds one position: its index is out of range)
        nodes = [
            helper.make_node(
                "Gather", [source, "embed/position/range"], ["mix/out"], axis=1, name="mix/gather"
            )
        ]
    else:  # the running sum in bf16: the check's tolerance is then bf16's
        graph.initializer.append(numpy_helper.from_array(np.array(1, np.int64), "mix/axis"))
        nodes = [
            helper.make_node("Cast", [source], ["mix/low"], to=onnx.TensorProto.BFLOAT16, name="mix/low"),
            helper.make_node("CumSum", ["mix/low", "mix/axis"], ["mix/sum16"], name="mix/cumsum"),
            helper.make_node("Cast", ["mix/sum16"], ["mix/out"], to=onnx.TensorProto.FLOAT, name="mix/back"),
        ]
    nodes.append(helper.make_node("Add", [source, "mix/out"], ["mix/sum"], name="mix/add"))
    at = next(i for i, node in enumerate(graph.node) if node.name == source) + 1
    for node in graph.node[at:]:
        node.input[:] = ["mix/sum" if name == source else name for name in node.input]
    for offset, node in enumerate(nodes):
        graph.node.insert(at + offset, node)
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize(
    ("kind", "node"),
    [("conv", "mix/conv"), ("cumsum", "mix/cumsum"), ("cumsum-bf16", "mix/cumsum"), ("gather", "mix/gather")],
)
def test_a_graph_mixing_positions_outside_attention_is_refused_naming_the_node(
    kind: str, node: str, tmp_path: Path
) -> None:
    path = tmp_path / f"{kind}.onnx"
    path.write_bytes(_mixed(kind).SerializeToString())
    with pytest.raises(NotStepwise, match=f"node '{node}'"):
        graph_decoder(str(path))
    planned = run_cli(
        "plan", str(path), "--kind", "cp", "--cluster", "local-cpu-split", "--batch", "2", "--context", "16",
        "--output-len", "4", "--strategy", "cp", "--degree", "2", "-o", str(tmp_path / "plan.json"),
    )  # fmt: skip
    assert planned.code == 2 and f"node '{node}'" in planned.err and "exactly" in planned.err
    assert "Traceback" not in planned.err and not (tmp_path / "plan.json").exists()


def test_a_graph_that_runs_only_at_its_exported_length_is_refused_at_plan_time(tmp_path: Path) -> None:
    """A reshape to the exported sequence length inside the hidden path (as a Mamba block's exports)
    breaks the graph at any other length. launch refused it; plan wrote the plan first (exit 0)."""
    model = build("gpt", "tiny", seed=3, kv_heads=2, seq=96)
    graph = model.graph
    source = "embed/position/add"
    graph.initializer.append(numpy_helper.from_array(np.array([-1, 96, HIDDEN], np.int64), "fix/shape"))
    at = next(i for i, node in enumerate(graph.node) if node.name == source) + 1
    for node in graph.node[at:]:
        node.input[:] = ["fix/out" if name == source else name for name in node.input]
    graph.node.insert(at, helper.make_node("Reshape", [source, "fix/shape"], ["fix/out"], name="fix/reshape"))
    path = tmp_path / "fixed.onnx"
    path.write_bytes(model.SerializeToString())
    planned = run_cli(
        "plan", str(path), "--kind", "cp", "--cluster", "local-cpu-split", "--batch", "2", "--context", "16",
        "--output-len", "4", "-o", str(tmp_path / "plan.json"),
    )  # fmt: skip
    assert planned.code == 2 and "runs only at its exported sequence length of 96" in planned.err
    assert "node 'fix/reshape'" in planned.err and "dynamic sequence axis" in planned.err
    assert len(planned.err.strip().splitlines()) == 1 and not (tmp_path / "plan.json").exists()
