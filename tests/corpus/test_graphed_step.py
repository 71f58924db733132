"""The decode step in fixed shapes (what a GPU captures as a CUDA graph, executor/graphed_step.py),
run uncaptured on the CPU: for every kind of score the corpus's decoders compute (plain causal,
sliding window, ALiBi, soft-capping, grouped and single KV heads), a batch of requests decodes the
tokens of onnxruntime running the whole graph, as the dynamic-shape step does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from corpus.exports import Corpus
from decode_reference import greedy_tokens, group_tokens

from tessera.executor import decode_program
from tessera.executor.decode_program import compile_step, self_attention
from tessera.executor.graph_decode_worker import graph_decoder
from tessera.executor.graphed_step import GraphedStep
from tessera.executor.kv_cache import GroupCache

pytestmark = [pytest.mark.corpus]

PROMPTS = [[5, 17, 3, 99, 42, 7, 64, 1], [33, 2, 120, 8, 8, 51, 9, 14]]  # one group: one position
NEW_TOKENS = 12  # past mistral-window's window of 8


@pytest.mark.parametrize(
    "model",
    [
        "gpt2", "llama-gqa-sdpa", "mistral-window", "bloom-alibi", "gemma2-softcap", "falcon-mqa", "mpt-alibi",
        "mixtral-moe", "qwen2-moe",  # routing traced: TopK's k a constant of the graph
    ],
)  # fmt: skip
def test_the_fixed_shape_step_decodes_the_reference_tokens(model: str, corpus: Corpus) -> None:
    made = corpus.entries[(model, "dynamo", "dynamic")]
    assert made.path is not None, made.error
    decoder = graph_decoder(made.path)
    want = greedy_tokens(made.path, PROMPTS, NEW_TOKENS)
    assert len({t for tokens in want for t in tokens}) > 3  # varied tokens: a wrong decode shows
    assert group_tokens(decoder, PROMPTS, NEW_TOKENS, fixed=True) == want
    assert group_tokens(decoder, PROMPTS, NEW_TOKENS, fixed=False) == want


def test_the_fixed_shape_step_needs_a_traced_program_and_every_position(corpus: Corpus) -> None:
    made = corpus.entries[("gpt2", "dynamo", "dynamic")]
    decoder = graph_decoder(made.path)
    cache = GroupCache(np.zeros(8, dtype=np.int64), 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="no traced program"):
        GraphedStep(decoder, cache, 1, capture=False)
    assert compile_step(decoder, 1, 1) is None
    with pytest.raises(ValueError, match="every position"):  # a cp shard: half the positions
        GraphedStep(decoder, GroupCache(np.arange(8) % 2, 0, torch.device("cpu")), 1, capture=False)


@pytest.mark.parametrize("model", ["gpt2", "gemma2-softcap", "bloom-alibi", "falcon-mqa", "qwen2-moe"])
def test_a_traced_step_runs_torch_s_own_bindings_and_computes_the_same_bits(
    model: str, corpus: Corpus
) -> None:
    """The traced program calls ``torch.mm``, ``torch._C._nn.gelu``, tensor methods, not aten's
    ``OpOverload``s (each 1.2-1.6 µs a call more), and its logits are those of the aten program
    bit for bit, at tokens and positions it was not checked at."""
    made = corpus.entries[(model, "dynamo", "dynamic")]
    decoder = graph_decoder(made.path)
    assert compile_step(decoder, 2, 1) is None
    program = decoder.programs[(2, 1)]
    assert program.program is not program.graph_module
    aten = [n for n in program.program.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    assert len(aten) < program.operations / 5, [str(n.target) for n in aten]
    for past in (4, 9):
        tokens = torch.tensor([[past * 7 % decoder.vocab], [past * 3 % decoder.vocab]])
        fast = program.run(tokens, past, self_attention)
        program.program, bound = program.graph_module, program.program
        assert torch.equal(program.run(tokens, past, self_attention), fast)
        program.program = bound


def test_a_step_whose_bindings_compute_other_bits_keeps_the_aten_program(corpus: Corpus, monkeypatch) -> None:
    made = corpus.entries[("gpt2", "dynamo", "dynamic")]
    decoder = graph_decoder(made.path)
    bindings = decode_program._bindings

    def nudged(traced):  # bindings whose logits differ in their last bits
        bound = bindings(traced)
        return lambda *args: torch.nextafter(bound(*args), torch.tensor(float("inf")))

    monkeypatch.setattr(decode_program, "_bindings", nudged)
    assert compile_step(decoder, 2, 1) is None
    program = decoder.programs[(2, 1)]
    assert program.program is program.graph_module
