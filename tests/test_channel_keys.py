"""Per-channel keys (KIVI): k.int4-per_channel-asym+v.int4-per_token-asym (runtime/channel_keys.py).

The quantizer against the format's rule computed in fp64; the attention against an fp64 oracle of the
position semantics (a query reads its own block's keys in fp16, earlier blocks quantized); the engine's
decode, chunked prefill, whole-prompt prefill and Engine.score against each other, and batched against alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_channel_keys import BLOCK, FMT, NAME, exact_int4_values, keys, oracle_attention, oracle_block
from helpers_runtime import run_chunks, tiny_llama_dir

from runtime import attention, batch_invariant
from runtime.config import ModelConfig, ceil_div
from runtime.errors import InputError, UnsupportedError
from runtime.kv_format import (
    KVFormat,
    format_fields,
    format_from_name,
    kv_bytes_per_token,
    resident_seqs,
    residual_bytes,
)
from runtime.kv_quant import dequantize_per_channel, quantize_per_channel, unpack_int4
from runtime.model import LlamaModel
from runtime.runner import allocate_pool, plan_pool
from runtime.weights import open_weights


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_matches_the_fp64_rule(dtype):
    """Codes, scales and zeros equal the rule computed in fp64; every element is within s/2 of its value."""
    x = keys(0, (2, 3, BLOCK, 64)).to(dtype)
    packed, scale, zero = quantize_per_channel(x, FMT.k)
    assert packed.shape == (2, 3, BLOCK, 32) and packed.dtype == torch.uint8
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == (2, 3, 64)
    x64 = x.double().numpy()
    want_q, want_s, want_zero, y = oracle_block(x64)
    np.testing.assert_array_equal(zero.double().numpy(), want_zero)
    np.testing.assert_array_equal(scale.double().numpy(), want_s)
    clear = np.abs(y - np.floor(y) - 0.5) > 1e-4  # away from a rounding tie, fp32 and fp64 agree
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(unpack_int4(packed).double().numpy()[clear], want_q[clear])
    back = dequantize_per_channel(packed, scale, zero).double().numpy()
    # the error bound of the format: half a step of the stored scale (plus fp32 rounding of q * s + zero)
    bound = want_s[..., None, :] / 2 + 2.0**-22 * np.abs(x64).max()
    assert (np.abs(back - x64) <= bound).all()


@pytest.mark.parametrize("ops", ["reference", "batch-invariant"])
def test_attention_reads_own_block_fp16_and_earlier_blocks_quantized(ops):
    """Keys written in uneven chunks; prefill chunks and decode queries equal the fp64 oracle."""
    backend = attention.reference_backend() if ops == "reference" else batch_invariant.backend()
    t, heads, kvh, d = 150, 4, 2, 64
    k = keys(1, (t, kvh, d))
    v = exact_int4_values(2, (t, kvh, d))
    q = torch.randn(t, heads, d, generator=torch.Generator().manual_seed(3))
    cfg = ModelConfig(hidden_size=heads * d, intermediate_size=64, num_layers=1, num_heads=heads, num_kv_heads=kvh,
                      head_dim=d, vocab_size=16, max_position_embeddings=256)
    cache = allocate_pool(cfg, FMT, plan_pool(cfg, FMT, BLOCK, num_blocks=4), "cpu", None, None)[0]
    table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)  # pages anywhere in the pool
    slots = torch.tensor([int(table[0, p // BLOCK]) * BLOCK + p % BLOCK for p in range(t)])
    sm = d**-0.5
    got = torch.empty(t, heads, d)
    for a, b in [(0, 50), (50, 100), (100, 101), (101, 140), (140, 150)]:
        backend.write_kv(cache, k[a:b], v[a:b], slots[a:b])
        if b - a == 1:
            got[a] = backend.decode_attention(q[a:b], cache, table, torch.tensor([b], dtype=torch.int32), sm)[0]
            continue
        _, stored_v = attention.read_kv(cache, slots[a:b], torch.float32)
        got[a:b] = backend.prefill_context_attention(q[a:b], k[a:b], stored_v, torch.tensor([0, b - a]), cache,
                                                     table, torch.tensor([a], dtype=torch.int32), sm)
    for p in range(t):
        np.testing.assert_allclose(got[p].double().numpy(), oracle_attention(q[p], k, v, p, sm), atol=2e-5,
                                   err_msg=f"position {p}")


# ----------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> LlamaModel:
    d = tiny_llama_dir(tmp_path_factory)
    cfg = ModelConfig.from_dir(d)
    return LlamaModel(cfg, open_weights(d, cfg), "cpu", torch.float32)


PROMPT = [(11 * j) % 500 + 3 for j in range(150)]


def _run_chunks(model: LlamaModel, ids: list[int], bounds: list[int]) -> torch.Tensor:
    """Every token's logits with the prompt run as the chunks [bounds[i], bounds[i+1]) through the engine's CPU
    ops (batch-invariant); a 1-token chunk after the first is a decode step."""
    plan = plan_pool(model.cfg, FMT, BLOCK, num_blocks=ceil_div(len(ids), BLOCK))
    caches = allocate_pool(model.cfg, FMT, plan, "cpu", None, None)
    return run_chunks(model, caches, ids, bounds, BLOCK, batch_invariant.backend())


def test_decode_chunked_and_whole_prefill_give_the_same_bits(tiny_model):
    """Whole prompt, chunks of 7 / 50 / 64 tokens and token-by-token decode after 5 tokens: identical logits."""
    n = len(PROMPT)
    whole = _run_chunks(tiny_model, PROMPT, [0, n])
    for bounds in ([*range(0, n, 7), n], [0, 50, 100, n], [0, 64, 128, n], [0, 5, *range(6, n + 1)]):
        assert torch.equal(_run_chunks(tiny_model, PROMPT, bounds), whole), bounds[:4]
    # the check can tell: an fp16 cache gives other logits
    assert (tiny_model.forward_dense(torch.tensor(PROMPT)) - whole).abs().max() > 1e-2


def _engine(model, **kw):
    from runtime.engine import Engine

    kw = {"max_batch_size": 4, "max_tokens_per_step": 2048, **kw}
    plan = plan_pool(model.cfg, FMT, BLOCK, num_blocks=kw.pop("num_blocks", 24), max_num_seqs=kw["max_batch_size"])
    return Engine(model, FMT, plan, None, None, batch_invariant=True, **kw)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * j * j + 5 * j) % 500 + 3 for j in range(n)]


def test_engine_score_equals_decode_and_batched_equals_alone(tiny_model):
    """Engine.score at 7 / 64 / 100 / 2048 tokens per pass gives the same log-probs, equal to the token-by-token
    decode's; greedy tokens of requests batched with a small step budget (chunked, 1 residual block each) equal
    their solo runs'."""
    eng = _engine(tiny_model)
    try:
        seqs = [PROMPT, _prompt(1, 90), _prompt(2, 64)]
        ref = eng.score(seqs, tokens_per_pass=2048)
        for per_pass in (7, 64, 100):
            for got, want in zip(eng.score(seqs, tokens_per_pass=per_pass), ref):
                assert torch.equal(got.logprobs, want.logprobs), per_pass
        stepped = _run_chunks(tiny_model, PROMPT, [0, 5, *range(6, len(PROMPT) + 1)])
        lp = torch.log_softmax(stepped[:-1], -1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
        torch.testing.assert_close(ref[0].logprobs, lp, rtol=0, atol=1e-6)
        prompts = [_prompt(i, n) for i, n in enumerate([3, 70, 129, 64, 10, 100])]
        solo = [eng.generate([p], max_tokens=70, ignore_eos=True)[0].token_ids for p in prompts]
    finally:
        eng.shutdown()
    eng = _engine(tiny_model, max_tokens_per_step=40, num_blocks=40)
    try:
        together = [g.token_ids for g in eng.generate(prompts, max_tokens=70, ignore_eos=True)]
        assert max(eng.stats.step_batch_sizes) >= 3
        # every sequence ended inside a block: their residual blocks came back when they were freed
        assert all(not c.residual.of_block for c in eng.runner.caches)
    finally:
        eng.shutdown()
    assert together == solo


def test_decode_bursts_give_the_tokens_of_single_steps_across_block_ends(tiny_model):
    """Bursts of 7 steps (the host plans every step's residual slots before the burst) over prompts that end
    inside, at and just before a block's end, decoding across two more block ends, then again over the same
    prompts and some of their tokens (full pages from the prefix cache): the single steps' tokens."""
    prompts = [_prompt(i, n) for i, n in enumerate([3, 64, 63, 100])]
    outs = {}
    for steps in (0, 7):
        eng = _engine(tiny_model, burst_steps=steps, num_blocks=40)
        try:
            first = [g.token_ids for g in eng.generate(prompts, max_tokens=140, ignore_eos=True)]
            again = [p + t[:10] for p, t in zip(prompts, first)]
            outs[steps] = first, [g.token_ids for g in eng.generate(again, max_tokens=70, ignore_eos=True)]
            ran = eng.steps.burst.steps_run if eng.steps.burst is not None else 0
            assert eng.stats.reused_tokens >= 64, eng.stats.reused_tokens
            assert all(not c.residual.of_block for c in eng.runner.caches)
        finally:
            eng.shutdown()
        assert (ran > 150) == (steps > 0), ran
    assert outs[7] == outs[0]


def test_pool_bytes_equal_the_plan(tiny_model):
    """The pool the engine allocates is the plan's blocks x bytes/token plus the residual blocks, both from
    kv_format (4.5 bits per element: 4-bit codes, 0.5 bit of per-block channel scales / per-token scales)."""
    cfg = tiny_model.cfg
    assert FMT.bits_per_element(64) == 4.5
    eng = _engine(tiny_model, num_blocks=10)
    try:
        st = eng.stats
        heads_layers = cfg.num_kv_heads * cfg.num_layers
        assert residual_bytes(cfg, FMT, 4) == 4 * heads_layers * BLOCK * cfg.head_dim * 2
        assert st.pool_allocated_bytes == st.pool_bytes + residual_bytes(cfg, FMT, 4)
        assert st.pool_bytes == 10 * BLOCK * heads_layers * (cfg.head_dim + cfg.head_dim / 16 + 4)
        assert "batch-invariant" in st.attention
    finally:
        eng.shutdown()
    # a byte budget pays for the residual blocks first
    budget = residual_bytes(cfg, FMT, 4) + 3 * BLOCK * st.kv_bytes_per_token
    assert plan_pool(cfg, FMT, BLOCK, memory_budget=budget, max_num_seqs=4).num_blocks == 3


def test_names_fields_and_recipes_round_trip():
    assert FMT.name == NAME and format_from_name(NAME) == FMT
    assert KVFormat(**format_fields(FMT)) == FMT  # an engine directory's kv_format.json
    assert FMT.k.per_channel_keys and not FMT.v.per_channel_keys and not FMT.static and not FMT.dynamic
    from recipes.kv_section import KVSection

    assert KVSection(format=NAME).to_format() == FMT
    # the fields' spelling (a recipe extending one with kv.dtype set): K's own granularity, V's `granularity`
    fields = KVSection(dtype="int4", granularity="per_token", k_granularity="per_channel", symmetric=False)
    assert fields.to_format() == FMT


def test_bad_spellings_and_settings_are_refused(tiny_model):
    for name in ("int4-per_channel-asym", "k.int4-per_channel+v.int4-per_token-asym",
                 "k.int8-per_channel-asym+v.int4-per_token-asym", "k.int4-per_token-asym+v.int4-per_channel-asym"):
        with pytest.raises(UnsupportedError):
            format_from_name(name)
    from runtime.engine import Engine

    with pytest.raises(UnsupportedError, match="block_size 64"):
        Engine(tiny_model, FMT, plan_pool(tiny_model.cfg, FMT, 32, num_blocks=8), None, None)


def test_recipes_refuse_it_for_tensorrt_llm_and_other_block_sizes():
    from recipes import Recipe

    base = {"name": "r", "model": {"source": "builtin", "preset": "smollm2-135m"}, "kv": {"format": NAME}}
    with pytest.raises(ValueError, match="block_size: 64"):
        Recipe.model_validate({**base, "build": {"block_size": 32}})
    with pytest.raises(ValueError, match="no INT4 KV cache and no per-channel key scales.*fp8_e4m3-per_tensor"):
        Recipe.model_validate({**base, "backend": "tensorrt-llm", "build": {"block_size": 64}})
    assert Recipe.model_validate({**base, "build": {"block_size": 64}}).kv.to_format() == FMT


def _most_resident(pool: int, seq: int, one: int, cap: int) -> int:
    """Brute force: the largest n with n * seq + min(n, cap) * one <= pool."""
    n = 0
    while (n + 1) * seq + min(n + 1, cap) * one <= pool:
        n += 1
    return n


def test_resident_seqs_solves_the_pool_for_n():
    for pool in (0, 1, 99, 100, 101, 999, 4096):
        for seq, one, cap in ((7, 3, 4), (10, 0, 2), (1, 50, 8), (33, 64, 1)):
            assert resident_seqs(pool, seq, one, cap) == _most_resident(pool, seq, one, cap), (pool, seq, one, cap)


def test_budget_keeps_residual_blocks_only_for_the_sequences_that_fit(tiny_model):
    """Given the tokens a request is sized for, the residual blocks are min(max_num_seqs, what fits) and the
    rest of the budget is blocks: n requests of 3 blocks each and their residual fit, n + 1 do not."""
    cfg = tiny_model.cfg
    one, per_block = residual_bytes(cfg, FMT, 1), BLOCK * kv_bytes_per_token(cfg, FMT)
    seq = 3 * per_block  # 160 tokens: 3 blocks of 64
    budget = int(2 * (seq + one) + per_block)  # 2 requests with their residual, and a spare block
    plan = plan_pool(cfg, FMT, BLOCK, memory_budget=budget, max_num_seqs=8, seq_tokens=160)
    assert plan.residual_slots == 2
    assert plan.num_blocks == (budget - 2 * one) // per_block == 7
    # without a request length every one of max_num_seqs sequences gets a residual block: here none is left
    with pytest.raises(InputError, match="no block"):
        plan_pool(cfg, FMT, BLOCK, memory_budget=budget, max_num_seqs=8)
    # a budget past max_num_seqs' requests keeps max_num_seqs residual blocks
    assert plan_pool(cfg, FMT, BLOCK, memory_budget=10 * (seq + one), max_num_seqs=8, seq_tokens=160).residual_slots == 8
    # other formats have no residual: the sizing is as before
    fp16 = KVFormat("fp16")
    assert plan_pool(cfg, fp16, BLOCK, memory_budget=budget, max_num_seqs=8, seq_tokens=160).num_blocks == \
        budget // (BLOCK * kv_bytes_per_token(cfg, fp16))


def test_engine_runs_no_more_sequences_than_residual_blocks(tiny_dir):
    """A budget for 2 requests of 160 tokens: the engine allocates the plan's bytes exactly (blocks + 2 residual
    blocks), admits 2 sequences at a time and serves 5 requests to the end (the rest wait, nothing raises)."""
    from runtime.engine import Engine

    cfg = ModelConfig.from_dir(tiny_dir)
    one, per_block = residual_bytes(cfg, FMT, 1), BLOCK * kv_bytes_per_token(cfg, FMT)
    budget = int(2 * (3 * per_block + one) + per_block)
    eng = Engine.from_dir(tiny_dir, kv_format=NAME, memory_budget=budget, max_batch_size=8, seq_tokens=160)
    try:
        st = eng.stats
        assert eng.scheduler.max_batch_size == 2 and all(c.residual.num_slots == 2 for c in eng.runner.caches)
        assert st.pool_blocks == 7
        assert st.pool_allocated_bytes == st.pool_bytes + residual_bytes(cfg, FMT, 2) <= budget
        out = eng.generate([_prompt(i, 100) for i in range(5)], max_tokens=60, ignore_eos=True)
        assert [len(g.token_ids) for g in out] == [60] * 5
        assert max(st.step_batch_sizes) == 2
        assert all(not c.residual.of_block for c in eng.runner.caches)
    finally:
        eng.shutdown()


def test_residual_slots_refuse_a_block_when_all_are_taken():
    """ResidualSlots: a block past the last slot is refused (None) where optional, an UnsupportedError naming
    the cause where required; a released slot serves the next block."""
    from runtime.kv_cache import ResidualSlots

    res = ResidualSlots(2)
    assert {res.take(10), res.take(11)} == {0, 1} and res.take(10) == res.of_block[10]
    assert res.take(12, required=False) is None
    with pytest.raises(UnsupportedError, match="residual"):
        res.take(12)
    slot = res.of_block[10]
    res.release(10)
    assert res.take(12) == slot


@pytest.mark.parametrize("kv", [{"layers": {"0": NAME, "1-29": "int8-per_token"}},
                                {"dtype": "auto", "rotation": "hadamard"}])
def test_recipes_refuse_it_per_layer_and_in_search_candidates_at_other_block_sizes_and_tp(kv):
    from recipes import Recipe

    base = {"name": "r", "model": {"source": "builtin", "preset": "smollm2-135m"}, "kv": kv}
    if kv.get("dtype") == "auto":
        base["search"] = {"formats": ["int8-per_token", NAME]}
    with pytest.raises(ValueError, match=r"build.block_size: .*per_channel.*set build.block_size: 64 \(got 32\)"):
        Recipe.model_validate({**base, "build": {"block_size": 32}})
    with pytest.raises(ValueError, match="build.tp: .*set build.tp: 1"):
        Recipe.model_validate({**base, "build": {"block_size": 64, "tp": 3}})
    recipe = Recipe.model_validate({**base, "build": {"block_size": 64}})
    assert FMT in recipe.stored_formats()
