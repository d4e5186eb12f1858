"""The Triton decode kernels (decode_warps.py for the quantized formats, decode_tiles.py for the unquantized ones)
and the default decode plan against the relative oracle of shared/reference/style.md: the kernel's error against
an fp64 attention over the *same stored bytes* (dequantized with kv_quant.dequantize) is at most 2x the error of
plain PyTorch attention at the query's precision, plus a small floor; pages come from randperm, lengths are not
multiples of the page, split-K on and off. On the GPU the default plan of the quantized formats is the Gluon
kernel's (tests/test_kernel_gluon.py)."""

from __future__ import annotations

import math
import zlib
from dataclasses import replace

import pytest
import torch

from runtime.kv_format import KVFormat
from tests.helpers_kernels import (
    CUDA,
    DEV,
    FMT_IDS,
    FORMATS,
    SHAPES,
    K,
    assert_meets_oracle,
    decode_with,
    fill_cache,
    make_cache,
    oracle,
    relerr,
)

QUANTIZED = [f for f in FORMATS if f.quantized]
QUANTIZED_IDS = [i for f, i in zip(FORMATS, FMT_IDS) if f.quantized]


@pytest.mark.parametrize("kernel", ["default"] + (["triton"] if CUDA else []))
@pytest.mark.parametrize("split", [False, True], ids=["one-split", "split-k"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_decode_attention_relative_oracle(fmt, shape, split, kernel):
    """The default plan, and on the GPU also the Triton kernels' where the default is the Gluon kernel."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{shape}{fmt.name}".encode()))
    cache, block_tables, lens = fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    qdtype = torch.float16 if fmt.dtype == "fp16" or shape == "mha1-page16" else torch.bfloat16
    q = torch.randn(batch, heads, head_dim, generator=gen).to(qdtype).to(DEV)
    sm_scale = 1.0 / math.sqrt(head_dim)
    num_splits = 3 if split else 1
    # one split: the shipped default plan; split-K: 16-token tiles (so the short CPU sequences really split; the
    # per-warp kernel then runs one warp)
    if kernel == "default" and not split:
        out = K.decode_attention(q, cache, block_tables, lens, sm_scale)
    else:
        family = "triton" if kernel == "triton" else None
        gluon = kernel == "default" and K.decode_plan_for(q, cache, block_tables).kernel == "gluon"
        out = decode_with(q, cache, block_tables, lens, sm_scale, family, None if gluon else 16, splits=num_splits)
    assert out.dtype == q.dtype and out.shape == q.shape

    truth, torch_err = oracle(q, cache, block_tables, lens, sm_scale, qdtype)
    kernel_err = relerr(out.cpu(), truth)
    worst = (out.cpu().double() - truth).abs().flatten().argmax().item()
    assert torch.isfinite(out).all(), "kernel output has NaN/Inf"
    assert kernel_err <= 2 * torch_err + 1e-5, (
        f"kernel error {kernel_err:.3e} > 2 x PyTorch {qdtype} error {torch_err:.3e}; worst element {worst}: "
        f"kernel {out.cpu().flatten()[worst].item():.6f} vs fp64 {truth.flatten()[worst].item():.6f}"
    )



@pytest.mark.parametrize("heads_n", [False, True], ids=["heads-as-M", "heads-as-N"])
@pytest.mark.parametrize("split", [1, 2], ids=["one-split", "split-k"])
@pytest.mark.parametrize("shape", ["gqa3-page5", "gqa2-page16"] + (["llama8b"] if CUDA else []))
@pytest.mark.parametrize("fmt", QUANTIZED, ids=QUANTIZED_IDS)
def test_decode_per_warp_kernel(fmt, shape, split, heads_n):
    """The one-softmax-state-per-warp kernel (decode_warps.py, the quantized formats') meets the same oracle, both
    operand orders.

    CPU: 2 warps of 16 tokens, so the 17- and 29-token sequences end inside a warp's range and
    the 3-token one leaves a warp with no tokens at all (its state must merge with weight 0).
    GPU: also the Llama-3-8B shape, with 4 warps of 16 tokens (one split) and one-warp
    programs of 16 tokens (split-K; the default tile where there are enough programs).
    """
    batch, heads, kv_heads, head_dim, bs, seq_lens = SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"warps{shape}{fmt.name}".encode()))
    cache, bt, lens = fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    qdtype = torch.float16 if fmt.dtype == "fp16" else torch.bfloat16
    q = torch.randn(batch, heads, head_dim, generator=gen).to(qdtype).to(DEV)
    tile = (64 if split == 1 else 16) if shape == "llama8b" else 32
    out = decode_with(q, cache, bt, lens, 0.25, "triton", tile, splits=split, heads_n=heads_n)
    assert_meets_oracle(out, q, cache, bt, lens, qdtype)




def test_decode_default_launch_matches_forced_split():
    """The default plan (the split rule's count) agrees with a single split."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = SHAPES["gqa3-page5"]
    gen = torch.Generator().manual_seed(7)
    cache, bt, lens = fill_cache(KVFormat("int8", "per_token"), batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).half().to(DEV)
    a = K.decode_attention(q, cache, bt, lens, 0.25)
    b = decode_with(q, cache, bt, lens, 0.25, splits=1)
    assert relerr(a.cpu(), b.cpu().double()) < 2e-3


def test_decode_rejects_bad_input():
    cache = make_cache(KVFormat("int8", "per_token"), 4, 16, 2, 32)
    q = torch.randn(1, 3, 32, dtype=torch.float16, device=DEV)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=DEV)
    lens = torch.ones(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="not a multiple"):
        K.decode_attention(q, cache, bt, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        K.decode_attention(q[:, :2], cache, bt.long(), lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        K.decode_attention(q[:, :2], cache, bt, lens.long(), 1.0)



def test_decode_rejects_plans_that_do_not_fit():
    """A plan changed into one no kernel serves gets an error naming the field and the fix, and no output."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = SHAPES["gqa3-page5"]
    gen = torch.Generator().manual_seed(13)
    fmt = KVFormat("int8", "per_token")
    cache, bt, lens = fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16).to(DEV)
    plan = K.decode_plan_for(q, cache, bt)
    cases = [(dict(kernel="tiles"), "DecodePlan.kernel='tiles'"), (dict(kernel="flash"), "choose gluon, warps"),
             (dict(kernel="gluon", stages=2), "DecodePlan.stages=2: the shared-memory ring serves int4"),
             (dict(kernel="gluon", pairs=True), "DecodePlan.pairs=True"),
             (dict(kernel="gluon", tma=True), "DecodePlan.tma=True"),
             (dict(kernel="gluon", k_chains=3), "DecodePlan.k_chains=3")]
    if plan.kernel == "warps":
        cases += [(dict(block_n=8), "DecodePlan.block_n=8"), (dict(block_n=32, num_warps=1, warp_page=True), "DecodePlan.warp_page=True")]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            K.decode_attention(q, cache, bt, lens, 0.25, plan=replace(plan, **changes))
    bf16 = KVFormat("bf16")
    cache, bt, lens = fill_cache(bf16, batch, kv_heads, head_dim, bs, seq_lens, gen)
    with pytest.raises(ValueError, match="DecodePlan.kernel='warps'"):
        K.decode_attention(q, cache, bt, lens, 0.25, plan=replace(K.decode_plan_for(q, cache, bt), kernel="warps"))

