"""Prefix caching: content-addressed full pages, the LRU of parked pages, and the engine
giving the same greedy tokens with caching on as off, for every KV format."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers_runtime import tiny_llama_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.block_manager import BlockManager, OutOfBlocks
from runtime.config import ModelConfig
from runtime.engine import Engine
from runtime.engine_dir import read_settings
from runtime.kv_format import KVFormat
from runtime.kv_quant import static_scale_from_amax
from runtime.model import LlamaModel
from runtime.runner import plan_pool
from runtime.sampling import SamplingParams
from runtime.weights import open_weights

BS = 4


def _computed(m: BlockManager, seq, tokens):
    """Allocate `tokens` reusing the cache, then mark them all written (as a step's forward would)."""
    cached = m.allocate_prefix(seq, tokens)
    m.mark_computed(seq, tokens, len(tokens))
    return cached


# ------------------------------------------------------------ block manager
def test_a_cached_prefix_is_reused_up_to_the_last_full_page_before_the_last_token():
    m = BlockManager(16, BS, prefix_caching=True, salt="int8-per_token|model-a")
    a = list(range(10))  # pages [0..3] [4..7], partial [8, 9]
    assert _computed(m, "a", a) == 0
    assert m.cache_stats.lookups == 2 and m.cache_stats.hits == 0
    # same first 8 tokens: both full pages reused, the partial third page is not
    assert _computed(m, "b", a[:8] + [99, 98, 97]) == 8
    assert m.block_table("b")[:2] == m.block_table("a")[:2] and m.ref_count(m.block_table("a")[0]) == 2
    # exactly two pages long: the page holding the last token is computed, only one reused
    assert _computed(m, "c", a[:8]) == 4
    # a different first page changes every later key even if page two's tokens match
    assert _computed(m, "d", [50, 51, 52, 53] + a[4:8] + [1]) == 0
    st = m.cache_stats
    assert (st.hits, st.reused_tokens) == (3, 12) and st.lookups == 2 + 2 + 1 + 2
    assert st.hit_rate == pytest.approx(3 / 7)


def test_pages_are_cached_only_once_full_and_written():
    m = BlockManager(16, BS, prefix_caching=True)
    t = list(range(12))
    m.allocate_prefix("a", t)
    assert m.allocate_prefix("b", t) == 0  # "a" has not run yet: nothing is cached
    m.mark_computed("a", t, 6)  # one full page written, the second half written
    assert m.allocate_prefix("c", t) == 4
    m.free("b")
    m.free("c")
    m.append("a")  # decode token 12 starts page 4; token 11 completes page 3 only when written
    m.mark_computed("a", t + [12], 13)
    assert m.allocate_prefix("e", t + [12, 13]) == 12


def test_another_format_or_model_never_matches():
    t = list(range(9))
    for salt in ("fp8_e4m3-per_tensor|m", "int8-per_token|other-model"):
        m = BlockManager(8, BS, prefix_caching=True, salt="int8-per_token|m")
        _computed(m, "a", t)
        other = BlockManager(8, BS, prefix_caching=True, salt=salt)
        _computed(other, "a", t)
        # the same manager matches; keys from a differently salted manager are different keys
        assert _computed(m, "b", t) == 8
        assert set(m._cached).isdisjoint(other._cached)


def test_finished_pages_park_and_allocation_evicts_the_least_recent_before_running_out():
    m = BlockManager(4, BS, prefix_caching=True)
    _computed(m, "a", list(range(8)) + [100])  # 3 pages, 2 cacheable
    m.free("a")
    assert m.num_free_blocks == 4 and m.num_cached_blocks == 2  # parked pages count as available
    _computed(m, "b", [7] * 9)  # 3 pages: the 2 free ones first, then the older parked page
    assert m.cache_stats.evictions == 1 and m.num_cached_blocks == 3  # a's newer page and b's 2 full ones
    with pytest.raises(OutOfBlocks):
        m.allocate_prefix("c", list(range(20, 29)))  # 3 pages: only 1 available; b's pages are referenced
    assert "c" not in m and m.num_free_blocks == 1  # all or nothing


def test_eviction_takes_a_prefix_tail_first():
    m = BlockManager(6, BS, prefix_caching=True)
    t = list(range(13))  # 4 pages, 3 cacheable
    _computed(m, "a", t)
    m.free("a")
    m.allocate("x", 4 * BS)  # the 3 free pages go first, then the prefix's tail page is evicted
    assert m.cache_stats.evictions == 1
    m.free("x")
    assert m.allocate_prefix("b", t) == 8  # the first two pages of the prefix survive


def test_caching_off_behaves_as_before():
    m = BlockManager(4, BS)
    assert _computed(m, "a", list(range(9))) == 0
    m.free("a")
    assert _computed(m, "b", list(range(9))) == 0 and m.num_cached_blocks == 0


def test_random_prefix_sharing_keeps_ref_counts_and_contents_consistent():
    """Sequences of 6 prefix families, random adds / decode steps / frees on a small pool. A
    shadow of each page's written tokens proves that every reused page holds exactly the
    tokens the new sequence would have written; ref counts equal the owners; no referenced
    page is parked or free; every page is free, parked or referenced exactly once."""
    seen = {"hits": 0, "evictions": 0}

    @settings(max_examples=200, deadline=None)
    @given(ops=st.lists(st.tuples(st.sampled_from(["add", "add", "step", "free"]), st.integers(0, 5),
                                  st.integers(1, 14)), max_size=60),
           num_blocks=st.integers(3, 10))
    def check(ops, num_blocks):
        _random_workload(ops, num_blocks, seen)

    check()
    assert seen["hits"] and seen["evictions"], seen  # the draws did reuse and evict pages


def _random_workload(ops, num_blocks, seen):
    m = BlockManager(num_blocks, BS, prefix_caching=True)
    content: dict[int, list] = {}  # page -> token at each written offset
    seqs: dict[int, list[int]] = {}
    ids = iter(range(10**6))
    for op, family, n in ops:
        if op == "add":
            tokens = [family * 100 + j for j in range(n)]
            sid = next(ids)
            try:
                cached = m.allocate_prefix(sid, tokens)
            except OutOfBlocks:
                continue
            table = m.block_table(sid)
            for p in range(cached):  # what the cache claims is already there
                assert content[table[p // BS]][p % BS] == tokens[p]
            for p in range(cached, n):
                content.setdefault(table[p // BS], [None] * BS)[p % BS] = tokens[p]
            m.mark_computed(sid, tokens, n)
            seqs[sid] = tokens
        elif op == "step" and seqs:
            sid = sorted(seqs)[n % len(seqs)]
            if not m.can_append(sid):
                continue
            assert m.append(sid) is None  # full pages are never written again, so no copy-on-write
            tok = seqs[sid][-1] * 7 % 1000
            seqs[sid].append(tok)
            p = len(seqs[sid]) - 1
            content.setdefault(m.block_table(sid)[p // BS], [None] * BS)[p % BS] = tok
            m.mark_computed(sid, seqs[sid], len(seqs[sid]))
        elif op == "free" and seqs:
            sid = sorted(seqs)[n % len(seqs)]
            m.free(sid)
            del seqs[sid]
        owners = [0] * num_blocks
        for sid in seqs:
            for b in m.block_table(sid):
                owners[b] += 1
        assert [m.ref_count(b) for b in range(num_blocks)] == owners
        for b in range(num_blocks):
            assert owners[b] >= 0
            assert not (owners[b] and m.is_parked(b)), "a referenced page is parked (evictable)"
        assert m.num_free_blocks == sum(1 for o in owners if o == 0)
    seen["hits"] += m.cache_stats.hits
    seen["evictions"] += m.cache_stats.evictions


# ------------------------------------------------------------------ engine
FORMATS = [KVFormat("fp32"), KVFormat("fp8_e4m3", "per_tensor"), KVFormat("int8", "per_token"),
           KVFormat("int4", "per_token", False)]
SYSTEM = [(13 * j) % 500 + 3 for j in range(21)]  # a shared 21-token system prompt


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> LlamaModel:
    d = tiny_llama_dir(tmp_path_factory)
    cfg = ModelConfig.from_dir(d)
    return LlamaModel(cfg, open_weights(d, cfg), "cpu", torch.float32)


@pytest.fixture(scope="module")
def scales(tiny_model):
    """Max-policy static scales from a dense pass (fp8 per-tensor); None for dynamic formats."""
    out = {}
    for fmt in FORMATS:
        if not fmt.static:
            out[fmt] = (None, None)
            continue
        n, h = tiny_model.cfg.num_layers, tiny_model.cfg.num_kv_heads
        amax = {"k": torch.zeros(n, h), "v": torch.zeros(n, h)}

        def observe(i, k, v, amax=amax):
            amax["k"][i] = k.abs().amax(dim=(0, 2))
            amax["v"][i] = v.abs().amax(dim=(0, 2))

        tiny_model.forward_dense(torch.tensor(SYSTEM * 3), observer=observe)
        out[fmt] = tuple(static_scale_from_amax(amax[x].amax(1), fmt) for x in "kv")
    return out


def _engine(model, fmt, scales, caching, num_blocks=64, step_tokens=2048, block_size=8):
    plan = plan_pool(model.cfg, fmt, block_size, num_blocks=num_blocks)
    return Engine(model, fmt, plan, *scales, max_batch_size=16, max_tokens_per_step=step_tokens,
                  batch_invariant=True, prefix_caching=caching)


def _conversations(engine, users: int, turns: int) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Multi-turn chats sharing SYSTEM: each turn resends the history plus a new question;
    returns every turn's outputs and cached-token counts."""
    history = [list(SYSTEM) for _ in range(users)]
    outs, cached = [], []
    for t in range(turns):
        prompts = [h + [(31 * u + 7 * t + j) % 500 + 3 for j in range(5 + u)] for u, h in enumerate(history)]
        gens = engine.generate(prompts, max_tokens=6, ignore_eos=True)
        outs.append([g.token_ids for g in gens])
        cached.append([g.cached_tokens for g in gens])
        history = [p + g.token_ids for p, g in zip(prompts, gens)]
    return outs, cached


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_multi_turn_greedy_tokens_equal_caching_off(tiny_model, scales, fmt):
    """3 users x 3 turns over a shared system prompt: the same tokens with caching on and off;
    later turns reuse their history (per-token scales live in the pages and come along)."""
    results = {}
    for caching in (False, True):
        eng = _engine(tiny_model, fmt, scales[fmt], caching)
        try:
            results[caching] = (*_conversations(eng, users=3, turns=3), eng.stats)
        finally:
            eng.shutdown()
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks  # every page released or parked
    (off, off_cached, _), (on, on_cached, st) = results[False], results[True]
    assert on == off
    assert off_cached == [[0] * 3] * 3
    assert all(c >= len(SYSTEM) // 8 * 8 for turn in on_cached[1:] for c in turn)  # history reused
    assert st.prefix_caching and st.prefix_hits > 0 and st.reused_tokens == 8 * st.prefix_hits
    assert 0 < st.prefix_hit_rate <= 1


def test_random_shared_prefix_workloads_with_evictions_and_preemptions(tiny_model, scales):
    """Hypothesis over prefix-sharing workloads (2-8 requests over 3 prefixes, two waves so the
    second reuses the first's parked pages), small pools (evictions, preemptions) and step
    budgets (chunked prefill), every format: tokens equal caching off; no page leaks."""
    seen = {"hits": 0, "evictions": 0, "preemptions": 0}
    want_cache: dict = {}

    @settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(fmt=st.sampled_from(FORMATS),
           reqs=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 20)), min_size=2, max_size=8),
           num_blocks=st.sampled_from([9, 12, 40]), budget=st.sampled_from([7, 24, 2048]))
    def check(fmt, reqs, num_blocks, budget):
        prefixes = [[(97 * f + 11 * j) % 500 + 3 for j in range(12 + 9 * f)] for f in range(3)]
        prompts = [prefixes[f] + [(5 * i + j) % 500 + 3 for j in range(n)] for i, (f, n) in enumerate(reqs)]
        waves = [prompts[: len(prompts) // 2], prompts[len(prompts) // 2:]]
        key = (fmt, tuple(map(tuple, prompts)))
        if key not in want_cache:  # caching off, one budget: chunking does not change tokens
            off = _engine(tiny_model, fmt, scales[fmt], False, num_blocks=64)
            try:
                want_cache[key] = [[g.token_ids for g in off.generate(w, max_tokens=8, ignore_eos=True)] for w in waves]
            finally:
                off.shutdown()
        eng = _engine(tiny_model, fmt, scales[fmt], True, num_blocks=num_blocks, step_tokens=budget)
        try:
            got = [[g.token_ids for g in eng.generate(w, max_tokens=8, ignore_eos=True)] for w in waves]
        finally:
            eng.shutdown()
        assert got == want_cache[key], (fmt.name, reqs, num_blocks, budget)
        m = eng.blocks
        assert all(m.ref_count(b) == 0 for b in range(m.num_blocks)) and m.num_free_blocks == m.num_blocks
        seen["hits"] += eng.stats.prefix_hits
        seen["evictions"] += eng.stats.evictions
        seen["preemptions"] += eng.stats.preemptions

    check()
    assert all(seen.values()), seen  # the draws did reuse, evict and preempt


def test_prefix_caching_setting_from_recipe_to_engine(tmp_path_factory, tmp_path):
    """build.prefix_caching (default on) -> engine.json -> Engine.from_dir, which can override it."""
    import shutil

    from recipes.schema import BuildSection

    assert BuildSection().prefix_caching is True
    for f in tiny_llama_dir(tmp_path_factory).iterdir():
        shutil.copy(f, tmp_path / f.name)
    for setting, override, want in (("{}", None, True), ('{"prefix_caching": false}', None, False),
                                    ('{"prefix_caching": false}', True, True)):
        (tmp_path / "engine.json").write_text(setting)
        eng = Engine.from_dir(tmp_path, num_blocks=8, prefix_caching=override)
        try:
            assert eng.stats.prefix_caching is want and eng.blocks.prefix_caching is want
        finally:
            eng.shutdown()
    (tmp_path / "engine.json").write_text('{"prefix_caching": "yes"}')
    with pytest.raises(Exception, match="prefix_caching must be true or false"):
        read_settings(tmp_path)


def test_on_finish_reports_each_requests_reused_and_new_pages(tiny_model, scales):
    fmt = KVFormat("int8", "per_token")
    eng = _engine(tiny_model, fmt, scales[fmt], True)
    prompt = SYSTEM + [7, 8, 9]  # 24 tokens: 3 pages, the last one holding the last token
    usages = []
    try:
        for _ in range(2):
            done = threading.Event()
            eng.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True),
                       lambda tok, fin, *_, done=done: fin and done.set(), on_finish=usages.append)
            assert done.wait(60)
    finally:
        eng.shutdown()
    assert [(u.reused_blocks, u.new_blocks, u.total_blocks, u.cached_tokens) for u in usages] == [
        (0, 3, 3, 0), (2, 1, 3, 16)]
