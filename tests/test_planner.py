"""Memory planner: Llama-70B's figures (320 KiB of FP16 KV a token, 2.5 GiB an 8k request), from first principles."""

from __future__ import annotations

import json

import pytest

from builder.cli import main
from builder.planner import make_plan, parse_bytes
from recipes import load_recipe
from runtime.config import PRESETS
from runtime.kv_format import KVFormat, kv_bytes_per_token

GiB, KiB = 2**30, 2**10


def test_seed_figures_for_llama70b():
    # 80 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes = 327,680 B = 320 KiB.
    cfg = PRESETS["llama3-70b"]
    fp16 = kv_bytes_per_token(cfg, KVFormat("fp16"))
    assert fp16 == 80 * 8 * 128 * 2 * 2 == 320 * KiB
    assert fp16 * 8192 / GiB == pytest.approx(2.5)
    assert fp16 * 131072 / GiB == pytest.approx(40.0)
    assert kv_bytes_per_token(cfg, KVFormat("fp8_e4m3")) * 8192 / GiB == pytest.approx(1.25)


def test_scale_metadata_and_parallelism_in_bytes_per_token():
    cfg = PRESETS["llama3-70b"]
    # one fp16 scale per token-head adds 2 bytes per 128 int8 bytes
    assert kv_bytes_per_token(cfg, KVFormat("int8", "per_token")) == 80 * 8 * 2 * (128 + 2)
    # int4 asymmetric: 64 bytes of nibbles + fp16 scale + fp16 zero point
    assert kv_bytes_per_token(cfg, KVFormat("int4", "per_token", symmetric=False)) == 80 * 8 * 2 * (64 + 4)
    # TP shards KV heads; beyond 8 ranks they are replicated (one head per rank)
    assert kv_bytes_per_token(cfg, KVFormat("fp16"), tp=2) == 80 * 4 * 128 * 2 * 2
    assert kv_bytes_per_token(cfg, KVFormat("fp16"), tp=16) == 80 * 1 * 128 * 2 * 2
    # PP: the most loaded stage holds ceil(80/3) = 27 layers
    assert kv_bytes_per_token(cfg, KVFormat("fp16"), pp=3) == 27 * 8 * 128 * 2 * 2


def test_plan_concurrency_follows_from_pool_and_bytes():
    r = load_recipe("llama70b-fp8kv")
    plan = make_plan(r, contexts=[8192], gpu_memory=parse_bytes("141GB"))
    params = PRESETS["llama3-70b"].num_parameters
    assert plan.weights_bytes_per_gpu == pytest.approx(params * 2 / 2, rel=1e-9)  # bf16, TP2
    pool = int(141e9 * 0.9) - plan.weights_bytes_per_gpu - 4 * GiB
    rows = {f.format: f for f in plan.formats}
    fp16, fp8, int4 = rows["fp16"], rows["fp8_e4m3-per_tensor"], rows["int4-per_token-asym"]
    assert fp16.pool_tokens == pool // (160 * KiB)
    assert fp16.max_concurrency[8192] == fp16.pool_tokens // 8192
    assert fp8.recipe_format and fp8.max_concurrency[8192] in (2 * fp16.max_concurrency[8192],
                                                              2 * fp16.max_concurrency[8192] + 1)
    assert int4.capacity_vs_baseline == pytest.approx(512 / 136)


def test_per_channel_keys_residual_takes_one_block_per_resident_request():
    """smollm2-135m-int4kv on a pool of a few thousand tokens: each request costs its tokens and one fp16 key
    block per layer (30 x 3 heads x 64 x 64 x 2 bytes), for at most max_batch_size (8) requests: the largest n
    with n * (c * bytes/token) + min(n, 8) * residual <= pool, computed here from the geometry."""
    r = load_recipe("smollm2-135m-int4kv")
    plan = make_plan(r, contexts=[160, 2048], gpu_memory=parse_bytes("0.61GB"), reserve=0)
    rows = {f.format: f for f in plan.formats}
    mine, fp16 = next(f for f in plan.formats if f.recipe_format), rows["fp16"]
    cfg = PRESETS["smollm2-135m"]
    one = cfg.num_layers * cfg.num_kv_heads * 64 * cfg.head_dim * 2
    bpt = cfg.num_layers * cfg.num_kv_heads * 2 * (cfg.head_dim / 2 + 4)  # 4-bit codes + 4 bytes of scales
    assert mine.bytes_per_token_per_gpu == bpt
    pool = plan.pool_bytes_per_gpu
    for c in (160, 2048):
        n = max(k for k in range(0, 10**5) if k * c * bpt + min(k, 8) * one <= pool)
        assert mine.max_concurrency[c] == n, c
    n160 = mine.max_concurrency[160]
    assert 0 < n160 < 8 and fp16.max_concurrency[160] < n160
    assert mine.pool_tokens == int((pool - n160 * one) // bpt)
    # sizing the residual for all 8 sequences would leave room for fewer requests
    assert n160 > int((pool - 8 * one) // bpt) // 160


def test_parse_bytes_units():
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("1.5 MiB") == int(1.5 * 2**20)


def test_plan_cli_prints_table_and_json(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--recipe", "llama70b-fp8kv", "--context", "8192,131072", "--json"])
        raise SystemExit(0)
    assert e.value.code in (0, None)
    data = json.loads(capsys.readouterr().out)
    fp16 = next(f for f in data["formats"] if f["format"] == "fp16")
    assert fp16["kv_per_request_gib"]["8192"] == pytest.approx(2.5)
    assert fp16["kv_per_request_gib"]["131072"] == pytest.approx(40.0)
    with pytest.raises(SystemExit):
        main(["plan", "--recipe", "llama70b-fp8kv", "--gpus", "1"])
        raise SystemExit(0)
    out = capsys.readouterr().out
    assert "do not leave room" in out  # 141 GB of bf16 weights on one 141 GB GPU
