"""Shapes are known or said to be unknown: what ONNX's shape inference leaves symbolic in a legacy
torch export (``unk__N`` dims behind computed Reshape targets) is resolved by onnxruntime's symbolic
shape inference, and operators whose shapes no inference can know are named, never counted 0 silently."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch
from cli_runner import run_cli
from onnx import TensorProto, helper
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tessera.core.graph import load_graph
from tessera.core.onnx_io import bind_input_shapes, unresolved_tensors


class _Attention(nn.Module):
    """A causal self-attention block written as transformers' eager GPT-2 attention is, with a
    tied embedding and LM head."""

    def __init__(self, hidden: int = 32, heads: int = 4, vocab: int = 50) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        y = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        return self.head(x + self.out(y))


@pytest.fixture(scope="module")
def legacy_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The block exported by torch's legacy exporter with dynamic batch and sequence, and the
    FLOPs torch counts for a forward at batch 2, sequence 8."""
    torch.manual_seed(0)
    model = _Attention().eval()
    ids = torch.randint(0, 50, (2, 8))
    path = tmp_path_factory.mktemp("legacy") / "attention.onnx"
    axes = {"ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}}
    torch.onnx.export(
        model, (ids,), str(path), dynamo=False, opset_version=17,
        input_names=["ids"], output_names=["logits"], dynamic_axes=axes,
    )  # fmt: skip
    with FlopCounterMode(display=False) as counter:
        model(ids)
    return path, counter.get_total_flops()


def test_onnx_inference_alone_leaves_the_attention_unresolved(legacy_export) -> None:
    """The failure this guards against: with ONNX's inference only, the attention's Reshapes and
    MatMuls have no shape (they counted 0 FLOPs)."""
    path, _ = legacy_export
    model = onnx.load(str(path))
    bind_input_shapes(model, {"ids": (2, 8)}, label="attention.onnx")
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    producers = {o: n.op_type for n in inferred.graph.node for o in n.output}
    assert {"MatMul", "Reshape"} <= {producers[t] for t in unresolved_tensors(inferred)}


def test_a_legacy_export_is_fully_shaped_and_counted(legacy_export) -> None:
    path, torch_flops = legacy_export
    graph = load_graph(str(path), input_shapes={"ids": (2, 8)})
    assert graph.unknown_shapes == ()
    assert graph.unknown_shapes_message() is None
    matmul = sum(op.flops for op in graph.ops() if op.op_type in ("MatMul", "Gemm"))
    assert matmul == torch_flops  # torch counts the products; every one of them is here
    assert torch_flops * 0.9 <= graph.total_flops <= torch_flops * 1.25


def _data_dependent(tmp_path: Path) -> Path:
    """NonZero's output length depends on the values: no inference can know it."""
    nodes = [
        helper.make_node("NonZero", ["x"], ["nz"], name="nonzero"),
        helper.make_node("Transpose", ["nz"], ["idx"], name="transpose"),
        helper.make_node("Cast", ["idx"], ["idxf"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("MatMul", ["idxf", "w"], ["y"], name="matmul"),
    ]
    graph = helper.make_graph(
        nodes,
        "data_dependent",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor("w", TensorProto.FLOAT, [2, 3], [0.5] * 6)],
    )
    path = tmp_path / "nonzero.onnx"
    path.write_bytes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    )
    return path


def test_operators_whose_shapes_stay_unknown_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _data_dependent(tmp_path)
    monkeypatch.chdir(tmp_path)
    graph = load_graph(str(path))
    assert "matmul" in graph.unknown_shapes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nonzero.onnx"]  # onnxruntime's tool left nothing
    result = run_cli("inspect", str(path), "--json")
    assert result.code == 0, result.err
    assert '"matmul"' in result.out  # listed under unknown_shapes
    warning = [line for line in result.err.splitlines() if "warning" in line]
    assert len(warning) == 1 and str(path) in warning[0]
    assert "4 operator(s)" in warning[0] and "NonZero 'nonzero'" in warning[0] and "and 1 more" in warning[0]
    assert "count as 0" in warning[0] and "--input-shape" in warning[0]


def test_lazy_weights_do_not_stop_the_symbolic_inference() -> None:
    """onnxruntime's symbolic inference cannot read lazy (or external) weights: they are given to it
    as inputs of their shape, so the paper GPT's positions (a Range over the input's length) resolve."""
    from tessera.models import build

    graph = load_graph(build("gpt", "paper"))
    assert graph.unknown_shapes == ()
    assert graph.tensors["embed/position/range"].shape == (1024,)


def test_positions_resolve_without_onnxruntimes_symbolic_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Range over the input's length (ONNX's inference leaves it ``unk__N``) is folded by tessera
    itself: shapes do not hang on onnxruntime's tool, whose coverage varies by version (1.30 ignores
    Shape's start/end and gives up on the GPT's positions)."""
    import tessera.core.onnx_io as onnx_io
    from tessera.models import build

    monkeypatch.setattr(onnx_io, "_symbolic_shapes", lambda model: None)
    graph = load_graph(build("gpt", "paper"))
    assert graph.unknown_shapes == ()
    assert graph.tensors["embed/position/range"].shape == (1024,)
    assert graph.tensors["layer0/attn/q_heads/transpose"].shape == (1, 12, 1024, 64)
    assert graph.tensors["layer0/attn/mask_fill"].shape == (1024, 1024)


def test_an_llm_gpt_is_recognized_without_onnxruntimes_symbolic_inference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``launch`` of an ``--llm`` plan builds (a symbolic sequence bound to 1) is a decoder
    whatever onnxruntime's tool does: Q's shape [1, H, 1, D] is known."""
    import tessera.core.onnx_io as onnx_io
    from tessera.core.weights import materialize
    from tessera.models.gpt import llm_gpt
    from tessera.planners.cp.recognize import recognize_decoder

    monkeypatch.setattr(onnx_io, "_symbolic_shapes", lambda model: None)
    llm = {"layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 96, "tied_embeddings": True}
    decoder = recognize_decoder(load_graph(materialize(llm_gpt(llm)), label="--llm tiny"))
    assert (decoder.config.layers, decoder.config.heads, decoder.config.head_dim) == (2, 4, 16)
