"""``plan --export``: a training plan as Megatron-LM's pipeline layout (whole decoder layers along a
chain, found from the graph's attention), a decoding plan as vLLM's, SGLang's and TensorRT-LLM's
arguments, each refused with the engine's reason where it cannot run the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from executor.plans import make_plan

from tessera.core.graph import load_graph
from tessera.core.plans import load_plan
from tessera.models import build
from tessera.planners.cp.recognize import recognize_decoder
from tessera.planners.cp.serving import serving_configs
from tessera.planners.pipeline.exports import megatron_config


@pytest.fixture(scope="module")
def gpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("zoo") / "gpt.onnx"
    path.write_bytes(build("gpt", "tiny", seed=0).SerializeToString())
    return path


def _split(gpt: Path, at: str):
    """A two-stage chain of the zoo GPT cut before node ``at``."""
    graph = load_graph(str(gpt))
    order = graph.order
    cut = order.index(at)
    return graph, make_plan(graph, [(order[:cut], ["d0"], 2), (order[cut:], ["d1"], 2)], 8)


def test_a_cut_between_layers_is_a_megatron_layout(gpt: Path) -> None:
    graph = load_graph(str(gpt))
    cores = recognize_decoder(graph).cores
    graph, plan = _split(gpt, cores[1].q_projection)
    made = megatron_config(plan, graph)
    assert made["expressible"], made["why"]
    args = dict(zip(made["args"][::2], made["args"][1::2], strict=True))
    assert args["--pipeline-model-parallel-layout"] == "Et|tL"
    assert args["--num-layers"] == str(len(cores)) == "2"
    assert args["--pipeline-model-parallel-size"] == "2" and args["--global-batch-size"] == "8"
    assert args["--micro-batch-size"] == "2"


def test_a_cut_inside_a_layer_is_refused_naming_it(gpt: Path) -> None:
    graph = load_graph(str(gpt))
    core = recognize_decoder(graph).cores[0]
    order = graph.order
    ffn = next(  # the first weight product after layer 0's attention output projection: its FFN
        n for n in order[order.index(core.out_projection) + 1 :]
        if graph.op(n).op_type in ("MatMul", "Gemm") and any(t in graph.initializers for t in graph.op(n).inputs)
    )  # fmt: skip
    graph, plan = _split(gpt, ffn)
    made = megatron_config(plan, graph)
    assert not made["expressible"] and "cut decoder layer 0" in made["why"]


def test_plan_export_megatron_through_the_cli(gpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = run_cli("plan", str(gpt), "--cluster", "local-cpu-split", "--mini-batch", "8", "--export", "megatron",
                     "-o", str(out))  # fmt: skip
    assert result.code == 0, result.err
    assert "megatron: torchrun pretrain_gpt.py --num-layers 2" in result.out
    assert load_plan(str(out)).exports["megatron"]["expressible"]
    plain = tmp_path / "plain.json"
    assert (
        run_cli("plan", str(gpt), "--cluster", "local-cpu-split", "--mini-batch", "8", "-o", str(plain)).code
        == 0
    )
    assert "exports" not in json.loads(plain.read_text())  # without --export the plan reads as before


def test_a_graph_of_stages_or_a_model_without_a_decoder_is_refused(gpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "dag.json"
    result = run_cli("plan", str(gpt), "--cluster", "graphpipe-v100", "--mini-batch", "64", "--devices", "8",
                     "--export", "megatron", "-o", str(out))  # fmt: skip
    assert result.code == 2 and "--export megatron: Megatron-LM runs a chain of stages" in result.err
    assert out.is_file()  # the plan is written first
    mmt = tmp_path / "mmt.onnx"
    mmt.write_bytes(build("mmt", "tiny", seed=0).SerializeToString())
    result = run_cli(
        "plan", str(mmt), "--cluster", "local-cpu-split", "--mini-batch", "8", "--export", "megatron"
    )
    assert result.code == 2 and "no decoder was recognized" in result.err


@pytest.mark.parametrize(
    ("strategy", "expressible"),
    [("dp", {"vllm": True, "sglang": True, "trtllm": False}), ("tp", dict.fromkeys(("vllm", "sglang", "trtllm"), True)),
     ("cp", {"vllm": False, "sglang": False, "trtllm": False})],
)  # fmt: skip
def test_each_serving_engine_gets_the_plan_or_its_reason(strategy: str, expressible: dict) -> None:
    made = serving_configs(strategy, 4, heads=32, kv_heads=8)
    assert {engine: m["expressible"] for engine, m in made.items()} == expressible
    for m in made.values():
        assert m["why"] and (m["args"] or not m["expressible"])
    assert made["sglang"]["args"] == (
        ["--dp-size", "4"] if strategy == "dp" else ["--tp-size", "4"] if strategy == "tp" else []
    )
    if strategy == "cp":
        assert "MLA" in made["sglang"]["why"] and "Helix" in made["trtllm"]["why"]


def test_plan_export_for_a_cp_plan(tmp_path: Path) -> None:
    base = [
        "plan",
        "--kind",
        "cp",
        "--llm",
        "llama-7b",
        "--cluster",
        "a5000-4x",
        "--batch",
        "8",
        "--context",
        "4K",
    ]
    result = run_cli(*base, "--strategy", "tp", "--degree", "4", "--export", "trtllm")
    assert result.code == 0 and "TensorRT-LLM: trtllm-serve MODEL --tp_size 4" in result.out
    out = tmp_path / "cp.json"
    result = run_cli(*base, "--strategy", "cp", "--degree", "4", "--export", "sglang", "-o", str(out))
    assert result.code == 2 and "--export sglang: SGLang's --dcp-size" in result.err and out.is_file()
    result = run_cli(*base, "--export", "megatron")
    assert result.code == 2 and "--export megatron applies to --kind gpp or spp, not cp" in result.err
