"""Split-K (split_k.py): the split-count rule against wave arithmetic worked by hand, the partials' dtype rule, the
merge kernel against an fp64 merge, and split launches with partials in either dtype against the fp64 oracle."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from runtime.kernels.split_k import choose_num_splits
from runtime.kv_format import KVFormat
from tests.helpers_kernels import CUDA, DEV, SHAPES, assert_meets_oracle, decode_with, fill_cache


@pytest.mark.parametrize("share", [0.0, math.inf], ids=["out-dtype-partials", "fp32-partials"])
@pytest.mark.parametrize("fmt", [KVFormat("int8", "per_token"), KVFormat("int4", "per_head")], ids=["int8-tok", "int4"])
def test_split_partials_in_either_dtype(fmt, share, monkeypatch):
    """Split-K partials stored in q's dtype (bf16 here) and in fp32 (`split_k.partial_dtype`, forced through
    its threshold) both meet the oracle, with pages out of order and a sequence shorter than a split."""
    from runtime.kernels import split_k

    monkeypatch.setattr(split_k, "PARTIAL_ROUNDING_SHARE", share)
    batch, heads, kv_heads, head_dim, bs, seq_lens = SHAPES["gqa3-page5"]
    gen = torch.Generator().manual_seed(zlib.crc32(f"partials{fmt.name}".encode()))
    cache, bt, lens = fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16).to(DEV)
    out = decode_with(q, cache, bt, lens, 0.25, None, None if CUDA else 16, splits=3)
    assert_meets_oracle(out, q, cache, bt, lens, torch.bfloat16,
                         "kernel output has NaN/Inf (an empty split's partial must weigh 0)")


@pytest.mark.parametrize("splits", [5, 2, 512], ids=["slices-of-32", "whole-rows", "512-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-acc", "bf16-normalized"])
def test_merge_splits_against_fp64(dtype, splits):
    """`split_k.merge_splits` over head_dim 80 and 5 splits (three 32-wide slices, the last one masked), 2
    (one 128-wide program, masked past 80) or 512 (the int4 ring's most, `tuning.RING_MAX_SPLITS`), one split empty (m = -inf, l = 0), against the same merge in fp64:
    fp32 partials hold unnormalized acc, 16-bit ones o = acc / l (`split_k.partial_dtype`)."""
    from runtime.kernels.split_k import merge_splits

    gen = torch.Generator().manual_seed(3)
    batch, heads, dim = 2, 3, 80
    empty = splits - 2
    m = torch.randn(batch, heads, splits, generator=gen, dtype=torch.float64) * 4
    m[:, :, empty] = float("-inf")
    lsum = torch.rand(batch, heads, splits, generator=gen, dtype=torch.float64) * 20 + 1
    lsum[:, :, empty] = 0
    o = torch.randn(batch, heads, splits, dim, generator=gen, dtype=torch.float64)
    o[:, :, empty] = 0
    stored = (o * lsum[..., None]).float() if dtype == torch.float32 else o.to(dtype)
    w = torch.where(m == float("-inf"), 0.0, torch.exp2(m - m.amax(-1, keepdim=True))) * lsum
    # each split's output as stored (acc / l for fp32 partials; the empty split's weight is 0)
    split_out = stored.double() / lsum.clamp(min=1)[..., None] if dtype == torch.float32 else stored.double()
    want = (w[..., None] * split_out).sum(2) / w.sum(-1)[..., None]
    out = torch.empty(batch, heads, dim, dtype=torch.float32, device=DEV)
    merge_splits(m.float().flatten().to(DEV), lsum.float().flatten().to(DEV), stored.flatten().to(DEV), out, splits)
    # fp32 arithmetic on the stored partials: a few fp32 roundings of terms of the output's size
    assert torch.allclose(out.cpu().double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_partial_dtype_policy():
    """Partials in the output's dtype where fp32 ones would be >= 1/48 of a split's KV bytes (worked by hand)."""
    from runtime.kernels.split_k import partial_dtype

    def out(heads):
        return torch.empty(1, heads, 128, dtype=torch.bfloat16)

    # Llama-3-70B TP8 (8 query heads on 1 KV head), int4 per-head: 272-token splits of 128 B a token read
    # 34816 B; an fp32 partial is 8 x 128 x 4 = 4096 B (11.8%)
    assert partial_dtype(out(8), 1, 272, 128.0) == torch.bfloat16
    # fp8 at 528 tokens (70B TP8 32 x 32768): 4096 B against 135168 B (3.0%)
    assert partial_dtype(out(8), 1, 528, 256.0) == torch.bfloat16
    # Llama-3-8B (4 query heads a KV head), int4 per-head at 1024 tokens: 2048 B against 131072 B (1.6%)
    assert partial_dtype(out(32), 8, 1024, 128.0) == torch.float32
    # the boundary: 2048 B is 1/48 of 98304 B = 768 tokens of 128 B
    assert partial_dtype(out(32), 8, 768, 128.0) == torch.bfloat16
    assert partial_dtype(out(32), 8, 769, 128.0) == torch.float32



def test_split_count_policy():
    """Split counts against wave arithmetic worked by hand (132 SMs, 4 resident programs: 528 slots)."""
    # 1 x 131072, 8 pairs: one wave of 8 x 64 = 512 programs is the best 64 splits allow;
    # 59 splits (472 programs, one wave) cost 1/59, within 10% of 1/64 -- the fewest that are
    assert choose_num_splits(1, 8, 131072, 64, 132, 4) == 59
    # 16 x 32768, 128 pairs: 4 splits = 512 programs, one wave (cost 1/4); 5 would need 2 waves
    assert choose_num_splits(16, 8, 32768, 64, 132, 4) == 4
    # 93 x 8192, 744 pairs: 1 split = 2 waves (cost 2), 2 splits = 3 waves of halves (1.5);
    # the floor is 744/528 = 1.41 (16 splits: 1.44), and 1.5 is within 10% of it
    assert choose_num_splits(93, 8, 8192, 64, 132, 4) == 2
    # 128 x 4096, 1024 pairs: 2 waves either way (1.94 of work): no split
    assert choose_num_splits(128, 8, 4096, 64, 132, 4) == 1
    # 3 resident programs (396 slots), 16 x 32768: 3 splits = 384 programs, one wave
    assert choose_num_splits(16, 8, 32768, 128, 132, 3) == 3
    # short context: splits stay >= 512 tokens (600 tokens: at most 2)
    assert choose_num_splits(1, 8, 600, 64, 132, 4) == 2



def test_wave_cost_counts_partial_waves_whole():
    from runtime.kernels.split_k import wave_cost

    assert wave_cost(128, 4, 528) == 0.25  # 512 programs: one wave of quarter-length programs
    assert wave_cost(128, 5, 528) == 2 / 5  # 640 programs: a second, mostly empty wave
    assert wave_cost(744, 1, 528) == 2.0

