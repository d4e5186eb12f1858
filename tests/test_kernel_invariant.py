"""The batch-invariant mode's CUDA kernels (runtime/kernels/invariant_gemm.py, invariant_attention.py): a row's
bits do not depend on the rows beside it, and the values meet an fp64 oracle.

On a CPU machine they run under the Triton interpreter: equal bits there prove the algorithm (one reduction
order per row, whatever the batch); the same tests on the GPU machine prove the compiled kernels' bits.
"""

from __future__ import annotations

import types

import pytest
import torch
import triton
from helpers_kernels import CUDA, DEV, K, assert_meets_oracle, fill_cache

from runtime.kernels import invariant_attention, invariant_gemm
from runtime.kernels.plan import split_tile
from runtime.kv_format import KVFormat

INVARIANT_FORMATS = [KVFormat("bf16"), KVFormat("fp8_e4m3", "per_tensor"), KVFormat("int8", "per_token"),
                     KVFormat("int4", "per_token", symmetric=False),
                     KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False)]  # K8V4: the mixed kernel
FMT_IDS = [f.name for f in INVARIANT_FORMATS]
Q_DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]  # the GPU engine's q is bf16
GEMM_SHAPES = [(100, 200), (4096, 4096)] if CUDA else [(100, 200), (33, 64)]


# ------------------------------------------------------------------ GEMM
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", GEMM_SHAPES)
def test_gemm_rows_do_not_depend_on_the_row_count(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(300, k, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEV)
    full = invariant_gemm.linear(x, w)
    # on the H200 the M's span every tile bucket of `rows_config` (64, 128, 256 and 128-row tiles again)
    for m in (1, 7, 64, 100, 200, 300):
        assert torch.equal(invariant_gemm.linear(x[:m], w), full[:m]), f"rows of an M={m} product differ"
    # A row alone sits at row 0 of its tile: on the GPU the position in the tile is no input. Under the
    # interpreter a tile's dot is numpy's matmul, whose BLAS may round a row by its position in the tile
    # (OpenBLAS on AMD EPYC does), so there the rows-of-a-prefix checks above carry the property.
    for i in (5, 64, 130, 299) if CUDA else ():
        assert torch.equal(invariant_gemm.linear(x[i:i + 1], w)[0], full[i]), f"row {i} alone differs"
    # the values: fp64 oracle, within 4x torch's own error at this precision plus an ulp of the result. The
    # kernel sums K in one fixed order (its error grows like sqrt(K)); cuBLAS splits K into more partial sums
    # (2.3x less error at K = 4096 in fp32 on the H200). TF32 instead of fp32 products would be ~50x torch's.
    ref = x.double() @ w.double().T
    torch_err = ((x @ w.T).double() - ref).abs().max()
    err = (full.double() - ref).abs().max()
    assert err <= 4 * torch_err + torch.finfo(dtype).eps * ref.abs().max(), f"error {err:.3g} vs torch's {torch_err:.3g}"


def test_gemm_config_depends_on_the_weight_only():
    cfg = invariant_gemm.gemm_config(4096, 4096, torch.bfloat16)
    assert cfg == invariant_gemm.gemm_config(4096, 4096, torch.bfloat16)
    assert invariant_gemm.gemm_config(128256, 4096, torch.bfloat16).block_n >= cfg.block_n  # LM head: wider tiles


def test_rows_config_takes_tiles_the_rows_fill():
    for n, k in ((6144, 4096), (28672, 4096), (576, 576)):
        for m in (1, 64, 65, 128, 129, 256, 257, 337):
            block_m, cfg = invariant_gemm.rows_config(n, k, m)
            assert block_m <= max(64, triton.next_power_of_2(m)), (n, m, block_m)  # no tile mostly padding
            assert block_m < 256 or 128 < m <= 256, (n, m, block_m)
            assert cfg.block_k <= k
    assert invariant_gemm.rows_config(28672, 4096, 337)[1].block_n == 256  # many rows, wide weight: big tiles
    assert invariant_gemm.rows_config(576, 576, 1) == (64, invariant_gemm.GemmConfig(32, 128, 4, 4))  # narrowest


def test_rows_config_is_near_the_fastest_tile_measured():
    """Against the sweep on the H200 (`benchmarks.numerics_gpu --gemm-sweep`): at every weight and row count the
    rule's tile is within 15% (or 3 us) of the fastest of the twelve, and every tile gave the same bits (what lets the
    rule choose by M at all)."""
    import json
    from pathlib import Path

    from benchmarks.numerics_gpu import tile_key

    path = Path(__file__).resolve().parents[1] / "benchmarks/results/invariant_gemm.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) >= 60
    for r in rows:
        assert r["same_bits"], r["weight"]
        chosen = r[tile_key(*invariant_gemm.rows_config(r["n"], r["k"], r["m"]))]
        fastest = min(v for key, v in r.items() if key.startswith("["))
        assert chosen <= 1.15 * fastest + 0.003, (r["weight"], r["m"], chosen, fastest)


def test_gemm_refuses_mismatched_operands():
    with pytest.raises(ValueError, match=r"x \[\.\.\., K\] and w \[N, K\]"):
        invariant_gemm.linear(torch.zeros(2, 8, device=DEV), torch.zeros(4, 9, device=DEV))


# ------------------------------------------------------------------ attention
def _q(batch, heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, head_dim, generator=gen).to(dtype).to(DEV)


@pytest.fixture(params=["shipped", "short"])
def split_tokens(request, monkeypatch):
    """The mode's splits as shipped, and of 32 keys (the plan's tile at least): the tests' rows then span several
    splits, and a batch's launch has more of them than a row alone."""
    if request.param == "short":
        monkeypatch.setattr(invariant_attention, "SPLIT_TOKENS", 32)
    invariant_attention._plan.cache_clear()
    yield request.param
    invariant_attention._plan.cache_clear()


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", INVARIANT_FORMATS, ids=FMT_IDS)
def test_decode_row_alone_equals_row_in_a_batch(fmt, q_dtype, split_tokens):
    # group 4 (Llama-3), pages of 16, lengths across tile and page edges; one long sequence widens the tables.
    # int8: contexts past the default plan's 512-token splits, whose split count follows the table's width (the
    # default plan gives the 600-token row other bits in this batch than alone); the others stay short (interpreter)
    long = fmt.name == "int8-per_token" or CUDA
    lens = ([5, 1100, 17, 600] if not CUDA else [5, 4000, 17, 2048, 333]) if long else [5, 100, 17, 64, 33]
    heads, kv_heads, d = 8, 2, 16 if not CUDA else 128
    gen = torch.Generator().manual_seed(3)
    cache, tables, seq_lens = fill_cache(fmt, len(lens), kv_heads, d, 16, lens, gen)
    q = _q(len(lens), heads, d, q_dtype, 4)
    batch = invariant_attention.decode_attention(q, cache, tables, seq_lens, 0.25)
    for b, n in enumerate(lens):
        own = tables[b:b + 1, :-(-n // 16)]  # its own pages only: the width of a table alone
        alone = invariant_attention.decode_attention(q[b:b + 1], cache, own, seq_lens[b:b + 1], 0.25)
        assert torch.equal(alone[0], batch[b]), f"sequence {b} ({n} tokens) alone differs from its batch row"
    assert_meets_oracle(batch, q, cache, tables, seq_lens, q_dtype)


def test_rows_in_launches_of_bounded_partials(monkeypatch):
    """Rows whose split partials would pass PARTIAL_VALUES go in several launches, with the bits of one launch."""
    fmt, lens = KVFormat("int8", "per_token"), [5, 300, 17, 64, 200, 33, 90]
    gen = torch.Generator().manual_seed(12)
    cache, tables, seq_lens = fill_cache(fmt, len(lens), 2, 16, 16, lens, gen)
    q = _q(len(lens), 8, 16, torch.float32, 13)
    whole = invariant_attention.decode_attention(q, cache, tables, seq_lens, 0.25)
    launches = []
    real = invariant_attention.launch.decode_attention
    monkeypatch.setattr(invariant_attention, "PARTIAL_VALUES", 2 * 8 * 18 * -(-tables.shape[1] * 16 // 512))
    monkeypatch.setattr(invariant_attention.launch, "decode_attention",
                        lambda q, *a, **kw: launches.append(q.shape[0]) or real(q, *a, **kw))
    assert torch.equal(invariant_attention.decode_attention(q, cache, tables, seq_lens, 0.25), whole)
    assert launches == [2, 2, 2, 1]


def _prompt_cache(fmt, n, kv_heads, d, seed):
    """One sequence of n tokens written to scattered pages: (cache, its block table [1, pages], slots [n])."""
    gen = torch.Generator().manual_seed(seed)
    cache, tables, _ = fill_cache(fmt, 1, kv_heads, d, 16, [n], gen)
    t = torch.arange(n, device=DEV)
    slots = tables[0, t // 16].long() * 16 + t % 16
    return cache, tables, slots


def _batch(slots, cu, num_decode=0, context=None, tables=None):
    return types.SimpleNamespace(slot_mapping=slots, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV),
                                 num_decode=num_decode, context_lens=context, prefill_block_tables=tables)


@pytest.mark.parametrize("fmt", INVARIANT_FORMATS, ids=FMT_IDS)
def test_prefill_whole_chunked_and_decode_give_one_result(fmt, split_tokens):
    n, heads, kv_heads, d = 26, 8, 2, 16
    cache, tables, slots = _prompt_cache(fmt, n, kv_heads, d, 5)
    q = _q(n, heads, d, torch.float32, 6)
    whole = invariant_attention.prefill_from_cache(q, cache, _batch(slots, [0, n]), 0.25)
    # chunks of 1, 2, 17 and the rest, each over its context through the block table
    bounds = [0, 1, 3, 20, n]  # the last chunk starts past a page edge
    chunked = torch.cat([invariant_attention.prefill_from_cache(
        q[a:b], cache, _batch(slots[a:b], [0, b - a], context=torch.tensor([a], dtype=torch.int32, device=DEV),
                              tables=tables), 0.25) for a, b in zip(bounds, bounds[1:])])
    assert torch.equal(chunked, whole), "a chunked prefill differs from the whole prompt's"
    # every position as a decode row (what a request generating that token computed before a preemption)
    decode = invariant_attention.decode_attention(
        q, cache, tables.expand(n, -1).contiguous(), torch.arange(1, n + 1, dtype=torch.int32, device=DEV), 0.25)
    assert torch.equal(decode, whole), "decode rows differ from the prefill's"
    lens = torch.arange(1, n + 1, dtype=torch.int32, device=DEV)
    assert_meets_oracle(whole, q, cache, tables.expand(n, -1), lens, torch.float32)


def test_prefill_of_two_prompts_in_one_step_equals_each_alone():
    fmt, heads, kv_heads, d = KVFormat("int8", "per_token"), 8, 2, 16
    gen = torch.Generator().manual_seed(9)
    lens = [9, 20]
    cache, tables, _ = fill_cache(fmt, 2, kv_heads, d, 16, lens, gen)
    slots = torch.cat([tables[b, torch.arange(n, device=DEV) // 16].long() * 16 + torch.arange(n, device=DEV) % 16
                       for b, n in enumerate(lens)])
    q = _q(sum(lens), heads, d, torch.float32, 10)
    both = invariant_attention.prefill_from_cache(q, cache, _batch(slots, [0, 9, 29]), 0.25)
    first = invariant_attention.prefill_from_cache(q[:9], cache, _batch(slots[:9], [0, 9]), 0.25)
    second = invariant_attention.prefill_from_cache(q[9:], cache, _batch(slots[9:], [0, 20]), 0.25)
    assert torch.equal(both, torch.cat((first, second)))


def test_one_plan_for_every_batch():
    fmt = KVFormat("fp8_e4m3", "per_tensor")
    cache, _, _ = fill_cache(fmt, 1, 2, 16, 16, [3], torch.Generator().manual_seed(0))
    plans = {invariant_attention.row_plan(_q(b, 8, 16, torch.float32, b), cache) for b in (1, 7, 64)}
    assert len(plans) == 1
    plan = plans.pop()
    assert plan.split_tokens >= invariant_attention.SPLIT_TOKENS and plan.split_tokens % split_tile(plan) == 0


def test_write_is_the_kernels_write():
    assert invariant_attention.backend().write_kv is K.write_kv


# ------------------------------------------------------------------ the engine in the mode
@pytest.fixture(scope="module")
def kernel_mode_model(tmp_path_factory):
    """The tiny Llama on this test's device, whose engines in the batch-invariant mode run the Triton backend
    (on a CPU machine the engine would otherwise take the mode's torch ops)."""
    from helpers_runtime import tiny_llama_dir

    from runtime.config import ModelConfig
    from runtime.model import LlamaModel
    from runtime.weights import open_weights

    d = tiny_llama_dir(tmp_path_factory)
    cfg = ModelConfig.from_dir(d)
    return LlamaModel(cfg, open_weights(d, cfg), DEV, torch.bfloat16 if CUDA else torch.float32)


def _kernel_mode_generate(model, fmt, prompts, blocks, budget, max_tokens=4):
    from runtime import engine as engine_module
    from runtime import engine_ops
    from runtime.runner import plan_pool

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_ops, "batch_invariant_backend", lambda m: invariant_attention.backend())
        eng = engine_module.Engine(model, fmt, plan_pool(model.cfg, fmt, 8, num_blocks=blocks), None, None,
                                   max_batch_size=16, max_tokens_per_step=budget, batch_invariant=True)
    try:
        assert eng.stats.attention == "batch-invariant(triton)"
        out = [g.token_ids for g in eng.generate(prompts, max_tokens=max_tokens, ignore_eos=True)]
        return out, eng.stats
    finally:
        eng.shutdown()


ENGINE_FMT = KVFormat("int8", "per_token")
ENGINE_PROMPTS = [[(i * 53 + 7 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((15, 14, 3))]


@pytest.fixture(scope="module")
def solo_tokens(kernel_mode_model):
    return [_kernel_mode_generate(kernel_mode_model, ENGINE_FMT, [p], 64, 2048)[0][0] for p in ENGINE_PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("budget,blocks", [(7, 64), (2048, 5)], ids=["chunked", "preempted"])
def test_engine_requests_in_a_batch_equal_solo_runs(kernel_mode_model, solo_tokens, budget, blocks):
    """int8 per-token KV through the engine in the mode: three prompts batched, chunked by a 7-token step budget
    or preempted in a 5-block pool, give each prompt's solo tokens."""
    got, stats = _kernel_mode_generate(kernel_mode_model, ENGINE_FMT, ENGINE_PROMPTS, blocks, budget)
    if budget == 2048:
        assert stats.preemptions > 0
    assert got == solo_tokens


def test_gemm_compiles_for_sm90_without_spills():
    """Cross-compiled for the H200 (no GPU needed; a process of its own, outside the interpreter): every shape
    builds in the one config and in the tiles the H200 picks by row count, no register spills, and bf16 tiles
    run on the Hopper tensor cores' wgmma."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "tests.helpers_invariant_compile"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert len([r for r in rows if "block_m" not in r]) == 10  # the one config at every shape
    assert {r.get("block_m") for r in rows} >= {64, 128, 256}  # and every row bucket's tiles of the H200
    for r in rows:
        assert "error" not in r and r["stack"] == 0, r
        assert r["wgmma"] or r["dtype"] == "float32", r
