"""The decode kernel of per-channel keys (runtime/kernels/decode_channel_keys.py) against the fp64 oracle of the
position rule: a batch of sequences of odd lengths (1 to 3 blocks and a bit, one at a block's last position),
pages out of order, residual blocks from the reference write, one launch and split-K with empty splits; fp32 q
to the format's exactness, bf16 q within the bound bf16 operands give."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers_channel_keys import BLOCK, FMT, exact_int4_values, keys, oracle_attention, output_bound, score_span
from helpers_kernels import DEV, K

from runtime import attention
from runtime.kv_cache import allocate_layer

LENGTHS = [1, 64, 65, 150, 200, 130]
# the relative error of an fp32 -> bf16 conversion in a kernel: round to nearest on the GPU; Triton's interpreter
# truncates (4.99925 -> 4.96875), a whole ulp
BF16_ROUNDING = 2.0**-8 if torch.device(DEV).type == "cuda" else 2.0**-7


def _filled(heads: int, kvh: int, d: int, seed: int, spare_slots: int = 0):
    """A cache holding len(LENGTHS) sequences written as an engine does: each prompt but its last token in one
    write, then every sequence's last token in one decode write (so the completed blocks of sequences at a block's
    64th key keep their residual until the next write). Written on the CPU, where the reference write is the
    format's rule to the bit (on CUDA torch divides through a reciprocal: a scale can round up one fp16 step past
    the rule's), then moved to the kernel's device."""
    width = max(-(-n // BLOCK) for n in LENGTHS)
    gen = torch.Generator().manual_seed(seed)
    pool = len(LENGTHS) * width
    cache = allocate_layer(FMT, pool, BLOCK, kvh, d, "cpu", residual_slots=len(LENGTHS) + spare_slots)
    tables = torch.randperm(pool, generator=gen).view(len(LENGTHS), width).to(torch.int32)  # pages anywhere
    ks = [keys(seed + 1 + i, (n, kvh, d)) for i, n in enumerate(LENGTHS)]
    vs = [exact_int4_values(seed + 50 + i, (n, kvh, d)) for i, n in enumerate(LENGTHS)]

    def slots(i: int, positions) -> torch.Tensor:
        return torch.tensor([int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in positions])

    for i, n in enumerate(LENGTHS):
        if n > 1:
            attention.write_kv(cache, ks[i][:n - 1], vs[i][:n - 1], slots(i, range(n - 1)))
    last = torch.cat([slots(i, [n - 1]) for i, n in enumerate(LENGTHS)])
    attention.write_kv(cache, torch.stack([x[-1] for x in ks]), torch.stack([x[-1] for x in vs]), last)
    for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero", "k_residual"):
        setattr(cache, name, getattr(cache, name).to(DEV))
    cache.residual.slot_of = cache.residual.slot_of.to(DEV)
    q = torch.randn(len(LENGTHS), heads, d, generator=gen)
    return cache, tables.to(DEV), ks, vs, q


def _plan(q, cache, tables, splits: int):
    plan = K.decode_plan_for(q.to(DEV), cache, tables)
    assert plan.kernel in ("channel_keys", "channel_keys_gluon") and plan.block_n == BLOCK
    return replace(plan, splits=splits)


# (query heads, KV heads, head_dim, q dtype): the Gluon kernel's geometries on the GPU (head_dim 128, GQA groups of 4
# and 8; bf16 and fp16 q), SmolLM2's head_dim 64 on the Triton kernel; under the interpreter the Triton kernel serves all
SIXTEEN_BIT = [(8, 2, 64, torch.bfloat16), (8, 2, 128, torch.bfloat16), (16, 2, 128, torch.float16)]


def _assert_within_bound(got, q, ks, vs, sm, plan):
    """Each sequence's output within `output_bound` of the fp64 oracle computed with the score operands the plan's
    kernel rounds: fp16 (prescale 1/16; the Gluon kernel's 1/256 on odd channels of quantized blocks) with the Gluon
    kernel and plan.dot_fp16, q's dtype with native dots, none in fp32 / upcast; the
    output rounds to q's dtype, and so may the split partials before it (split_k.partial_dtype): two roundings."""
    pre_codes = None
    if plan.kernel == "channel_keys_gluon":  # q s / 16 on even channels (low nibbles), / 256 on odd (16 n)
        operand, pre, u = torch.float16, 0.0625, 2.0**-11
        pre_codes = np.where(np.arange(q.shape[-1]) % 2 == 1, 2.0**-8, 2.0**-4)
    elif plan.dot_fp16:
        operand, pre, u = torch.float16, 0.0625, 2.0**-11
    elif q.dtype == torch.float32 or torch.device(DEV).type != "cuda":
        operand, pre, u = None, 1.0, 2.0**-24
    else:
        operand, pre, u = q.dtype, 1.0, 2.0**-8
    for i, n in enumerate(LENGTHS):
        want = oracle_attention(q[i], ks[i], vs[i], n - 1, sm, operand, pre, pre_codes)
        err = np.abs(got[i] - want).max()
        u_out = 2 * {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: BF16_ROUNDING}[q.dtype]
        bound = output_bound(q[i], vs[i], n, sm, u, score_span(q[i].float(), ks[i], n), u_out)
        assert err <= bound, f"sequence of {n} tokens: {err} > {bound}"


@pytest.mark.parametrize("heads,kvh,d", [(4, 2, 64), (9, 3, 64), (8, 1, 128)])
@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_decode_equals_the_fp64_rule(heads, kvh, d, num_splits):
    cache, tables, ks, vs, q = _filled(heads, kvh, d, seed=heads + d)
    sm = d**-0.5
    seq = torch.tensor(LENGTHS, dtype=torch.int32, device=DEV)
    plan = _plan(q, cache, tables, num_splits)
    got = K.decode_attention(q.to(DEV), cache, tables, seq, sm, plan=plan)
    _assert_within_bound(got.double().cpu().numpy(), q, ks, vs, sm, plan)


@pytest.mark.parametrize("heads,kvh,d,dtype", SIXTEEN_BIT)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_16_bit_q_within_the_bound_of_the_plans_operands(heads, kvh, d, dtype, num_splits):
    """fp16 / bf16 q under the default plan (on the GPU fp16 operands q * s / 16 and p * s_v), and with 3 splits: the
    oracle rounds the score operands as the plan's kernel does, the bound covers the rest (`output_bound`)."""
    _check_16_bit(heads, kvh, d, dtype, num_splits, {})


def _check_16_bit(heads, kvh, d, dtype, num_splits, changes):
    cache, tables, ks, vs, q = _filled(heads, kvh, d, seed=7 + d)
    q = q.to(dtype)
    sm = d**-0.5
    seq = torch.tensor(LENGTHS, dtype=torch.int32, device=DEV)
    plan = K.decode_plan_for(q.to(DEV), cache, tables)
    if torch.device(DEV).type == "cuda":
        assert (plan.kernel == "channel_keys_gluon") == (d == 128)
    plan = replace(plan if num_splits is None else replace(plan, splits=num_splits), **changes)
    got = K.decode_attention(q.to(DEV), cache, tables, seq, sm, plan=plan).double().cpu().numpy()
    _assert_within_bound(got, q, ks, vs, sm, plan)


@pytest.mark.parametrize("heads,kvh,d,dtype", [(4, 2, 64, torch.float32), (8, 2, 128, torch.bfloat16)])
def test_reads_no_residual_block_but_the_own_blocks(heads, kvh, d, dtype):
    """Residual slots no own block holds are NaN, as are the pages of every sequence's own block: the output still
    equals the oracle, so the kernel reads each own block from its residual slot and nothing else from residuals."""
    cache, tables, ks, vs, q = _filled(heads, kvh, d, seed=3, spare_slots=2)
    q = q.to(dtype)
    free = [s for s in range(cache.residual.num_slots) if s not in cache.residual.of_block.values()]
    assert len(free) == 2
    cache.k_residual[free] = float("nan")
    for i, n in enumerate(LENGTHS):
        own = int(tables[i, (n - 1) // BLOCK])
        cache.k_scale[own] = float("nan")
    seq = torch.tensor(LENGTHS, dtype=torch.int32, device=DEV)
    plan = _plan(q, cache, tables, 2)
    got = K.decode_attention(q.to(DEV), cache, tables, seq, 0.125, plan=plan)
    _assert_within_bound(got.double().cpu().numpy(), q, ks, vs, 0.125, plan)


@pytest.mark.parametrize("heads,kvh,d,dtype", [(4, 2, 64, torch.float32), (8, 2, 128, torch.bfloat16)])
def test_a_padding_row_reads_inside_the_residual(heads, kvh, d, dtype):
    """A CUDA graph's padding row attends to one token of a block with no residual slot (slot_of -1): the kernel
    reads slot 0 instead of memory before the residual, and the other rows' outputs do not change."""
    cache, tables, ks, vs, q = _filled(heads, kvh, d, seed=5)
    q = q.to(dtype)
    seq = torch.tensor(LENGTHS, dtype=torch.int32, device=DEV)
    plan = _plan(q, cache, tables, 2)
    before = K.decode_attention(q.to(DEV), cache, tables, seq, 0.125, plan=plan)
    assert LENGTHS[0] == 1
    cache.residual.slot_of[int(tables[0, 0])] = -1
    cache.k_residual[0] += 1.0  # changes the output of the row whose own block holds slot 0, and no other
    after = K.decode_attention(q.to(DEV), cache, tables, seq, 0.125, plan=plan)
    owner = [i for i, n in enumerate(LENGTHS) if cache.residual.of_block.get(int(tables[i, (n - 1) // BLOCK])) == 0]
    keep = [i for i in range(1, len(LENGTHS)) if i not in owner]
    assert torch.isfinite(after[0]).all() and torch.equal(after[keep], before[keep])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU compiles and runs these builds in the tests above")
def test_builds_compile_for_sm90():
    """Every decode (one- and two-warp plans, the split merge) and write build the format launches on the H200
    compiles for sm_90, cross-compiled in a process of its own (under TRITON_INTERPRET=1 nothing compiles, and the
    interpreter runs what the compiler refuses: tests/helpers_channel_keys_compile.py)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.helpers_channel_keys_compile"],
                         cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    builds = [json.loads(line) for line in run.stdout.splitlines()]
    assert {b["kernel"] for b in builds} == {"_decode_channel_keys_gluon", "_decode_channel_keys_kernel", "_merge_kernel",
                                            "_write_channel_keys_kernel"}
    assert {b["num_warps"] for b in builds if b["kernel"] == "_decode_channel_keys_kernel"} == {1, 2}
    for b in builds:
        assert b["ok"], f"{b['kernel']}: {b.get('error')}"
