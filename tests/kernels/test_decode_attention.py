"""Split-KV decode attention: torch reference, shard merge, and the Triton kernel (interpreted on CPU).

Ground truth is :func:`full_decode_attention` in fp32 over the whole cache (itself checked against
``torch.nn.functional.scaled_dot_product_attention``). Tolerances (absolute and relative, against the
fp32 computation on the same, already rounded, inputs):

=========  ===========  ==========
dtype      o            lse
=========  ===========  ==========
fp32       1e-5         1e-5
fp16       2e-3         1e-4
bf16       2e-2         1e-4
=========  ===========  ==========

``lse`` is always computed in fp32 (only the summation order differs), so it keeps a tight tolerance;
``o`` is rounded to the input dtype once per shard and once after the merge, and the Triton kernel
rounds the softmax weights to the cache dtype for the tensor-core ``p·V`` product.
"""

from __future__ import annotations

import math
import os

# Before anything imports triton: run Triton kernels with its CPU interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.kernels import (
    KernelUnavailableError,
    available_implementations,
    decode_attention_partial,
    decode_attention_partial_triton,
    full_decode_attention,
    get_partial_attention,
    merge_outputs,
    merge_partials,
    shard_sizes,
    split_kv,
    triton_decode,
    triton_unavailable_reason,
)

TRITON_REASON = triton_unavailable_reason("cpu")
needs_triton = pytest.mark.skipif(TRITON_REASON is not None, reason=f"Triton kernel: {TRITON_REASON}")

O_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
LSE_TOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# (Hq, Hkv): GQA, MQA, MHA.
HEADS = [(8, 2), (8, 1), (4, 4)]
HEAD_IDS = ["gqa8-2", "mqa8-1", "mha4-4"]

B, S, D = 4, 40, 32
# Request 0 fills the cache; 1 ends mid-cache; 2 is short, so later shards are empty for it; 3 is empty.
KV_LEN = torch.tensor([40, 23, 5, 0])
# Uneven layouts per shard count, with an empty shard and shards smaller than a Triton block.
UNEVEN = {1: [40], 2: [9, 31], 3: [7, 0, 33], 4: [3, 20, 1, 16]}


def make_inputs(
    hq: int, hkv: int, dtype: torch.dtype, *, b: int = B, s: int = S, d: int = D, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=gen)
    k = torch.randn(b, hkv, s, d, generator=gen)
    v = torch.randn(b, hkv, s, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def ground_truth(q, k, v, kv_len):
    """fp32 full attention on the (already rounded) inputs."""
    return full_decode_attention(q.float(), k.float(), v.float(), kv_len)


def assert_matches(o, lse, o_ref, lse_ref, dtype):
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert lse.dtype == torch.float32 and lse.shape == lse_ref.shape
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.float(), o_ref.float(), atol=O_TOL[dtype], rtol=O_TOL[dtype])
    torch.testing.assert_close(lse, lse_ref, atol=LSE_TOL[dtype], rtol=LSE_TOL[dtype])


def sharded(attention, q, k, v, kv_len, sizes, **kwargs):
    """Attention over each shard of ``sizes``, merged: what a cache-parallel group computes."""
    shards = split_kv(k, v, kv_len, len(sizes), sizes=sizes)
    partials = [attention(q, sh.k, sh.v, kv_len=sh.kv_len, **kwargs) for sh in shards]
    return merge_partials([o for o, _ in partials], [lse for _, lse in partials])


# --- the reference --------------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_full_attention_matches_sdpa(hq, hkv):
    q, k, v = make_inputs(hq, hkv, torch.float32)
    o, lse = full_decode_attention(q, k, v, KV_LEN)
    valid = torch.arange(S)[None, :] < KV_LEN[:, None]
    mask = valid[:, None, None, :]  # [B, 1, 1, S], broadcast over heads and the single query
    o_sdpa = F.scaled_dot_product_attention(
        q[:, :, None, :],
        k.repeat_interleave(hq // hkv, dim=1),
        v.repeat_interleave(hq // hkv, dim=1),
        attn_mask=mask,
    )[:, :, 0, :]
    has_keys = KV_LEN > 0
    torch.testing.assert_close(o[has_keys], o_sdpa[has_keys], atol=1e-5, rtol=1e-5)
    assert torch.equal(o[~has_keys], torch.zeros_like(o[~has_keys]))
    assert torch.isneginf(lse[~has_keys]).all() and torch.isfinite(lse[has_keys]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_reference_partial_over_whole_cache_is_full_attention(hq, hkv, dtype):
    q, k, v = make_inputs(hq, hkv, dtype)
    o, lse = decode_attention_partial(q, k, v, kv_len=KV_LEN)
    assert_matches(o, lse, *ground_truth(q, k, v, KV_LEN), dtype)


@pytest.mark.parametrize("layout", ["even", "uneven"])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_reference_merge_of_shards_is_full_attention(hq, hkv, dtype, num_shards, layout):
    q, k, v = make_inputs(hq, hkv, dtype, seed=num_shards)
    sizes = shard_sizes(S, num_shards, block=8) if layout == "even" else UNEVEN[num_shards]
    o, lse = sharded(decode_attention_partial, q, k, v, KV_LEN, sizes)
    assert_matches(o, lse, *ground_truth(q, k, v, KV_LEN), dtype)


def test_reference_without_kv_len_and_custom_scale():
    q, k, v = make_inputs(8, 2, torch.float32)
    o, lse = decode_attention_partial(q, k, v, scale=0.3)
    o_ref, lse_ref = full_decode_attention(q, k, v, scale=0.3)
    assert_matches(o, lse, o_ref, lse_ref, torch.float32)
    o2, lse2 = sharded(decode_attention_partial, q, k, v, None, [13, 27], scale=0.3)
    assert_matches(o2, lse2, o_ref, lse_ref, torch.float32)


def test_empty_shard_gives_zero_and_neg_inf():
    q, k, v = make_inputs(8, 2, torch.float16)
    o, lse = decode_attention_partial(q, k[:, :, :0], v[:, :, :0])  # S = 0
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    o, lse = decode_attention_partial(q, k, v, kv_len=torch.zeros(B, dtype=torch.int64))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


def test_rejects_bad_shapes():
    q, k, v = make_inputs(6, 4, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention_partial(q, k, v)
    q, k, v = make_inputs(8, 2, torch.float32)
    with pytest.raises(ValueError, match="kv_len"):
        decode_attention_partial(q, k, v, kv_len=torch.tensor([1, 2]))


# --- the merge ------------------------------------------------------------------------------------


def test_merge_all_empty_is_zero_without_nan():
    os_ = torch.randn(3, 2, 4, 8)
    lses = torch.full((3, 2, 4), float("-inf"))
    lses[1, 0] = 0.5  # request 0 has one non-empty shard, request 1 none
    o, lse = merge_partials(os_, lses)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o[0], os_[1, 0])
    torch.testing.assert_close(lse[0], torch.full((4,), 0.5))
    assert torch.equal(o[1], torch.zeros(4, 8)) and torch.isneginf(lse[1]).all()
    assert torch.equal(merge_outputs(os_, lses), o)  # a cp decode step's merge: the same output


def test_the_merge_weighs_each_shard_by_its_share_of_the_softmax_mass():
    """Two shards of one head: keys scored [0, ln 3] in one and [ln 2] in the other merge to the
    softmax over all three (weights 4/6 and 2/6 of the shards' own outputs)."""
    os_ = torch.tensor([[[[1.0, 0.0]]], [[[0.0, 1.0]]]])  # [N=2, B=1, H=1, D=2]
    lses = torch.tensor([[[math.log(1 + 3)]], [[math.log(2)]]])
    o, lse = merge_partials(os_, lses)
    torch.testing.assert_close(o, torch.tensor([[[4 / 6, 2 / 6]]]))
    torch.testing.assert_close(lse, torch.tensor([[math.log(6)]]))
    assert torch.equal(merge_outputs(os_, lses), o)


def test_merge_accepts_lists_and_keeps_dtype():
    os_ = [torch.randn(2, 4, 8, dtype=torch.bfloat16) for _ in range(3)]
    lses = [torch.randn(2, 4) for _ in range(3)]
    o, lse = merge_partials(os_, lses)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    o2, lse2 = merge_partials(torch.stack(os_), torch.stack(lses))
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


@settings(max_examples=40, deadline=None)
@given(
    lse_rows=st.lists(
        st.lists(st.one_of(st.just(float("-inf")), st.floats(-30, 30)), min_size=3, max_size=3),
        min_size=2,
        max_size=7,
    ),
    cut=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_merge_is_associative(lse_rows, cut, seed):
    """Merging in two levels (e.g. within a node, then across nodes) equals merging all at once."""
    n = len(lse_rows)
    cut = min(cut, n - 1)
    lses = torch.tensor(lse_rows, dtype=torch.float32)[:, None, :]  # [N, B=1, Hq=3]
    os_ = torch.randn(n, 1, 3, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    os_ = os_.where(torch.isfinite(lses)[..., None], torch.zeros(()))  # an empty shard has o = 0
    at_once = merge_partials(os_, lses)
    left, right = merge_partials(os_[:cut], lses[:cut]), merge_partials(os_[cut:], lses[cut:])
    two_level = merge_partials(torch.stack([left[0], right[0]]), torch.stack([left[1], right[1]]))
    for got, want in zip(two_level, at_once, strict=True):
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --- split_kv -------------------------------------------------------------------------------------


def test_shard_sizes_deal_whole_blocks():
    assert shard_sizes(40, 4, block=8) == [16, 8, 8, 8]
    assert shard_sizes(41, 2, block=8) == [24, 17]
    assert shard_sizes(10, 4, block=16) == [10, 0, 0, 0]
    assert shard_sizes(7, 3, block=1) == [3, 2, 2]
    assert sum(shard_sizes(131072, 3)) == 131072


def test_split_kv_clips_lengths_to_each_shard():
    q, k, v = make_inputs(8, 2, torch.float32)
    shards = split_kv(k, v, KV_LEN, 4, sizes=UNEVEN[4])  # starts 0, 3, 23, 24
    assert [sh.start for sh in shards] == [0, 3, 23, 24]
    assert [sh.size for sh in shards] == UNEVEN[4]
    assert shards[0].kv_len.tolist() == [3, 3, 3, 0]
    assert shards[1].kv_len.tolist() == [20, 20, 2, 0]
    assert shards[2].kv_len.tolist() == [1, 0, 0, 0]
    assert shards[3].kv_len.tolist() == [16, 0, 0, 0]
    assert shards[1].k.data_ptr() == k[:, :, 3:].data_ptr()  # a view, not a copy
    assert torch.equal(torch.cat([sh.v for sh in shards], dim=2), v)
    with pytest.raises(ValueError, match="summing"):
        split_kv(k, v, KV_LEN, 2, sizes=[10, 10])


# --- implementations ------------------------------------------------------------------------------


def test_available_implementations():
    impls = available_implementations()
    assert impls["torch"] is None
    assert ("triton" in impls) and (impls["triton"] is None) == (TRITON_REASON is None)
    assert get_partial_attention("torch") is decode_attention_partial
    with pytest.raises(ValueError, match="unknown"):
        get_partial_attention("cuda-graphs")


def test_triton_missing_raises_clear_error(monkeypatch):
    monkeypatch.setattr(triton_decode, "_TRITON_IMPORT_ERROR", "triton is not importable (test)")
    q, k, v = make_inputs(8, 2, torch.float32)
    with pytest.raises(KernelUnavailableError, match="not importable"):
        decode_attention_partial_triton(q, k, v)
    assert available_implementations()["triton"] == "triton is not importable (test)"
    with pytest.raises(KernelUnavailableError):
        get_partial_attention("triton")


# --- the Triton kernel (interpreter) --------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_triton_shard_matches_reference(hq, hkv, dtype):
    """One shard with several KV splits and a masked tail: the kernel against the reference."""
    q, k, v = make_inputs(hq, hkv, dtype, seed=7)
    o, lse = decode_attention_partial_triton(q, k, v, kv_len=KV_LEN, block_n=16, num_splits=3)
    assert_matches(o, lse, *ground_truth(q, k, v, KV_LEN), dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hq,hkv", HEADS, ids=HEAD_IDS)
def test_triton_uneven_shards_merge_to_full_attention(hq, hkv, dtype):
    """Three uneven shards (one empty, one smaller than a block), some empty per request."""
    q, k, v = make_inputs(hq, hkv, dtype, seed=3)
    o, lse = sharded(decode_attention_partial_triton, q, k, v, KV_LEN, UNEVEN[3], block_n=16)
    assert_matches(o, lse, *ground_truth(q, k, v, KV_LEN), dtype)


@needs_triton
@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_triton_even_shards_merge_to_full_attention(num_shards):
    q, k, v = make_inputs(8, 2, torch.float32, seed=num_shards)
    sizes = shard_sizes(S, num_shards, block=16)
    o, lse = sharded(decode_attention_partial_triton, q, k, v, KV_LEN, sizes, block_n=16)
    assert_matches(o, lse, *ground_truth(q, k, v, KV_LEN), torch.float32)


@needs_triton
def test_triton_uneven_four_shards_and_partials_match_reference():
    q, k, v = make_inputs(8, 2, torch.float16, seed=11)
    for shard in split_kv(k, v, KV_LEN, 4, sizes=UNEVEN[4]):
        o_t, lse_t = decode_attention_partial_triton(q, shard.k, shard.v, kv_len=shard.kv_len, block_n=16)
        o_r, lse_r = decode_attention_partial(q, shard.k, shard.v, kv_len=shard.kv_len)
        assert_matches(o_t, lse_t, o_r.float(), lse_r, torch.float16)
    o, lse = sharded(decode_attention_partial_triton, q, k, v, KV_LEN, UNEVEN[4], block_n=16)
    assert_matches(o, lse, *ground_truth(q, k, v, KV_LEN), torch.float16)


@needs_triton
def test_triton_empty_shard_and_defaults():
    q, k, v = make_inputs(8, 2, torch.float32)
    o, lse = decode_attention_partial_triton(q, k[:, :, :0], v[:, :, :0])
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    o, lse = decode_attention_partial_triton(q, k, v, kv_len=torch.zeros(B, dtype=torch.int32))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    # No kv_len, default block and split choice, a custom scale, and a non-power-of-two head dim.
    q, k, v = make_inputs(8, 2, torch.float32, d=24)
    o, lse = decode_attention_partial_triton(q, k, v, scale=0.2)
    assert_matches(o, lse, *full_decode_attention(q, k, v, scale=0.2), torch.float32)


@needs_triton
def test_triton_merges_more_splits_than_one_merge_block():
    """65 splits: the split-merge kernel loops over two blocks of 64 splits."""
    q, k, v = make_inputs(2, 1, torch.float32, b=2, s=65 * 16, d=16, seed=5)
    k[:, 0, -16:] = q[:, None, 0] * 2  # the last split dominates head 0: the running max must move
    kv_len = torch.tensor([65 * 16, 64 * 16 + 3])
    o, lse = decode_attention_partial_triton(q, k, v, kv_len=kv_len, block_n=16, num_splits=65)
    assert_matches(o, lse, *ground_truth(q, k, v, kv_len), torch.float32)


@needs_triton
def test_triton_rejects_bad_arguments():
    q, k, v = make_inputs(8, 2, torch.float32)
    with pytest.raises(ValueError, match="block_n"):
        decode_attention_partial_triton(q, k, v, block_n=24)
    with pytest.raises(ValueError, match="share"):
        decode_attention_partial_triton(q.half(), k, v)


# --- the Triton kernel compiled for a GPU ---------------------------------------------------------

_CUDA_CHECK = textwrap.dedent(
    """
    import torch
    from tessera.kernels import decode_attention_partial_triton, full_decode_attention, merge_partials, split_kv
    torch.manual_seed(0)
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        for hq, hkv in ((32, 8), (32, 32), (8, 1)):
            q = torch.randn(3, hq, 128, device="cuda", dtype=dtype)
            k = torch.randn(3, hkv, 5000, 128, device="cuda", dtype=dtype)
            v = torch.randn(3, hkv, 5000, 128, device="cuda", dtype=dtype)
            kv_len = torch.tensor([5000, 2100, 0], device="cuda")
            o_ref, lse_ref = full_decode_attention(q.float(), k.float(), v.float(), kv_len)
            shards = split_kv(k, v, kv_len, 3, sizes=[1000, 3000, 1000])
            parts = [decode_attention_partial_triton(q, s.k, s.v, kv_len=s.kv_len) for s in shards]
            o, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
            torch.testing.assert_close(o.float(), o_ref, atol=tol, rtol=tol)
            torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-4)
    print("cuda ok")
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(TRITON_REASON is not None, reason=f"Triton kernel: {TRITON_REASON}")
def test_triton_compiled_on_cuda_matches_reference():
    """This module forces the interpreter, so the compiled kernel is checked in a clean process."""
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _CUDA_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "cuda ok" in result.stdout
