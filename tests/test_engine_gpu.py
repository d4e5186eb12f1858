"""The engine on CUDA: Triton kernels vs the reference path, GPU pool sizing, synthetic weights.

Runs only where a CUDA device exists (the GPU machine); CI on CPU covers the
same engine through the reference path in test_engine.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers_runtime import tiny_llama_dir

from runtime.config import PRESETS, ModelConfig
from runtime.engine import Engine
from runtime.kv_format import KVFormat
from runtime.kv_quant import static_scale_from_amax

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[(5 * i + 11 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([4, 33, 7, 61, 18, 2])]
FORMATS = [KVFormat("bf16")] + [
    KVFormat(d, g) for d in ("fp8_e4m3", "int8", "int4") for g in ("per_tensor", "per_head", "per_token")
] + [KVFormat("int4", "per_token", False)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_triton_backend_matches_reference_tokens(tmp_path_factory, fmt):
    d = tiny_llama_dir(tmp_path_factory)
    cfg = ModelConfig.from_dir(d)
    scales = None
    if fmt.static:
        shape = (cfg.num_layers,) if fmt.granularity == "per_tensor" else (cfg.num_layers, cfg.num_kv_heads)
        s = static_scale_from_amax(torch.full(shape, 6.0), fmt)
        scales = {"k_scale": s, "v_scale": s}
    outs = {}
    for attention in ("reference", "auto"):
        eng = Engine.from_dir(d, device="cuda", dtype="float32", kv_format=fmt, kv_scales=scales,
                              num_blocks=64, block_size=16, attention=attention)
        try:
            # the backend's name: its attention, then "+small_ops" where the step runs the fused ops (the default)
            assert eng.backend.name.startswith("reference" if attention == "reference" else "triton"), eng.backend.name
            outs[attention] = [g.token_ids for g in eng.generate(PROMPTS, max_tokens=24, ignore_eos=True)]
        finally:
            eng.shutdown()
    ref, tri = outs["reference"], outs["auto"]
    agree = sum(a == b for r, t in zip(ref, tri) for a, b in zip(r, t)) / sum(map(len, ref))
    assert agree >= 0.95, agree


def test_pool_sized_from_free_gpu_memory_with_synthetic_weights(tmp_path):
    cfg = PRESETS["llama3-8b"]
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict("bfloat16")))
    (tmp_path / "synthetic.json").write_text(json.dumps({"seed": 0}))
    (tmp_path / "engine.json").write_text(json.dumps({"max_batch_size": 16, "max_input_len": 512, "max_seq_len": 4096,
                                                      "block_size": 16, "gpu_memory_fraction": 0.5}))
    fmt = KVFormat("int8", "per_token")
    free_before, _ = torch.cuda.mem_get_info()
    eng = Engine.from_dir(tmp_path, kv_format=fmt)
    try:
        st = eng.stats
        assert st.pool_source == "gpu_free_memory" and st.dtype == "bfloat16"
        # Half of what was free after ~16 GB of weights: between a quarter and a half of the pre-load free memory.
        assert 0.2 * (free_before - st.weight_bytes) < st.pool_bytes <= 0.5 * free_before
        out = eng.generate([p for p in PROMPTS] * 2, max_tokens=8, ignore_eos=True)
        assert all(len(g.token_ids) == 8 for g in out) and max(st.step_batch_sizes) == 12
    finally:
        eng.shutdown()


@pytest.mark.parametrize("fmt", [KVFormat("fp32"), KVFormat("fp8_e4m3", "per_token"),
                                 KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False)],
                         ids=lambda f: f.name)
def test_chunked_prefill_on_cuda(tmp_path_factory, fmt):
    """Prompts prefilled in steps of at most 16 tokens through the Triton write kernel and the
    context attention. fp32 cache: the greedy output equals a whole prefill's. fp8 per-token, K8V4 (a mixed
    format: its context pages are read back unquantized for the same kernel): the chunks read their context quantized (a whole prefill does not), so the comparison is with
    the reference path chunked the same way, as closely as the two paths agree above."""
    d = tiny_llama_dir(tmp_path_factory)
    runs = [(None, "auto"), (16, "auto")] if fmt.dtype == "fp32" else [(16, "reference"), (16, "auto")]
    outs = []
    for step_tokens, attention in runs:
        eng = Engine.from_dir(d, device="cuda", dtype="float32", kv_format=fmt, num_blocks=64, block_size=16,
                              max_tokens_per_step=step_tokens, attention=attention)
        try:
            outs.append([g.token_ids for g in eng.generate(PROMPTS, max_tokens=24, ignore_eos=True)])
            if step_tokens:
                assert max(eng.stats.step_num_tokens) <= 16
        finally:
            eng.shutdown()
    first, chunked = outs
    if fmt.dtype == "fp32":
        assert chunked == first
    else:
        agree = sum(a == b for r, t in zip(first, chunked) for a, b in zip(r, t)) / sum(map(len, first))
        assert agree >= 0.95, agree


# (model dtype, head_dim, share of greedy choices kept): fp32 on the Triton kernel; fp16 at head_dim 128 on the Gluon
# kernel, where the reference engine's own decode keeps 97.9% of its fp16 prefill's greedy choices (this random
# model's near-ties; bf16: 94.5%)
@pytest.mark.parametrize("dtype,head_dim,kept", [("float32", None, 0.99), ("float16", 128, 0.9)])
def test_per_channel_keys_decode_on_the_kernel_on_cuda(tmp_path_factory, dtype, head_dim, kept):
    """k.int4-per_channel-asym on CUDA: decode through runtime/kernels/decode_channel_keys.py (fp32: the Triton
    kernel, whose dots are IEEE fp32; fp16 at head_dim 128: decode_channel_keys_gluon.py), the write through
    write_channel_keys.py with CUDA graphs for decode steps, chunked prefill on the reference op (and the backend
    says so), then with decode bursts (the default: 8 steps a burst, every step's residual slots planned before it).
    The graphs' tokens equal the eager kernels'; teacher-forced by the all-reference engine on the same GPU (its
    prefill applies the same position rule), `kept` of the graphs' and of the bursts' tokens are its greedy choice (a
    free-running comparison would count every token after one near-tie's flip as a miss)."""
    from runtime.kernels import decode_plan
    from runtime.kv_format import format_from_name

    d = tiny_llama_dir(tmp_path_factory, **({"head_dim": head_dim} if head_dim else {}))
    fmt = format_from_name("k.int4-per_channel-asym+v.int4-per_token-asym")
    if head_dim:
        plan = decode_plan(fmt, 4, 8, 2, 4096, "cuda", head_dim=head_dim, block_size=64, q_dtype=torch.float16)
        assert plan.kernel == "channel_keys_gluon"
    prompts = PROMPTS + [[(3 * j) % 500 + 3 for j in range(150)]]
    outs = {}
    for mode, graphs, bursts in (("eager", False, 0), ("graphs", True, 0), ("bursts", True, None)):
        eng = Engine.from_dir(d, device="cuda", dtype=dtype, kv_format=fmt, num_blocks=32, attention="triton",
                              batch_invariant=False, cuda_graphs=graphs, burst_steps=bursts)
        try:
            assert eng.stats.block_size == 64 and eng.stats.cuda_graphs == graphs
            assert eng.stats.burst_steps == (8 if bursts is None else 0), eng.stats.burst_steps
            assert "per-channel keys: chunked prefill reference" in eng.backend.name, eng.backend.name
            outs[mode] = [g.token_ids for g in eng.generate(prompts, max_tokens=80, ignore_eos=True)]
            if bursts is None:
                burst = eng.steps.burst
                assert burst.steps_run >= 40 and burst.failure is None, (burst.steps_run, burst.failure)
            elif graphs:
                assert eng.runner.graphs.failure is None and eng.runner.graphs._graphs, eng.runner.graphs.failure
            assert all(not c.residual.of_block for c in eng.runner.caches)  # every residual slot came back
        finally:
            eng.shutdown()
    assert outs["graphs"] == outs["eager"]
    ref = Engine.from_dir(d, device="cuda", dtype=dtype, kv_format=fmt, num_blocks=32, attention="reference",
                          batch_invariant=False, cuda_graphs=False)
    try:
        for mode in ("graphs", "bursts"):
            scores = ref.score([p + t for p, t in zip(prompts, outs[mode])], start=[len(p) for p in prompts])
            hits = torch.cat([sc.matches(p + t) for sc, p, t in zip(scores, prompts, outs[mode])])
            print(f"per-channel keys {dtype}, {mode}: {hits.float().mean():.3f} of the tokens are the reference's "
                  "greedy choice")
            assert hits.float().mean() >= kept, (mode, hits.float().mean())
    finally:
        ref.shutdown()


@pytest.mark.parametrize("fmt", [KVFormat("bf16"), KVFormat("fp8_e4m3", "per_token"), KVFormat("int4", "per_token", False)],
                         ids=lambda f: f.name)
def test_serving_compiles_no_kernel_after_the_warm_up(tmp_path_factory, fmt):
    """The load's warm-up (runtime/warmup.py) compiled every kernel a varied workload meets: waves of 1 to the
    engine's limit of prompts of 1 to 700 tokens (chunked by the step budget), decoding past a split."""
    import random

    from runtime import warmup

    d = tiny_llama_dir(tmp_path_factory)
    eng = Engine.from_dir(d, device="cuda", dtype="bfloat16", kv_format=fmt, num_blocks=1500, block_size=16,
                          max_batch_size=24, max_tokens_per_step=256)
    try:
        assert eng.stats.warm_up_s > 0 and eng.stats.cuda_graphs
        rng = random.Random(0)
        for n in (1, 5, 24, 17, 3, 24):
            prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 700))] for _ in range(n)]
            eng.generate(prompts, max_tokens=rng.randrange(2, 40), ignore_eos=True)
            assert eng.stats.serving_compiles == 0, (n, warmup.recent_compiles())
    finally:
        eng.shutdown()
