"""A tp launch of a decoder export splits its projections as the model's dataflow allows
(``GraphDecoder.shard``): each rank holds its block of every split product, sums the row products'
partial sums with the other ranks, attends with its own heads, and still gives the reference tokens;
the plan predicts the step that runs."""

from __future__ import annotations

import json

import pytest
from cli_runner import run_cli
from corpus.exports import Corpus, form_export
from decode_reference import greedy_tokens

from tessera.core.graph import load_graph
from tessera.core.tensor_parallel import tensor_parallel
from tessera.executor.graph_decoder import GraphDecoder
from tessera.planners.cp.recognize import recognize_decoder

pytestmark = [pytest.mark.corpus]

PROMPTS = [[5, 17, 3, 99, 42, 7, 64, 1, 12, 90], [33, 2, 120, 8, 8, 51]]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "heads_split"), [("llama-gqa", True), ("falcon-mqa", False)])
def test_a_tp_rank_holds_its_shard_of_the_projections_and_decodes_the_reference_tokens(
    model: str, heads_split: bool, corpus: Corpus, tmp_path
) -> None:
    """Llama (grouped-query): every projection split, the cores attend with the rank's heads, two
    all-reduces a layer. Falcon (one KV head): its MLP split, its attention whole on each rank
    (heads gathered after the cores), as the plan says."""
    made = corpus.entries[(model, "dynamo", "dynamic")]
    graph = load_graph(made.path)
    decoder = GraphDecoder(graph, recognize_decoder(graph))
    _, split = decoder.tp_split(graph, 2)
    whole = sum(p.numel() * p.element_size() for p in decoder.module.parameters())
    held = sum(graph.initializers[w].nbytes for w in split.weights)
    assert held > 0.3 * whole  # the MLP at least
    assert all(core.av in split.nodes for core in decoder.cores) == heads_split

    plan = tmp_path / "tp.json"
    planned = run_cli(
        "plan", made.path, "--kind", "cp", "--cluster", "local-cpu-split", "--batch", "2", "--context", "10",
        "--output-len", "5", "--strategy", "tp", "--degree", "2", "-o", str(plan),
    )  # fmt: skip
    assert planned.code == 0, planned.err
    launch = json.loads(plan.read_text())["predicted"]["launch"]
    assert (launch["weights_whole"] < 0.05) == heads_split
    assert {c["what"].split(",")[0] for c in launch["collectives"]} == (
        {"partial sums"} if heads_split else {"partial sums", "attention outputs of the rank's heads"}
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(" ".join(map(str, p)) + "\n" for p in PROMPTS))
    launched = run_cli(
        "launch", str(plan), "--model", made.path, "--prompts", str(prompts), "--new-tokens", "5", "--json",
        "--timeout", "60",
    )  # fmt: skip
    assert launched.code == 0, launched.err
    report = json.loads(launched.out)
    assert report["tokens"] == greedy_tokens(made.path, PROMPTS, 5)
    assert [r["weight_bytes"] for r in report["ranks"]] == [whole - held // 2] * 2


def test_the_decode_split_ignores_what_the_logits_do_not_need() -> None:
    """An export that returns its KV cache: the whole graph's split keeps K and V whole (they reach
    outputs), the decode step's, which computes the logits alone, splits them too."""
    graph = load_graph(str(form_export("mistral-window", "cache-outputs")))
    decoder = GraphDecoder(graph, recognize_decoder(graph))
    _, split = decoder.tp_split(graph, 2)
    assert len(tensor_parallel(graph, 2).weights) < len(split.weights) == 7 * len(decoder.cores)
