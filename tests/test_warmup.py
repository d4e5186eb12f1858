"""The engine's load-time warm-up (runtime/warmup.py): its shapes reach every bucket a step can meet, its
synthetic steps run through the real forward with the Triton kernels (the interpreter here) and leave the KV
pool as they found it, and an engine's tokens are the same after it. On the GPU, that serving then compiles
nothing: tests/test_engine_gpu.py."""

from __future__ import annotations

import types

import pytest
import torch
import triton
from helpers_runtime import tiny_llama_dir

from runtime import kernels, warmup
from runtime.attention import reference_backend
from runtime.engine import Engine
from runtime.kv_format import KVFormat

# the CUDA engine's ops, here under the interpreter (an engine on the CPU picks the reference ops)
TRITON_OPS = {name: getattr(kernels, name) for name in ("write_kv", "decode_attention", "prefill_context_attention")}


def test_chunk_counts_reach_every_chunk_lane_bucket():
    for max_batch in (1, 5, 16, 17, 100, 256, 300):
        counts = warmup.chunk_counts(max_batch)
        assert max(counts) == max_batch and min(counts) == 1
        lanes = lambda n: max(16, triton.next_power_of_2(n))  # noqa: E731 - the prefill launch's BLOCK_C
        assert {lanes(n) for n in counts} == {lanes(n) for n in range(1, max_batch + 1)}


def test_token_counts_cover_the_write_threshold_and_each_integer_class():
    counts = warmup.token_counts(2048, kv_heads=8)
    assert {127, 128, 129} & set(counts) == {128, 129}  # both sides of 16 * kv_heads
    assert {1, 16, 17, 2048} <= set(counts)  # ==1, a multiple of 16, other; the step's largest
    assert warmup.token_counts(8, kv_heads=8) == [1, 2, 8]  # never more than a step holds


def test_decode_shapes_span_batch_and_context_within_the_pool():
    shapes = warmup.decode_shapes(max_batch=256, max_seq_len=131072, pool_tokens=2_000_000)
    assert (1, 131072) in shapes and (256, 4097) in shapes  # one long sequence; a full batch at 4k
    assert all(b * c <= 2_000_000 for b, c in shapes) and (256, 131072) not in shapes
    assert {b for b, _ in shapes} == {1, 2, 4, 8, 16, 32, 64, 128, 256}


@pytest.mark.parametrize("fmt", [KVFormat("int8", "per_token"), KVFormat("bf16")], ids=lambda f: f.name)
def test_the_synthetic_steps_run_the_triton_forward_and_write_nothing(tmp_path_factory, fmt):
    d = tiny_llama_dir(tmp_path_factory)
    eng = Engine.from_dir(d, dtype="float32", kv_format=fmt, num_blocks=16, block_size=8, max_batch_size=3,
                          max_seq_len=40, max_tokens_per_step=24)
    backend = types.SimpleNamespace(**{**vars(reference_backend()), **TRITON_OPS})
    try:
        prompts = [[5, 9, 13, 2, 7], [3, 3, 8]]
        before = [g.token_ids for g in eng.generate(prompts, max_tokens=6, ignore_eos=True)]
        caches = eng.runner.caches
        pool = [t.clone() for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]
        seconds = warmup.warm_up(eng.model, caches, backend, max_batch=3, max_seq_len=40,
                                 max_tokens_per_step=24, pool_tokens=16 * 8)
        assert seconds > 0
        after = [t for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]
        assert all(torch.equal(a, b) for a, b in zip(pool, after))  # slot -1: nothing written
        assert [g.token_ids for g in eng.generate(prompts, max_tokens=6, ignore_eos=True)] == before
    finally:
        eng.shutdown()
