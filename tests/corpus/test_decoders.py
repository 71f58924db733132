"""The corpus's decoders (issue #27): every export of GPT-2, Llama-GQA, Qwen2 and Phi, both exporters,
eager and SDPA attention, is recognized by ``plan --kind cp`` with the sizes its transformers config
was built with, ``inspect`` reports the block structure (rotary, norm, residual, QKV), and cp, tp and
dp launches on 2 CPU ranks, decoding from the export's own graph, continue given prompts with exactly
the greedy tokens of onnxruntime running the whole graph without a cache."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from cli_runner import run_cli
from corpus.exports import ENTRIES, Corpus, form_export
from corpus.models import MODELS, configured
from decode_reference import assert_launches_decode, greedy_tokens, torch_greedy

from tessera.core.graph import load_graph
from tessera.planners.cp.recognize import recognize_decoder

pytestmark = [pytest.mark.corpus]

DECODERS = [e for e in ENTRIES if MODELS[e[0]].decoder]


def _configured(corpus: Corpus, model: str) -> dict[str, object]:
    return configured(model, corpus.reference(model)[0].model.config)


@pytest.mark.parametrize("key", DECODERS, ids=["-".join(e) for e in DECODERS])
def test_every_decoder_export_is_recognized_with_its_configured_sizes(key, corpus: Corpus) -> None:
    made = corpus.entries[key]
    assert made.path is not None, made.error  # every decoder exports (with an all-ones mask)
    decoder = recognize_decoder(load_graph(made.path, input_shapes=corpus.input_shapes(key)))
    found = decoder.to_json()
    want = _configured(corpus, made.model)
    assert {k: found[k] for k in want} == want
    assert len(found["attention"]) == want["layers"]
    if made.batch == "dynamic" and made.model.startswith("gpt2"):  # learned positions: n_positions rows
        assert decoder.positions == corpus.reference(made.model)[0].model.config.n_positions


@pytest.mark.parametrize("key", [e for e in DECODERS if e[2] == "dynamic"], ids=lambda e: "-".join(e))
def test_inspect_reports_the_decoder_and_plan_cp_accepts_it(key, corpus: Corpus, tmp_path) -> None:
    made = corpus.entries[key]
    report = run_cli("inspect", made.path, "--json")
    assert report.code == 0, report.err
    decoder = json.loads(report.out)["decoder"]
    assert decoder["recognized"] and decoder["kv_heads"] == _configured(corpus, made.model)["kv_heads"]
    text = run_cli("inspect", made.path).out  # what modifies the scores, said in the text report too
    assert ("attention sinks" in text) == any(decoder["layer_sinks"]), text
    assert ("window " in text) == any(w is not None for w in decoder["layer_windows"]), text
    assert (f"soft-cap {decoder['softcap']}" in text) == (decoder["softcap"] is not None), text
    plan = run_cli(
        "plan", made.path, "--kind", "cp", "--cluster", "local-cpu-split", "--batch", "2", "--context", "24",
        "--output-len", "4", "-o", str(tmp_path / "cp.json"),
    )  # fmt: skip
    assert plan.code == 0, plan.err
    llm = json.loads((tmp_path / "cp.json").read_text())["llm"]
    assert (llm["heads"], llm["kv_heads"]) == (decoder["heads"], decoder["kv_heads"])


@pytest.mark.parametrize("key", [e for e in ENTRIES if e[0] == "bert"], ids=lambda e: "-".join(e))
def test_an_encoder_export_is_refused_naming_its_softmax(key, corpus: Corpus) -> None:
    made = corpus.entries[key]
    result = run_cli("plan", made.path, "--kind", "cp", "--cluster", "local-cpu-split", "--batch", "2",
                     "--context", "16", "--input-shape", f"input_ids={'x'.join(map(str, made.shape))}")  # fmt: skip
    assert result.code == 2 and "no causal self-attention found" in result.err and "Softmax" in result.err


PROMPTS = [[5, 17, 3, 99, 42, 7, 64, 1, 12, 90], [33, 2, 120, 8, 8, 51], [77, 19, 4, 4, 101, 60]]
NEW_TOKENS = 5


@pytest.mark.slow
@pytest.mark.parametrize("key", [e for e in DECODERS if e[2] == "dynamic"], ids=lambda e: "-".join(e))
def test_cp_tp_and_dp_launches_continue_prompts_with_the_reference_tokens(
    key, corpus: Corpus, tmp_path
) -> None:
    made = corpus.entries[key]
    want = greedy_tokens(made.path, PROMPTS, NEW_TOKENS)
    assert len({t for tokens in want for t in tokens}) > 3  # varied tokens: a wrong decode shows
    assert_launches_decode(made.path, PROMPTS, want, ("cp", "tp", "dp"), tmp_path)


@pytest.mark.parametrize("key", [e for e in DECODERS if e[2] == "static"], ids=lambda e: "-".join(e))
def test_a_decoder_with_a_fixed_sequence_is_refused_at_plan_time_with_the_fix(
    key, corpus: Corpus, tmp_path
) -> None:
    made = corpus.entries[key]
    out = tmp_path / "cp.json"
    result = run_cli("plan", made.path, "--kind", "cp", "--cluster", "local-cpu-split", "--batch", "2",
                     "--context", "8", "--output-len", "4", "-o", str(out))  # fmt: skip
    assert result.code == 2 and "fixed sequence length of 16" in result.err, result.err
    assert "export with a dynamic sequence axis" in result.err and not out.exists()


@pytest.mark.slow
def test_a_batch_fixed_at_one_decodes_one_request_and_refuses_more_with_the_cause(tmp_path) -> None:
    # Qwen2 exported plainly from an example of batch 1, with a dynamic batch asked for: torch.export
    # fixes the batch at 1 anyway.
    batch1_export = str(form_export("qwen2-plain", "batch1"))
    args = [
        "--kind",
        "cp",
        "--cluster",
        "local-cpu-split",
        "--context",
        "10",
        "--output-len",
        str(NEW_TOKENS),
    ]
    refused = run_cli("plan", batch1_export, *args, "--batch", "4", "-o", str(tmp_path / "no.json"))
    assert refused.code == 2 and "fixed batch of 1" in refused.err, refused.err
    assert "example batch of 2 or more" in refused.err and not (tmp_path / "no.json").exists()
    want = greedy_tokens(batch1_export, PROMPTS[:1], NEW_TOKENS)
    assert_launches_decode(batch1_export, PROMPTS[:1], want, ("cp", "tp"), tmp_path, batch=1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "form"),
    [
        ("qwen2-plain", "mask-input"),
        ("mistral-window", "mask-input"),
        ("gemma2-softcap", "mask-position-input"),  # position ids fed from each request's positions
        ("mistral-window", "cache-outputs"),  # the export returns its KV cache: outputs not computed
    ],
)
def test_an_export_with_a_mask_input_decodes_exactly(family: str, form: str, tmp_path) -> None:
    path = str(form_export(family, form))
    want = greedy_tokens(path, PROMPTS, NEW_TOKENS)
    assert_launches_decode(path, PROMPTS, want, ("cp", "tp", "dp"), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "kv_heads", "strategies"),
    [("qwen2-plain", 2, ("cp", "tp", "dp")), ("gptj-interleaved", 4, ("cp",))],
)
def test_a_bf16_export_decodes_as_its_torch_module(
    family: str, kv_heads: int, strategies: tuple, corpus: Corpus, tmp_path
) -> None:
    """bf16 weights: onnxruntime has no CPU kernels for them, so the recognizer's probes run in
    tessera's torch executor; cp, tp and dp give the bf16 torch module's own greedy tokens. GPT-J
    scores in fp32 beside bf16 values (cp's fused kernel takes one dtype: it failed the worker)."""
    path = str(form_export(family, "bf16"))
    decoder = recognize_decoder(load_graph(path))
    assert decoder.config.dtype == "bf16" and (decoder.config.heads, decoder.config.kv_heads) == (4, kv_heads)
    module = copy.deepcopy(corpus.reference(family)[0]).to(torch.bfloat16)  # the corpus's stays fp32
    want = torch_greedy(module, PROMPTS, NEW_TOKENS)
    assert len({t for tokens in want for t in tokens}) > 3
    assert_launches_decode(path, PROMPTS, want, strategies, tmp_path)


@pytest.mark.parametrize("family", ["opt-learned", "gptj-interleaved"])
def test_a_position_table_bounds_the_positions_a_request_holds(family: str, corpus: Corpus, tmp_path) -> None:
    # OPT adds 2 to every position before indexing its table of max_position_embeddings + 2 rows;
    # GPT-J reads its sin/cos rows (max_position_embeddings of them) by GatherND: a request holds
    # max_position_embeddings positions, which plan and launch both enforce.
    made = corpus.entries[(family, "dynamo", "dynamic")]
    rows = corpus.reference(family)[0].model.config.max_position_embeddings
    out = tmp_path / "cp.json"
    base = ["plan", made.path, "--kind", "cp", "--cluster", "local-cpu-split", "--batch", "1", "-o", str(out)]
    result = run_cli(
        *base, "--context", str(rows - 8), "--output-len", "10"
    )  # the last token is not fed back
    assert result.code == 2 and f"model holds {rows} positions" in result.err, result.err
    assert run_cli(*base, "--context", str(rows - 8), "--output-len", "9").code == 0
