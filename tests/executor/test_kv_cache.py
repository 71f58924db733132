"""The decode step's pieces: attention over any shard of a static KV cache, the cache itself, and
the traced step program's refusal of a value it would freeze."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.executor.decode_program import compile_step, self_attention
from tessera.executor.graph_decode_worker import graph_decoder
from tessera.executor.kv_cache import (
    GroupCache,
    attention_partial,
    decode_partial,
    decode_scored,
    whole_decode,
)
from tessera.kernels import merge_partials
from tessera.models import build
from tessera.planners.cp.scores import ScoreMod

SLOPES = (-0.5, -0.25, -0.125, -0.0625)


@pytest.fixture
def gpt(tmp_path: Path) -> Path:
    path = tmp_path / "gpt.onnx"
    path.write_bytes(build("gpt", "tiny", seed=3, kv_heads=2, seq=96).SerializeToString())
    return path


@pytest.mark.parametrize(
    "mod",
    [
        ScoreMod(0.3, True),
        ScoreMod(0.3, True, window=5),
        ScoreMod(0.3, True, softcap=2.0, alibi=SLOPES),
        ScoreMod(0.3, True, window=3, alibi=SLOPES),
        ScoreMod(0.3, True, window=4, sinks=(0.5, -1.0, 2.0, 0.0)),
    ],
    ids=["causal", "window", "softcap-alibi", "window-alibi", "window-sinks"],
)
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attention_over_cache_shards_merges_to_the_whole_cache(mod: ScoreMod, kv_heads: int) -> None:
    """Masks and biases by absolute position, grouped KV heads read once: any split of the positions
    merges exactly to full softmax attention with the modification applied to every (i, j); a
    per-head sink (one more logit, of value 0) held by one shard, as GPT-OSS's softmax over the
    scores joined with it."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, 12, 8, generator=g) for _ in range(2))
    q_pos, k_pos = torch.arange(9, 12), torch.arange(12)
    whole, whole_lse = attention_partial(q, k, v, q_pos, k_pos, mod)
    shards = [torch.tensor([0, 1, 2, 7, 8]), torch.tensor([3, 4, 5, 6, 9, 10, 11])]
    parts = [
        attention_partial(q, k[:, :, s], v[:, :, s], q_pos, k_pos[s], mod, sink=i == 0)
        for i, s in enumerate(shards)
    ]
    o, lse = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(o, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-6)
    kr, vr = (t.repeat_interleave(4 // kv_heads, dim=1) for t in (k, v))
    s = q @ kr.transpose(-1, -2) * mod.scale
    if mod.softcap:
        s = torch.tanh(s / mod.softcap) * mod.softcap
    dist = k_pos[None, :] - q_pos[:, None]
    if mod.alibi:
        s = s + torch.tensor(mod.alibi)[:, None, None] * dist
    hidden = (dist > 0) | ((dist <= -mod.window) if mod.window else torch.zeros_like(dist, dtype=torch.bool))
    s = s.masked_fill(hidden, float("-inf"))
    if mod.sinks:  # softmax over [s, sink], the sink's column dropped
        sink = torch.tensor(mod.sinks)[None, :, None, None].expand(*s.shape[:-1], 1)
        want = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1] @ vr
    else:
        want = torch.softmax(s, dim=-1) @ vr
    torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-6)


def test_a_shard_that_holds_no_key_yet_is_an_empty_partial() -> None:
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 0, 8)
    o, lse = attention_partial(
        q, k, k, torch.tensor([5]), torch.zeros(0, dtype=torch.long), ScoreMod(0.3, True)
    )
    assert o.shape == (1, 4, 1, 8) and not o.any() and torch.isinf(lse).all()


def test_the_cache_keeps_its_ranks_positions_in_place_and_repeated_heads_once() -> None:
    """Positions 0..9 dealt to ranks 0 and 1; rank 1's cache holds exactly its positions, in the
    order they came, in slots preallocated for all of them; K/V heads the graph repeats (two query
    heads per KV head) are stored once."""
    owner = np.array([0, 0, 1, 1, 1, 0, 1, 0, 1, 1])
    cache = GroupCache(owner, 1, torch.device("cpu"))
    assert cache.slots == 6
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 10, 4, generator=g).repeat_interleave(2, dim=1)  # [B, 4 heads (2 distinct), S, D]
    held = cache.write(0, kv[:, :, :7], kv[:, :, :7], 0)  # a prefill of 7 positions
    buffer = cache.layers[0][0]
    held = cache.write(0, kv[:, :, 7:8], kv[:, :, 7:8], 7)  # position 7 is rank 0's
    held = cache.write(0, kv[:, :, 8:9], kv[:, :, 8:9], 8)
    keys, values, positions = cache.read(0, held)
    assert positions.tolist() == [2, 3, 4, 6, 8]
    assert keys.shape == (2, 2, 5, 4) and cache.layers[0][0] is buffer  # written in place
    torch.testing.assert_close(keys, kv[:, ::2, [2, 3, 4, 6, 8]])
    assert cache.nbytes == 2 * 2 * 2 * 6 * 4 * 4  # K and V, [2, 2, 6, 4] fp32: the planned slots


def test_heads_that_differ_are_all_stored() -> None:
    cache = GroupCache(np.zeros(3, dtype=np.int64), 0, torch.device("cpu"))
    k = torch.randn(1, 4, 3, 8)
    cache.write(0, k, k, 0)
    assert cache.read(0, 3)[0].shape == (1, 4, 3, 8)


def test_a_step_that_would_freeze_a_value_is_refused_and_stays_interpreted(gpt: Path) -> None:
    """An operator that reads a tensor's values in Python (here: one Add of the graph turned into
    one) would be frozen by the trace at the traced tokens: the check against the graph at other
    tokens and positions refuses the program, and the step is interpreted, still exact."""
    decoder = graph_decoder(str(gpt))
    steps = decoder.module._nodes
    i = next(i for i, s in enumerate(steps) if s.op_type == "Add" and s.name in decoder.needed)
    add = steps[i].fn
    steps[i] = steps[i]._replace(
        fn=lambda args, attrs: add([torch.tensor(args[0].tolist()), *args[1:]], attrs)
    )
    why = compile_step(decoder, 1, 1)
    assert why is not None and "frozen" in why
    assert (1, 1) not in decoder.programs
    tokens = torch.tensor([[7]])
    torch.testing.assert_close(
        decoder.logits(tokens, 3, self_attention), decoder.interpret(tokens, 3, self_attention)
    )


def test_a_traced_step_folds_the_shape_arithmetic_and_computes_what_the_graph_does(gpt: Path) -> None:
    """The graph's Shape arithmetic is folded at trace time; a batch-2 step computes the graph's
    logits at a position it was not traced at."""
    decoder = graph_decoder(str(gpt))
    assert compile_step(decoder, 2, 1) is None
    program = decoder.programs[(2, 1)]
    shape_ops = sum(
        1
        for s in decoder.module.steps()
        if s.name in decoder.needed and s.op_type in ("Shape", "Gather", "Concat", "Unsqueeze")
    )
    assert shape_ops > 0
    assert not any("shape" in str(n.target) for n in program.graph_module.graph.nodes)
    tokens = torch.tensor([[7], [9]])
    torch.testing.assert_close(
        program.run(tokens, 5, self_attention),
        decoder.interpret(tokens, 5, self_attention),
        rtol=1e-5,
        atol=1e-6,
    )


def test_the_fused_decode_partial_is_the_reference_partial() -> None:
    """torch's fused CPU kernel, each KV head's query heads as its queries, gives the same output and
    log-sum-exp as the reference for grouped heads (and defers where it does not apply)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, generator=g)
    k, v = (torch.randn(2, 2, 30, 16, generator=g) for _ in range(2))
    fused = decode_partial(q, k, v, 0.25)
    assert fused is not None
    o, lse = attention_partial(
        q[:, :, None], k, v, torch.tensor([29]), torch.arange(30), ScoreMod(0.25, True)
    )
    torch.testing.assert_close(fused[0], o[:, :, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused[1], lse[:, :, 0], rtol=1e-5, atol=1e-6)
    assert decode_partial(q, k[:, :, :0], v[:, :, :0], 0.25) is None  # no keys: the caller's kernel
    # GPT-J scores in fp32 whatever its weights: bf16 values beside fp32 queries and keys (the fused
    # kernel takes one dtype; it failed the worker) go to the caller's kernel
    assert decode_partial(q, k, v.to(torch.bfloat16), 0.25) is None


SCORED = [
    ScoreMod(0.3, True, window=5),
    ScoreMod(0.3, True, alibi=SLOPES),
    ScoreMod(0.3, True, window=3, alibi=SLOPES),
    ScoreMod(0.3, True, softcap=2.0),
    ScoreMod(0.3, True, softcap=2.0, window=4, alibi=SLOPES),
    ScoreMod(0.3, True, window=4, sinks=(0.5, -1.0, 2.0, 0.0)),
]
SCORED_IDS = ["window", "alibi", "window-alibi", "softcap", "softcap-window-alibi", "sinks"]


@pytest.mark.parametrize("mod", SCORED, ids=SCORED_IDS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_the_fused_partial_of_scored_attention_is_the_reference_on_any_shard(
    mod: ScoreMod, kv_heads: int
) -> None:
    """A window and ALiBi as an additive mask in torch's fused kernel: the reference's output and
    log-sum-exp on any shard of positions, a shard whose keys the queries cannot see (past the
    window) an empty partial (lse -inf, as the merge needs), and a heads slice its own slopes."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 3, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, 12, 8, generator=g) for _ in range(2))
    q_pos = torch.arange(19, 22)
    for k_pos in (torch.arange(12) + 10, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20])):
        for heads, hq in ((slice(None), q), (slice(2, 4), q[:, 2:4])):
            hk, hv = (k, v) if kv_heads < 4 else (k[:, heads], v[:, heads])
            want = attention_partial(hq, hk, hv, q_pos, k_pos, mod, heads)
            got = attention_partial(hq, hk, hv, q_pos, k_pos, mod, heads, fused=True)
            assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1]))
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
            seen = torch.isfinite(want[1])
            torch.testing.assert_close(got[1][seen], want[1][seen], rtol=1e-5, atol=1e-6)
    far = attention_partial(
        q[:, :, :1], k, v, torch.tensor([40]), torch.arange(12), ScoreMod(0.3, True, window=5), fused=True
    )
    assert not far[0].any() and torch.isinf(far[1]).all()


@pytest.mark.parametrize("mod", SCORED, ids=SCORED_IDS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_decode_step_over_a_whole_cache_is_the_reference_attention(
    mod: ScoreMod, kv_heads: int, dtype: torch.dtype
) -> None:
    """One new token over every position (dp, tp): the last ``window`` keys, ALiBi as ``slope·j``
    and soft-capping by softmax give the reference's output; sinks, and ALiBi outside fp32, are
    left to the reference."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 1, 8, generator=g).to(dtype)
    k, v = (torch.randn(2, kv_heads, 20, 8, generator=g).to(dtype) for _ in range(2))
    got = whole_decode(q, k, v, torch.arange(20), mod, slice(None))
    if mod.sinks is not None or (mod.alibi is not None and mod.softcap is None and dtype != torch.float32):
        assert got is None
        return
    want = attention_partial(q, k, v, torch.tensor([19]), torch.arange(20), mod)[0]
    tol = (
        {"rtol": 1e-5, "atol": 1e-6}
        if dtype == torch.float32 or mod.softcap
        else {"rtol": 2e-2, "atol": 2e-2}
    )
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("mod", SCORED, ids=SCORED_IDS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_a_cp_ranks_decode_step_merges_to_the_whole_caches_attention(mod: ScoreMod, kv_heads: int) -> None:
    """A cp decode step's scored partials (``decode_scored``: ALiBi as ``slope·j``, a window as the
    visible keys, soft-capping by hand) merge to the reference's attention over the whole cache,
    a shard past the window included (an empty partial); the rank that holds a sink defers."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, 20, 8, generator=g) for _ in range(2))
    past = 19
    whole = attention_partial(q, k, v, torch.tensor([past]), torch.arange(20), mod)[0]
    for shards in (
        [torch.arange(0, 8), torch.arange(8, 20)],
        [torch.arange(0, 20, 2), torch.arange(1, 20, 2)],
    ):
        parts = []
        for i, s in enumerate(shards):
            got = decode_scored(q, k[:, :, s], v[:, :, s], s, past, mod, slice(None), sink=i == 0)
            if mod.sinks is not None and i == 0:
                assert got is None
                got = attention_partial(q, k[:, :, s], v[:, :, s], torch.tensor([past]), s, mod, sink=True)
            parts.append(got)
        o, _ = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        torch.testing.assert_close(o, whole, rtol=1e-5, atol=1e-6)
    if mod.window is not None:  # no key within the window: an empty partial
        o, lse = decode_scored(
            q, k[:, :, :4], v[:, :, :4], torch.arange(4), past, mod, slice(None), sink=False
        )
        assert not o.any() and torch.isinf(lse).all()


def test_a_cache_holding_every_position_writes_a_slice_in_place() -> None:
    """dp and tp ranks hold every position: slot p is position p, written in place, repeated KV
    heads once."""
    cache = GroupCache(np.zeros(10, dtype=np.int64), 0, torch.device("cpu"))
    kv = torch.randn(1, 2, 10, 4).repeat_interleave(2, dim=1)
    assert cache.write(0, kv[:, :, :6], kv[:, :, :6], 0) == 6
    buffer = cache.layers[0][0]
    assert cache.write(0, kv[:, :, 6:7], kv[:, :, 6:7], 6) == 7
    keys, values, positions = cache.read(0, 7)
    assert cache.layers[0][0] is buffer and positions.tolist() == list(range(7))
    torch.testing.assert_close(keys, kv[:, ::2, :7])
    torch.testing.assert_close(values, kv[:, ::2, :7])


def test_a_step_near_the_end_of_a_position_table_is_traced_and_checked_within_it() -> None:
    """The zoo GPT's table has 16 positions: a prefill of 12 or of all 16 is checked at positions the
    table has (not past it), and compiles."""
    from tessera.core.weights import materialize

    decoder = graph_decoder(materialize(build("gpt", "tiny", seed=1)), label="gpt16")
    assert decoder.max_positions == 16
    assert compile_step(decoder, 1, 12) is None
    assert compile_step(decoder, 2, 16) is None
    tokens = torch.randint(0, decoder.vocab, (2, 16))
    torch.testing.assert_close(
        decoder.logits(tokens, 0, self_attention), decoder.interpret(tokens, 0, self_attention)
    )


def test_a_step_whose_graph_computes_nan_for_some_tokens_is_traced_and_checked(tmp_path: Path) -> None:
    """A graph computing NaN for some tokens (Helium's RMSNorm of a zero row) is still traced: the
    check of the traced step against the graph compares NaN with NaN (it raised inside torch)."""
    import onnx
    from onnx import numpy_helper

    model = build("gpt", "tiny", seed=3, kv_heads=2, seq=96)
    table = next(t for t in model.graph.initializer if numpy_helper.to_array(t).shape[0] == 128)
    rows = numpy_helper.to_array(table).copy()
    rows[::2] = np.nan  # the check's random tokens surely read one
    table.CopyFrom(numpy_helper.from_array(rows, table.name))
    path = tmp_path / "nan.onnx"
    onnx.save(model, str(path))
    decoder = graph_decoder(str(path))
    assert compile_step(decoder, 2, 6) is None and compile_step(decoder, 2, 1) is None
    logits = decoder.logits(torch.tensor([[1], [2]]), 6, self_attention)
    assert torch.isfinite(logits[0]).all() and torch.isnan(logits[1]).all()
