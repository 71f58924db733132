"""A decoder as onnxruntime-genai's model builder writes it (``GroupQueryAttention``, its own KV cache
as inputs and outputs; ``tests/gqa_decoder.py``) decodes with cp, tp and dp on 2 ranks exactly the
tokens onnxruntime decodes from the file with its own cache: sliding window, soft-capping,
interleaved and partial rotary and packed QKV included."""

from __future__ import annotations

import onnx
import pytest
from corpus.test_decoders import NEW_TOKENS, PROMPTS
from decode_reference import assert_launches_decode
from gqa_decoder import cached_greedy, gqa_decoder, whole_greedy

pytestmark = [pytest.mark.corpus, pytest.mark.slow]

CASES = {
    "plain": ({}, ("cp", "tp", "dp")),
    "window": ({"window": 3}, ("cp", "tp")),
    "softcap": ({"softcap": 2.0}, ("tp",)),
    "interleaved": ({"interleaved": True}, ("dp",)),
    "packed": ({"packed": True}, ("cp",)),
    "partial": ({"head": 32, "rotary_dim": 16}, ("tp",)),
}


@pytest.mark.parametrize("case", CASES)
def test_a_group_query_attention_decoder_decodes_onnxruntimes_own_cached_tokens(case: str, tmp_path) -> None:
    options, strategies = CASES[case]
    model = gqa_decoder(**options)
    path = tmp_path / f"gqa-{case}.onnx"
    onnx.save(model, path)
    want = cached_greedy(model, PROMPTS, NEW_TOKENS)
    assert want == whole_greedy(model, PROMPTS, NEW_TOKENS)  # the graph's cache and no cache agree
    assert len({t for tokens in want for t in tokens}) > 3
    assert_launches_decode(str(path), PROMPTS, want, strategies, tmp_path)
