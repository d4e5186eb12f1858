"""kvq compare on small real engines: same budget, planner vs allocation, complete load runs, report files."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from builder.compare import EngineUnderTest, Workload, compare_engines
from runtime.config import PRESETS
from runtime.kv_format import KVFormat, kv_bytes_per_token

CFG = PRESETS["tiny-llama3"]
BUDGET = 32 * 1024  # fp16 fits 4 requests of 32 tokens, int8 7, int4 10


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> list[EngineUnderTest]:
    root = tmp_path_factory.mktemp("cmp")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CFG.to_hf_dict().items() if k != "dtype"}))
    base = root / "model"
    model.save_pretrained(base)
    out = []
    for label, fmt in (("fp16", KVFormat("fp16")), ("int8", KVFormat("int8", "per_token")),
                       ("int4", KVFormat("int4", "per_token", symmetric=False))):
        d = root / label
        d.mkdir()
        for f in base.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        (d / "kv_format.json").write_text(json.dumps(
            {"dtype": fmt.dtype, "granularity": fmt.granularity, "symmetric": fmt.symmetric}))
        (d / "engine.json").write_text(json.dumps({"max_batch_size": 16, "max_seq_len": 256, "block_size": 8}))
        out.append(EngineUnderTest(label, d, None))
    return out


def test_compare_reports_memory_throughput_and_plots(engines, tmp_path):
    wl = Workload(prompt_len=24, output_len=8, concurrency=[1, 4], num_requests=6, seed=0, memory_budget=BUDGET)
    res = compare_engines(engines, wl, "cpu", tmp_path, "test")
    report = json.loads((tmp_path / "report.json").read_text())
    rows = {r["label"]: r for r in report["engines"]}
    for label, fmt in (("fp16", KVFormat("fp16")), ("int8", KVFormat("int8", "per_token")),
                       ("int4", KVFormat("int4", "per_token", symmetric=False))):
        r = rows[label]
        bpt = kv_bytes_per_token(CFG, fmt)  # computed here from the format, not read from the report
        assert r["bytes_per_token"] == bpt
        assert r["pool_blocks"] == BUDGET // (8 * bpt)
        assert abs(r["planner_error_pct"]) <= 2.0
        per_req_blocks = -(-(24 + 8) // 8)
        assert r["max_concurrency"] == min(16, r["pool_blocks"] // per_req_blocks)
        for run in r["runs"]:
            assert run["errors"] == 0
            assert run["generated_tokens"] == 8 * max(6, run["concurrency"])
            assert run["max_batch"] <= run["concurrency"]
        assert any(run["at_max_concurrency"] for run in r["runs"])
        # prefix caching is on, and no level was served another level's prompts from the cache
        assert r["prefix_caching"] is True and r["reused_tokens"] == 0 and r["prefix_hit_rate"] == 0.0
    # the smaller format fits more requests under the same budget
    assert rows["int4"]["max_concurrency"] > rows["int8"]["max_concurrency"] > rows["fp16"]["max_concurrency"]
    md = (tmp_path / "report.md").read_text()
    assert "planner error" in md and "| int4 |" in md and "## Prefix cache" in md
    for png in ("concurrency_vs_context.png", "throughput_vs_concurrency.png", "accuracy_vs_bytes.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["baseline"] == "fp16"


def test_per_channel_keys_run_as_many_requests_as_fit_with_their_residual(engines, tmp_path):
    """Per-channel keys under the same budget: each request of 32 tokens takes one 64-token block and one fp16 key
    block per layer (8 KiB here), so 2 fit (32 KiB // 13.25 KiB); residual blocks for all 16 sequences of
    max_batch_size would not even fit the budget. The allocated pool equals the plan."""
    from runtime.kv_format import format_fields, format_from_name, residual_bytes

    fmt = format_from_name("k.int4-per_channel-asym+v.int4-per_token-asym")
    d = tmp_path / "kivi"
    d.mkdir()
    for f in engines[0].engine_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "kv_format.json").write_text(json.dumps(format_fields(fmt)))
    one, per_block = residual_bytes(CFG, fmt, 1), 64 * kv_bytes_per_token(CFG, fmt)
    assert BUDGET < 16 * one
    wl = Workload(prompt_len=24, output_len=8, concurrency=[1], num_requests=3, seed=0, memory_budget=BUDGET)
    compare_engines([EngineUnderTest("kivi", d, None)], wl, "cpu", tmp_path / "out", "test")
    r = json.loads((tmp_path / "out" / "report.json").read_text())["engines"][0]
    n = BUDGET // (per_block + one)
    assert n == 2 and r["max_concurrency"] == n
    assert r["pool_blocks"] == (BUDGET - n * one) // per_block
    assert r["measured_pool_bytes"] == r["planned_pool_bytes"] <= BUDGET and r["planner_error_pct"] == 0
    assert all(run["errors"] == 0 and run["max_batch"] <= run["concurrency"] for run in r["runs"])


def test_compare_stage_builds_its_variants_through_the_pipeline(tmp_path):
    """kvq-build's compare stage builds every variant with the pipeline runner its context carries."""
    from builder.run import build_pipeline
    from recipes import load_recipe

    small = ("backend: torch\nmodel: {source: synthetic, preset: tiny-llama3, dtype: fp32}\n"
             "calibration: {num_samples: 2, seq_len: 32}\n"
             "build: {max_batch_size: 4, max_input_len: 32, max_seq_len: 64, block_size: 8}\n"
             "accuracy: {enabled: false}\ndeploy: {enabled: false}\n")
    paths = {name: tmp_path / f"{name}.yaml" for name in ("base", "int8")}
    compare = (f"compare: {{variants: [{paths['base']}, {paths['int8']}], prompt_len: 8, output_len: 4, "
               "concurrency: [1], num_requests: 2}\n")
    paths["base"].write_text(small + "kv: {dtype: fp16}\n" + compare)
    paths["int8"].write_text(small + "kv: {dtype: int8, granularity: per_token}\n")
    work = tmp_path / "work"
    results = build_pipeline(load_recipe(str(paths["base"])), work, until="compare", device="cpu")
    assert [r.stage for r in results][-1] == "compare"
    report = json.loads((work / "compare" / "base" / "report.json").read_text())
    assert [e["label"] for e in report["engines"]] == [str(paths["base"]), str(paths["int8"])]
    int8 = report["engines"][1]
    assert int8["bytes_per_token"] == kv_bytes_per_token(CFG, KVFormat("int8", "per_token"))
    assert all(run["errors"] == 0 for run in int8["runs"])
    assert (work / "engines" / "int8" / "engine" / "manifest.json").is_file()  # built by the nested pipeline
