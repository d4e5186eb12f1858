"""Decode bursts (runtime/decode_burst.py): greedy steps whose tokens stay on the device for several steps
give exactly the tokens of the one-step-at-a-time path, stop where it stops, free what it frees, and leave
sampled / penalized / log-prob requests to the ordinary step."""

from __future__ import annotations

import pytest
import torch
from helpers_runtime import smollm2_dir, tiny_llama_dir

from runtime.decode_burst import DecodeBurst
from runtime.engine import Engine
from runtime.errors import InputError, UnsupportedError
from runtime.sampling import SamplingParams

PROMPTS = [[(7 * i + 13 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([3, 17, 5, 40, 9, 26, 1, 12])]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory)


def _generate(d, prompts, burst_steps, **kw):
    eng = Engine.from_dir(d, num_blocks=kw.pop("num_blocks", 128), block_size=8, burst_steps=burst_steps,
                          max_batch_size=kw.pop("max_batch_size", 8), **kw.pop("engine", {}))
    runs = []
    if eng.steps.burst is not None:  # count the bursts' steps, so a test knows
        burst = eng.steps.burst
        launch = burst.launch
        burst.launch = lambda *a: runs.append(a[3]) or launch(*a)
    try:
        outs = eng.generate(prompts, SamplingParams(**kw))
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks  # every page came back
        return [g.token_ids for g in outs], [g.finish_reason for g in outs], runs, eng.stats
    finally:
        eng.shutdown()


@pytest.mark.parametrize("burst_steps", [1, 4, 7])
def test_bursts_give_the_tokens_of_single_steps(tiny_dir, burst_steps):
    legacy, reasons, _, _ = _generate(tiny_dir, PROMPTS, 0, max_tokens=19, ignore_eos=True)
    burst, burst_reasons, runs, stats = _generate(tiny_dir, PROMPTS, burst_steps, max_tokens=19, ignore_eos=True)
    assert burst == legacy and burst_reasons == reasons == ["length"] * len(PROMPTS)
    # every decode step after the prefill ran in bursts, the last one cut to the tokens left
    assert sum(runs) == 18 and max(runs) == burst_steps and stats.generated_tokens == 19 * len(PROMPTS)


def test_a_stop_inside_a_burst_drops_the_tokens_after_it(tiny_dir):
    legacy, _, _, _ = _generate(tiny_dir, PROMPTS[:3], 0, max_tokens=12, ignore_eos=True)
    stop = legacy[1][5]  # the 6th token of the second prompt ends it (and any other that reaches it first)
    want, want_reasons, _, _ = _generate(tiny_dir, PROMPTS[:3], 0, max_tokens=12, stop_token_ids=[stop])
    got, reasons, runs, _ = _generate(tiny_dir, PROMPTS[:3], 8, max_tokens=12, stop_token_ids=[stop])
    assert got == want and reasons == want_reasons and "stop" in reasons and runs
    assert got[1][-1] == stop and len(got[1]) <= 6


def test_preemption_and_a_small_pool_fall_back_to_single_steps(tiny_dir):
    # 14 blocks of 8 tokens for 8 prompts of up to 40 + 24 tokens: bursts where pages allow, preemption otherwise
    want, _, _, want_stats = _generate(tiny_dir, PROMPTS, 0, max_tokens=24, ignore_eos=True, num_blocks=14)
    got, _, runs, stats = _generate(tiny_dir, PROMPTS, 6, max_tokens=24, ignore_eos=True, num_blocks=14)
    assert got == want and runs and want_stats.preemptions > 0


def test_sampled_and_penalized_requests_take_the_ordinary_step(tiny_dir):
    kw = dict(max_tokens=9, temperature=0.8, seed=3)
    want, _, _, _ = _generate(tiny_dir, PROMPTS[:2], 0, **kw)
    got, _, runs, _ = _generate(tiny_dir, PROMPTS[:2], 4, **kw)
    assert got == want and not runs
    got, _, runs, _ = _generate(tiny_dir, PROMPTS[:2], 4, max_tokens=9, repetition_penalty=1.3)
    assert got == _generate(tiny_dir, PROMPTS[:2], 0, max_tokens=9, repetition_penalty=1.3)[0] and not runs


def test_engine_json_sets_bursts(tiny_dir, tmp_path):
    import json
    import shutil

    d = tmp_path / "engine"
    shutil.copytree(tiny_dir, d)
    (d / "engine.json").write_text(json.dumps({"burst_steps": 3}))
    eng = Engine.from_dir(d, num_blocks=8)
    try:
        assert eng.stats.burst_steps == 3 and eng.steps.burst.steps == 3
    finally:
        eng.shutdown()
    (d / "engine.json").write_text(json.dumps({"burst_steps": "8"}))
    with pytest.raises(InputError, match="burst_steps must be an integer"):
        Engine.from_dir(d, num_blocks=8)
    (d / "engine.json").write_text(json.dumps({"fused_ops": True}))
    with pytest.raises(InputError, match="fused_ops=True runs Triton kernels and needs a CUDA device"):
        Engine.from_dir(d, device="cpu", num_blocks=8, batch_invariant=False)


def test_defaults_burst_and_fuse_on_one_gpu_only(tiny_dir):
    """Without engine.json settings: a CPU engine steps one host round trip at a time with torch's ops; a CUDA
    engine runs DEFAULT_BURST_STEPS-step bursts through the fused small ops (not in the batch-invariant mode)."""
    from runtime.decode_burst import DEFAULT_BURST_STEPS

    eng = Engine.from_dir(tiny_dir, device="cpu", num_blocks=8)
    try:
        assert eng.stats.burst_steps == 0 and eng.steps.burst is None and eng.stats.fused_ops is False
    finally:
        eng.shutdown()
    if not torch.cuda.is_available():
        return
    for invariant in (False, True):
        try:
            eng = Engine.from_dir(tiny_dir, device="cuda", dtype="bfloat16", num_blocks=8, batch_invariant=invariant)
        except UnsupportedError:  # the batch-invariant mode measured that this GPU's GEMMs cannot serve it
            assert invariant
            continue
        try:
            assert eng.stats.burst_steps == DEFAULT_BURST_STEPS and eng.stats.fused_ops is (not invariant)
        finally:
            eng.shutdown()


def test_burst_steps_is_checked(tiny_dir):
    with pytest.raises(InputError, match="burst_steps"):
        Engine.from_dir(tiny_dir, num_blocks=8, burst_steps=-1)
    burst = Engine.from_dir(tiny_dir, num_blocks=8, burst_steps=2)
    try:
        with pytest.raises(ValueError, match="1..2 steps"):
            burst.steps.burst.run([1], [0], [[0]], 3)
        assert isinstance(burst.steps.burst, DecodeBurst) and burst.stats.burst_steps == 2
    finally:
        burst.shutdown()


@pytest.mark.slow
def test_smollm2_bursts_equal_single_steps(tmp_path_factory):
    engine = {"kv_format": "int4-per_token-asym", "batch_invariant": False}
    prompts = [PROMPTS[3], PROMPTS[5]]
    d = smollm2_dir(tmp_path_factory)
    want, _, _, _ = _generate(d, prompts, 0, max_tokens=10, ignore_eos=True, num_blocks=32, engine=engine)
    got, _, runs, _ = _generate(d, prompts, 4, max_tokens=10, ignore_eos=True, num_blocks=32, engine=engine)
    assert got == want and runs == [4, 4, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the fused small ops run on a GPU")
def test_on_the_gpu_bursts_and_fused_ops_give_the_legacy_tokens(tiny_dir):
    """Captured bursts (padded buckets, fitted table widths) and the fused small ops, against the legacy
    CUDA-graph step, on the Triton attention of every format family."""
    for fmt in ("bf16", "fp8_e4m3-per_tensor", "int4-per_token-asym"):
        engine = {"device": "cuda", "dtype": "bfloat16", "kv_format": fmt, "batch_invariant": False, "fused_ops": False}
        if fmt.startswith("fp8"):
            engine["kv_scales"] = {"k_scale": torch.full((2,), 0.02), "v_scale": torch.full((2,), 0.02)}
        want, _, _, _ = _generate(tiny_dir, PROMPTS, 0, max_tokens=20, ignore_eos=True, engine=engine)
        got, _, runs, _ = _generate(tiny_dir, PROMPTS, 8, max_tokens=20, ignore_eos=True, engine=engine)
        assert got == want and sum(runs) == 19, fmt
        fused, _, runs, _ = _generate(tiny_dir, PROMPTS, 8, max_tokens=20, ignore_eos=True,
                                      engine={**engine, "fused_ops": True})
        assert fused == want and sum(runs) == 19, fmt  # the fused ops give the unfused ops' bits


@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_token"])
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_a_bursts_table_runs_the_legacy_steps_decode_kernels(dtype, granularity):
    """The H200's plans at Llama-3-8B's geometry (32 query heads over 8 KV heads of 128, pages of 64, a 131072-token
    engine): the block table a burst runs takes the decode kernels of the legacy step's full table, so one split that
    holds a whole context sums it in the same order. Static fp8's fitted tables of few sequences took Triton's 4-warp
    tile where the full table takes Gluon, and the profile's fused step gave other tokens than the legacy one."""
    from helpers_kernels import CUDA  # noqa: F401  (the interpreter where no GPU runs the kernels)

    from runtime.decode_burst import decode_kernels, kernel_width, table_width
    from runtime.kernels.tuned_file import DEVICE_H200
    from runtime.kv_format import format_from_name

    fmt = format_from_name(f"{dtype}-{granularity}")
    max_blocks = 131072 // 64
    switched = 0
    for size in (1, 2, 4, 16, 64):
        kernels = decode_kernels([(fmt, 8, 64)] * 2, size, 32, 128, torch.bfloat16, DEVICE_H200)
        for ctx in (37, 200, 1000, 8192, 40000):
            fitted = table_width(ctx + 8, 64, max_blocks)
            width = kernel_width(fitted, max_blocks, kernels)
            assert kernels(width) == kernels(max_blocks), (size, ctx)
            assert width in (fitted, max_blocks)
            switched += width != fitted
    # the static formats are the ones whose narrow tables switch kernel (the per-token ones stay on Gluon)
    assert (switched > 0) == (granularity != "per_token")


def test_streamed_tokens_of_bursts_are_the_single_steps(tiny_dir):
    """Token callbacks under bursts (sequences that cannot stop inside a burst take its tokens at once, the others one
    by one): every request streams the single steps' tokens, done flags and finish reason, a stop token and a
    max_tokens cut inside a burst included."""
    import threading

    legacy, _, _, _ = _generate(tiny_dir, PROMPTS[:4], 0, max_tokens=13, ignore_eos=True)
    stop = legacy[2][6]

    def stream(burst_steps):
        eng = Engine.from_dir(tiny_dir, num_blocks=128, block_size=8, burst_steps=burst_steps, max_batch_size=8)
        events, done = {i: [] for i in range(4)}, threading.Semaphore(0)
        # the first two stop only at max_tokens (13: not a multiple of the burst), the others also at `stop`
        limits = [SamplingParams(max_tokens=13, ignore_eos=True)] * 2 + [
            SamplingParams(max_tokens=13, ignore_eos=True, stop_token_ids=[stop])] * 2

        def callback(i):
            return lambda tok, fin, reason: events[i].append((tok, fin, reason)) or (fin and done.release())
        try:
            with eng._run_lock:  # all four admitted before the first step
                for i in range(4):
                    eng.submit(PROMPTS[i], limits[i], callback(i))
            for _ in range(4):
                assert done.acquire(timeout=120)
            assert burst_steps == 0 or eng.steps.burst.steps_run > 0
        finally:
            eng.shutdown()
        return events

    want = stream(0)
    got = stream(4)
    assert got == want
    assert want[2][-1] == (stop, True, "stop") and len(want[0]) == 13 and want[0][-1][1:] == (True, "length")
