"""The engine end to end: batching, preemption, sampling, streaming, formats, bad input."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch
from helpers_runtime import CHAT_QUESTIONS, chat_prompt_ids, sample_text, smollm2_dir, tiny_llama_dir
from safetensors.torch import save_file

from runtime.config import PRESETS, ModelConfig
from runtime.engine import Engine
from runtime.engine_dir import read_settings
from runtime.errors import InputError, RequestError
from runtime.kv_format import KVFormat, kv_bytes_per_token
from runtime.kv_quant import static_scale_from_amax
from runtime.runner import plan_pool
from runtime.sampling import SamplingParams, sample

# 8 prompts of different lengths (token ids valid for both the tiny and SmolLM2 vocabularies).
PROMPTS = [[(7 * i + 13 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([3, 17, 5, 40, 9, 26, 1, 12])]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir):
    eng = Engine.from_dir(tiny_dir, num_blocks=128, block_size=8)
    yield eng
    eng.shutdown()


def _one_at_a_time(eng: Engine, prompts, **kw) -> list[list[int]]:
    return [eng.generate([p], **kw)[0].token_ids for p in prompts]


# ------------------------------------------------------------- batching
def test_batch_equals_one_at_a_time_and_survives_preemption(tiny_dir, tiny_engine):
    alone = _one_at_a_time(tiny_engine, PROMPTS, max_tokens=24, ignore_eos=True)
    batched = [g.token_ids for g in tiny_engine.generate(PROMPTS, max_tokens=24, ignore_eos=True)]
    assert batched == alone
    assert max(tiny_engine.stats.step_batch_sizes) == 8
    # 10 blocks of 8 tokens = 80 slots for 8 requests that need up to 64 each: must preempt.
    small = Engine.from_dir(tiny_dir, num_blocks=10, block_size=8)
    try:
        squeezed = [g.token_ids for g in small.generate(PROMPTS, max_tokens=24, ignore_eos=True)]
        assert small.stats.preemptions > 0
        assert small.blocks.num_free_blocks == 10  # finished sequences gave their blocks back
    finally:
        small.shutdown()
    assert squeezed == alone


def test_requests_join_while_others_decode(tiny_engine):
    first_tokens = threading.Event()
    seen: list[int] = []
    done = threading.Event()

    def on_first(tok, finished, reason):
        seen.append(tok)
        if len(seen) == 3:
            first_tokens.set()
        if finished:
            done.set()

    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    tiny_engine.stats.step_batch_sizes.clear()
    tiny_engine.submit(PROMPTS[3], sp, on_first)
    assert first_tokens.wait(60)
    late = tiny_engine.generate([PROMPTS[1]], max_tokens=5, ignore_eos=True)[0]
    assert done.wait(60)
    assert 2 in tiny_engine.stats.step_batch_sizes  # the late prefill shared steps with the decode
    assert late.token_ids == _one_at_a_time(tiny_engine, [PROMPTS[1]], max_tokens=5, ignore_eos=True)[0]
    assert seen[:-1] and all(t is not None for t in seen)


def test_many_threads_share_batches(tiny_engine):
    results: dict[int, list[int]] = {}
    barrier = threading.Barrier(4)

    def worker(i):
        barrier.wait()
        results[i] = tiny_engine.generate([PROMPTS[i]], max_tokens=16, ignore_eos=True)[0].token_ids

    tiny_engine.stats.step_batch_sizes.clear()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(4)] == _one_at_a_time(tiny_engine, PROMPTS[:4], max_tokens=16, ignore_eos=True)
    assert max(tiny_engine.stats.step_batch_sizes) >= 2


# ------------------------------------------------------------- sampling
def test_sampling_filters_and_seeds():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, -1.0]] * 2)
    draws = set()
    for seed in range(40):
        sp = SamplingParams(temperature=1.0, top_k=2, seed=seed)
        draws.update(sample(logits[:1], [sp], [sp.make_generator()]))
    assert draws == {1, 2}  # top-k keeps exactly the two best
    sp = SamplingParams(temperature=1.0, top_p=0.5, seed=0)
    assert {sample(logits[:1], [sp], [SamplingParams(seed=s).make_generator()])[0] for s in range(20)} == {1}
    hot = SamplingParams(temperature=100.0, seed=0)
    many = {sample(logits[:1], [hot], [SamplingParams(seed=s).make_generator()])[0] for s in range(200)}
    assert many == {0, 1, 2, 3, 4}  # a flat distribution reaches every token
    greedy = SamplingParams()
    assert sample(logits, [greedy, hot], [None, hot.make_generator()])[0] == 1


def test_seeded_requests_reproduce_in_any_batch(tiny_engine):
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = tiny_engine.generate([PROMPTS[2]], sp)[0].token_ids
    batch = tiny_engine.generate([PROMPTS[0], PROMPTS[2]], sp)
    assert batch[1].token_ids == alone
    other = tiny_engine.generate([PROMPTS[2]], max_tokens=20, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True)
    assert other[0].token_ids != alone


def test_stop_tokens_and_lengths(tiny_engine):
    ref = tiny_engine.generate([PROMPTS[5]], max_tokens=10, ignore_eos=True)[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 10
    stop = ref.token_ids[3]
    cut = tiny_engine.generate([PROMPTS[5]], max_tokens=10, stop_token_ids=[stop], ignore_eos=True)[0]
    assert cut.finish_reason == "stop" and cut.token_ids == ref.token_ids[: ref.token_ids.index(stop) + 1]
    assert cut.prompt_len == len(PROMPTS[5])


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2}])
def test_bad_sampling_fields_are_request_errors(tiny_engine, bad):
    with pytest.raises(RequestError):
        tiny_engine.generate([PROMPTS[0]], **bad)


# ------------------------------------------------------------ streaming
def test_async_streams_and_cancel(tiny_engine):
    expected = [g.token_ids for g in tiny_engine.generate(PROMPTS[:3], max_tokens=12, ignore_eos=True)]

    async def collect(p, limit=None):
        out = []
        async for tok in tiny_engine.stream(p, max_tokens=12, ignore_eos=True):
            out.append(tok)
            if limit and len(out) == limit:
                break  # leaving early cancels the request
        return out

    async def main():
        return await asyncio.gather(*(collect(p) for p in PROMPTS[:3]), collect(PROMPTS[4], limit=2))

    got = asyncio.run(main())
    assert got[:3] == expected and len(got[3]) == 2
    events = []
    rid = tiny_engine.submit(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True),
                             lambda *e: events.append(e))
    tiny_engine.cancel(rid)
    deadline = threading.Event()
    for _ in range(200):
        if events and events[-1][1]:
            break
        deadline.wait(0.05)
    assert events[-1] == (None, True, "cancelled")
    for _ in range(100):  # the loop frees the cancelled and early-exited requests' blocks
        if tiny_engine.blocks.num_free_blocks == tiny_engine.blocks.num_blocks:
            break
        deadline.wait(0.05)
    assert tiny_engine.blocks.num_free_blocks == tiny_engine.blocks.num_blocks


# ------------------------------------------------------- directories/input
def test_bad_requests_are_rejected_before_running(tiny_dir, tiny_engine):
    with pytest.raises(RequestError, match="empty"):
        tiny_engine.generate([[]])
    with pytest.raises(RequestError, match=r"\[0, 512\)"):
        tiny_engine.generate([[1, 600]])
    with pytest.raises(RequestError, match="max_seq_len"):
        tiny_engine.generate([[1] * 1000], max_tokens=100)
    small = Engine.from_dir(tiny_dir, num_blocks=2, block_size=4)
    with pytest.raises(RequestError, match="KV blocks"):
        small.generate([[1, 2, 3]], max_tokens=20)
    with pytest.raises(InputError, match="tokenizer"):
        small.generate(["text needs a tokenizer"])
    small.shutdown()


def test_engine_json_cuda_graphs_setting(tmp_path):
    assert read_settings(tmp_path).cuda_graphs  # no engine.json: on
    (tmp_path / "engine.json").write_text(json.dumps({"cuda_graphs": False}))
    assert read_settings(tmp_path).cuda_graphs is False
    (tmp_path / "engine.json").write_text(json.dumps({"cuda_graphs": "yes"}))
    with pytest.raises(InputError, match="cuda_graphs must be true or false"):
        read_settings(tmp_path)


def test_batch_invariant_setting_from_recipe_to_engine(tiny_dir, tmp_path):
    """build.batch_invariant -> engine.json -> Engine: unset means on for a CPU engine."""
    import shutil

    from recipes.schema import BuildSection

    assert BuildSection().batch_invariant is None and BuildSection(batch_invariant=False).batch_invariant is False
    for f in tiny_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    for setting, want in ((None, True), (False, False), (True, True)):
        (tmp_path / "engine.json").write_text(json.dumps({"batch_invariant": setting}))
        eng = Engine.from_dir(tmp_path, num_blocks=8)
        try:
            assert eng.stats.batch_invariant is want and (eng.stats.attention == "batch-invariant") is want
        finally:
            eng.shutdown()
    if not torch.cuda.is_available():  # the mode does not hide a request for kernels the device lacks
        from runtime.errors import UnsupportedError

        with pytest.raises(UnsupportedError, match="needs a CUDA device"):
            Engine.from_dir(tmp_path, num_blocks=8, attention="triton")
    (tmp_path / "engine.json").write_text(json.dumps({"batch_invariant": "on"}))
    with pytest.raises(InputError, match="batch_invariant must be true or false"):
        read_settings(tmp_path)


def test_engine_directory_files_are_read(tiny_dir, tmp_path):
    cfg = ModelConfig.from_dir(tiny_dir)
    for f in tiny_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "kv_format.json").write_text(json.dumps({"dtype": "int8", "granularity": "per_head", "symmetric": True, "scale_dtype": "float16"}))
    (tmp_path / "engine.json").write_text(json.dumps({"max_batch_size": 3, "max_input_len": 64, "max_seq_len": 200, "block_size": 4, "gpu_memory_fraction": 0.5}))
    with pytest.raises(InputError, match="kv_scales.safetensors"):
        Engine.from_dir(tmp_path)
    save_file({"k_scale": torch.full((cfg.num_layers,), 0.1), "v_scale": torch.full((cfg.num_layers,), 0.1)},
              str(tmp_path / "kv_scales.safetensors"))
    with pytest.raises(InputError, match=r"per_head needs \[2, 2\]"):
        Engine.from_dir(tmp_path)
    save_file({"k_scale": torch.full((2, 2), 0.05), "v_scale": torch.full((2, 2), 0.05)}, str(tmp_path / "kv_scales.safetensors"))
    eng = Engine.from_dir(tmp_path, memory_budget=100_000)
    try:
        assert eng.stats.kv_format == "int8-per_head" and eng.scheduler.max_batch_size == 3
        assert eng.max_seq_len == 200 and eng.stats.block_size == 4
        bpt = kv_bytes_per_token(cfg, KVFormat("int8", "per_head"))
        assert eng.stats.pool_blocks == 100_000 // (4 * bpt) and eng.stats.kv_bytes_per_token == bpt
        assert eng.stats.pool_bytes == eng.stats.pool_tokens * bpt
        # Planned bytes (the planner's function) equal what was allocated, scale metadata included.
        assert eng.stats.pool_allocated_bytes == eng.stats.pool_bytes
        assert len(eng.generate(PROMPTS[:4], max_tokens=6)[3].token_ids) <= 6
        with pytest.raises(RequestError, match="max_input_len"):
            eng.generate([[5] * 65], max_tokens=1)
        assert max(eng.stats.step_batch_sizes) <= 3
    finally:
        eng.shutdown()
    (tmp_path / "kv_format.json").write_text(json.dumps({"dtype": "int3"}))
    with pytest.raises(InputError, match="int3"):
        Engine.from_dir(tmp_path)


def test_synthetic_directory_runs_token_ids(tmp_path):
    cfg = PRESETS["tiny-llama3"]
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    (tmp_path / "synthetic.json").write_text(json.dumps({"seed": 3}))
    a = Engine.from_dir(tmp_path, num_blocks=16)
    b = Engine.from_dir(tmp_path, num_blocks=16)
    try:
        assert a.tokenizer is None
        # the embedding table: matmul weights are opaque oneDNN-packed tensors on the CPU (batch_invariant.pack_weight)
        emb_a, emb_b = a.model.embed_tokens, b.model.embed_tokens
        assert torch.equal(emb_a, emb_b) and float(emb_a.std()) == pytest.approx(0.02, rel=0.1)
        assert a.generate([[1, 2, 3]], max_tokens=5)[0].token_ids == b.generate([[1, 2, 3]], max_tokens=5)[0].token_ids
    finally:
        a.shutdown()
        b.shutdown()


def test_pool_plan_from_budget_uses_the_planner_function():
    cfg = PRESETS["llama3-70b"]
    fmt = KVFormat("fp8_e4m3", "per_tensor")
    plan = plan_pool(cfg, fmt, 16, memory_budget=40 * 2**30)
    assert plan.bytes_per_token == 2 * 80 * 8 * 128  # 160 KiB per token at one byte per element
    assert plan.num_blocks == 40 * 2**30 // (16 * 160 * 1024)
    with pytest.raises(InputError, match="no block"):
        plan_pool(cfg, fmt, 16, memory_budget=1000)


# ----------------------------------------------------- SmolLM2, all formats
FORMATS = [KVFormat("fp16"), KVFormat("bf16")] + [
    KVFormat(d, g) for d in ("fp8_e4m3", "fp8_e5m2", "int8", "int4") for g in ("per_tensor", "per_head", "per_token")
] + [KVFormat("int8", "per_token", False), KVFormat("int4", "per_token", False)]


@pytest.fixture(scope="module")
def smol_model(tmp_path_factory):
    eng = Engine.from_dir(smollm2_dir(tmp_path_factory), num_blocks=64)
    yield eng
    eng.shutdown()


def _amax_per_head(model, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Max-policy calibration on real text: per layer, per KV head amax of K (after RoPE) and V."""
    cfg = model.cfg
    k_amax = torch.zeros(cfg.num_layers, cfg.num_kv_heads)
    v_amax = torch.zeros(cfg.num_layers, cfg.num_kv_heads)

    def observe(i, k, v):
        k_amax[i] = torch.maximum(k_amax[i], k.abs().amax(dim=(0, 2)))
        v_amax[i] = torch.maximum(v_amax[i], v.abs().amax(dim=(0, 2)))

    ids = torch.tensor(tokenizer(sample_text()).input_ids[:512])
    model.forward_dense(ids, observer=observe)
    return k_amax, v_amax


@pytest.mark.slow
def test_smollm2_every_kv_format_generates_sensibly(smol_model):
    """Every KV format generates text, and teacher-forced on the unquantized engine's greedy continuations (so one
    early flip does not count for every later token) picks the same next token at least `floor` of the time."""
    base = smol_model
    prompts = [chat_prompt_ids(base.tokenizer, q) for q in CHAT_QUESTIONS[:2]]
    ref = base.generate(prompts, max_tokens=16)
    k_amax, v_amax = _amax_per_head(base.model, base.tokenizer)
    agreement = {}
    for fmt in FORMATS:
        k_s = v_s = None
        if fmt.static:
            k_a, v_a = (k_amax.amax(dim=1), v_amax.amax(dim=1)) if fmt.granularity == "per_tensor" else (k_amax, v_amax)
            k_s, v_s = static_scale_from_amax(k_a, fmt), static_scale_from_amax(v_a, fmt)
        plan = plan_pool(base.cfg, fmt, 16, num_blocks=32)
        eng = Engine(base.model, fmt, plan, k_s, v_s, tokenizer=base.tokenizer)
        try:
            out = eng.generate(prompts, max_tokens=16)
            seqs = [p + r.token_ids for p, r in zip(prompts, ref)]
            scores = eng.score(seqs, start=[len(p) for p in prompts])
        finally:
            eng.shutdown()
        assert all(o.text.strip() for o in out), fmt.name
        same = sum(int(sc.matches(q).sum()) for sc, q in zip(scores, seqs))
        agreement[fmt.name] = same / sum(len(r.token_ids) for r in ref)
        # e5m2 keeps 2 mantissa bits (rounding error up to 2^-3), as coarse as the 4-bit codes
        coarse = fmt.bits == 4 or fmt.dtype == "fp8_e5m2"
        floor = 0.99 if fmt.bits >= 16 else 0.5 if coarse else 0.8
        assert agreement[fmt.name] >= floor, (fmt.name, agreement)
    print("teacher-forced greedy agreement with unquantized KV:", json.dumps(agreement, indent=1))


@pytest.mark.parametrize("fmt", [KVFormat("int4", "per_token", False, "float16"), KVFormat("fp8_e5m2", "per_token", True, "float32")],
                         ids=lambda f: f"{f.name}-{f.scale_dtype}")
def test_planned_pool_bytes_equal_allocated_with_metadata(tiny_dir, fmt):
    eng = Engine.from_dir(tiny_dir, kv_format=fmt, num_blocks=8, block_size=4)
    try:
        assert eng.stats.pool_allocated_bytes == eng.stats.pool_bytes == 8 * 4 * eng.stats.kv_bytes_per_token
    finally:
        eng.shutdown()


def test_nan_weights_fail_the_request_with_a_clear_error_and_the_loop_survives(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    from runtime.errors import NumericsError

    tensors = load_file(str(tiny_dir / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    eng = Engine.from_dir(tmp_path, num_blocks=16)
    try:
        with pytest.raises(NumericsError, match="NaN"):
            eng.generate([[1, 2, 3]], max_tokens=4)
        with pytest.raises(NumericsError):  # the step loop is still serving
            eng.generate([[4, 5]], max_tokens=2)
    finally:
        eng.shutdown()


def test_a_raising_callback_cancels_only_its_own_request(tiny_engine):
    def bad(tok, finished, reason):
        raise RuntimeError("client went away")

    tiny_engine.submit(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), bad)
    out = tiny_engine.generate([PROMPTS[1]], max_tokens=6, ignore_eos=True)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_kv_format_names_round_trip():
    from runtime.engine_dir import parse_kv_format_name

    for fmt in FORMATS + [KVFormat("fp32")]:
        assert parse_kv_format_name(fmt.name) == fmt
    with pytest.raises(InputError, match="int9"):
        parse_kv_format_name("int9-per_token")
    with pytest.raises(InputError, match="asymmetric"):
        parse_kv_format_name("fp8_e4m3-per_tensor-asym")


def test_scheduler_preempts_the_newest_and_recomputes_it_first():
    from runtime.block_manager import BlockManager
    from runtime.scheduler import Scheduler, Sequence

    sp = SamplingParams(max_tokens=20)
    sched = Scheduler(BlockManager(num_blocks=3, block_size=4), max_batch_size=8, max_tokens_per_step=64)
    old, big = Sequence(0, [1, 2, 3, 4], sp), Sequence(1, list(range(8)), sp)
    sched.add(old)
    sched.add(big)
    step = sched.schedule()
    # big fits the 2 free blocks, but then none would stay free for old's next token: it waits.
    assert step.prefill == [old] and list(sched.waiting) == [big]
    sched.finish(old, "stop")
    assert sched.schedule().prefill == [big]

    crowd = Scheduler(BlockManager(num_blocks=2, block_size=2), max_batch_size=8, max_tokens_per_step=64)
    a, b = Sequence(3, [1], sp), Sequence(4, [2], sp)
    crowd.watermark_blocks = 0
    crowd.add(a)
    crowd.add(b)
    crowd.schedule()  # both prefilled, one block each
    a.output_ids.append(7)
    b.output_ids.append(8)
    crowd.schedule()  # both grow to 2 tokens: their blocks are full
    a.output_ids.append(7)
    b.output_ids.append(8)
    step = crowd.schedule()  # a needs a new block: b (newest) is preempted, keeps its tokens
    assert step.decode == [a] and crowd.num_preemptions == 1 and b.preemptions == 1
    assert list(crowd.waiting) == [b] and b.token_ids == [2, 8, 8]
    crowd.finish(a, "length")
    step = crowd.schedule()
    assert step.prefill == [b]  # recomputed from prompt + generated tokens


def test_scheduler_chunks_a_long_prompt_while_others_decode():
    from runtime.block_manager import BlockManager
    from runtime.scheduler import Scheduler, Sequence

    sp = SamplingParams(max_tokens=20)
    sched = Scheduler(BlockManager(num_blocks=16, block_size=4), max_batch_size=8, max_tokens_per_step=8)
    short, long_ = Sequence(0, [1, 2, 3], sp), Sequence(1, list(range(20)), sp)
    sched.add(short)
    sched.add(long_)
    step = sched.schedule()  # short whole, then long's first 5 tokens: the budget of 8
    assert step.prefill == [short, long_] and step.spans == [(0, 3), (0, 5)]
    assert step.sampled == [short] and step.num_tokens == 8
    assert sched.blocks.num_tokens(long_.request_id) == 20  # the whole prompt's blocks from admission
    short.output_ids.append(9)
    spans = []
    for _ in range(3):  # short decodes every step; long continues with the 7 tokens left each time
        step = sched.schedule()
        assert step.decode == [short] and step.prefill == [long_]
        spans += step.spans
        short.output_ids.append(9)
        if step.sampled == [short, long_]:
            break
    assert spans == [(5, 12), (12, 19), (19, 20)] and not long_.prefilling
    long_.output_ids.append(9)
    assert sched.schedule().decode == [short, long_]


def test_a_decode_preempts_a_newer_chunked_prefill():
    """A sequence halfway through a chunked prefill holds its whole prompt's blocks; when an older
    decoding sequence needs a block, the newer chunked one gives them back and starts over."""
    from runtime.block_manager import BlockManager
    from runtime.scheduler import Scheduler, Sequence

    sp = SamplingParams(max_tokens=20)
    sched = Scheduler(BlockManager(num_blocks=4, block_size=4), max_batch_size=8, max_tokens_per_step=6)
    sched.watermark_blocks = 0
    old, long_ = Sequence(0, [1, 2, 3, 4], sp), Sequence(1, list(range(12)), sp)
    sched.add(old)
    sched.add(long_)
    assert sched.schedule().spans == [(0, 4), (0, 2)]  # old whole, long's first chunk: all 4 blocks taken
    old.output_ids.append(9)  # old's 5th token needs a fifth block
    step = sched.schedule()
    assert step.decode == [old] and long_.preemptions == 1 and long_.num_computed == 0
    assert list(sched.waiting) == [long_] and sched.blocks.num_free_blocks == 2


def test_chunked_prefill_equals_whole_prefill(tiny_dir):
    """Prompts of 40 and 26 tokens in steps of at most 7 tokens: with an fp32 cache the chunks
    see exactly the K/V a whole prefill computes, so greedy output is the same; with int8 KV the
    chunks read their context quantized (as decode does) and the engine still finishes them."""
    prompts = [PROMPTS[3], PROMPTS[5], PROMPTS[0]]
    whole = Engine.from_dir(tiny_dir, num_blocks=64, block_size=8, kv_format="fp32", attention="reference")
    chunked = Engine.from_dir(tiny_dir, num_blocks=64, block_size=8, kv_format="fp32", attention="reference",
                              max_tokens_per_step=7)
    try:
        want = [g.token_ids for g in whole.generate(prompts, max_tokens=8, ignore_eos=True)]
        got = [g.token_ids for g in chunked.generate(prompts, max_tokens=8, ignore_eos=True)]
        assert max(chunked.stats.step_num_tokens) <= 7 and chunked.stats.prompt_tokens == sum(map(len, prompts))
    finally:
        whole.shutdown()
        chunked.shutdown()
    assert got == want
    int8 = Engine.from_dir(tiny_dir, num_blocks=64, block_size=8, kv_format="int8-per_token",
                           attention="reference", max_tokens_per_step=7)
    try:
        outs = int8.generate(prompts, max_tokens=8, ignore_eos=True)
    finally:
        int8.shutdown()
    assert [len(g.token_ids) for g in outs] == [8, 8, 8]


def test_a_dying_step_loop_fails_callers_instead_of_hanging(tiny_dir, monkeypatch):
    from runtime.errors import KvqError

    eng = Engine.from_dir(tiny_dir, num_blocks=8)

    def broken(seq):
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(eng.scheduler, "add", broken)
    with pytest.raises(KvqError, match="step loop died"):
        eng.generate([[1, 2]], max_tokens=2)
    with pytest.raises(RequestError, match="shut down"):
        eng.submit([1, 2])
    eng.shutdown()
