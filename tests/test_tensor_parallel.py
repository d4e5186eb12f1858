"""Tensor-parallel embedded engine (runtime/parallel/) over gloo on the CPU.

tp=2 must produce the greedy tokens of tp=1 and the same log-probabilities within fp32
rounding, for an unquantized and for quantized KV formats, on a tiny GQA Llama (8 heads,
2 KV heads: one per rank), on one whose single KV head is duplicated onto both ranks, and on
SmolLM2 (3 KV heads: 2 + 1, an uneven split). The unquantized runs are also held to
transformers' fp64 forward on the same weights. Quantized formats run with `tp_invariant`:
without it the last-bit differences of another reduction order become other KV codes (on
SmolLM2, int8-per_token moves log-probs by 0.2 and int4 changes greedy tokens). Every engine of the module runs on one
process group (the engine starts it once and keeps it); the module ends by stopping it and
checking that no rank process is left.
"""

from __future__ import annotations

import copy
import multiprocessing
import re
from pathlib import Path

import helpers_runtime as H
import pytest
import torch
from helpers_convert import write_tiny_tokenizer

from runtime import parallel
from runtime.config import ModelConfig
from runtime.engine import Engine
from runtime.errors import InputError, UnsupportedError
from runtime.kv_format import KVFormat, kv_bytes_per_token
from runtime.kv_quant import static_scale_from_amax
from runtime.model import LlamaModel
from runtime.parallel.sharding import ShardedWeights, check_parallelism, rank_shard
from runtime.weights import SafetensorsWeights, expected_shapes

EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module", autouse=True)
def one_group_per_module():
    yield
    parallel.close_group()
    assert multiprocessing.active_children() == [], "a tensor-parallel rank outlived its group"


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory):
    return H.tiny_llama_dir(tmp_path_factory)  # 8 heads, 2 KV heads


@pytest.fixture(scope="module")
def tiny_one_kv_head(tmp_path_factory):
    return H.tiny_llama_dir(tmp_path_factory, num_key_value_heads=1)


def per_head_scales(model_dir, fmt: KVFormat, ids: list[int]) -> dict[str, torch.Tensor]:
    """Static per-head scales from the K/V amax of one dense fp32 forward (a minimal calibration):
    every head gets its own scale, so a rank holding another head's scale changes its codes."""
    cfg = ModelConfig.from_dir(model_dir)
    amax = {"k": torch.zeros(cfg.num_layers, cfg.num_kv_heads), "v": torch.zeros(cfg.num_layers, cfg.num_kv_heads)}

    def observe(i, k, v):
        amax["k"][i] = k.abs().amax(dim=(0, 2))
        amax["v"][i] = v.abs().amax(dim=(0, 2))

    LlamaModel(cfg, SafetensorsWeights(model_dir, cfg)).forward_dense(torch.tensor(ids), observer=observe)
    return {f"{x}_scale": static_scale_from_amax(amax[x], fmt) for x in "kv"}


def run(model_dir, tp: int, fmt: str, prompts: list[list[int]], scored: list[int], max_tokens: int, **kw):
    """Greedy tokens of `prompts` and teacher-forced scores of `scored` through one engine."""
    engine = Engine.from_dir(model_dir, device="cpu", dtype="float32", tp=tp, kv_format=fmt, **kw)
    try:
        if tp > 1:  # this rank's pool: its KV heads, sized by the planner's per-rank bytes
            shard = engine.model.shard
            assert engine.runner.caches[0].kv_heads == len(shard.kv_heads)
            assert engine.stats.kv_bytes_per_token == kv_bytes_per_token(engine.cfg, engine.fmt, tp)
        tokens = [g.token_ids for g in engine.generate(prompts, max_tokens=max_tokens, ignore_eos=True)]
        (score,) = engine.score([scored])
        return tokens, score
    finally:
        engine.shutdown()


def fp64_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 by transformers in float64."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def assert_tp_matches(model_dir, fmt: str, prompts, scored, max_tokens, reference=None, **kw):
    """tp=2 against tp=1: identical greedy tokens and argmax at every scored position; log-probs
    within fp32 rounding. With an fp64 reference (unquantized KV): tp=2's error is at most twice
    tp=1's plus a floor of a few ulps of the largest log-prob (flash-attention's oracle)."""
    tok1, s1 = run(model_dir, 1, fmt, prompts, scored, max_tokens, **kw)
    tok2, s2 = run(model_dir, 2, fmt, prompts, scored, max_tokens, **kw)
    assert tok2 == tok1
    assert torch.equal(s2.argmax, s1.argmax)
    scale = float(s1.logprobs.abs().max()) + 1.0
    diff = (s2.logprobs - s1.logprobs).abs()
    # fp32 matmuls over hidden/intermediate sums: the two split orders differ by O(sqrt(K)) ulps
    bound = 256 * EPS32 * scale
    worst = int(diff.argmax())
    assert float(diff.max()) <= bound, f"position {worst}: |tp2 - tp1| = {float(diff.max()):.3g} > {bound:.3g}"
    if reference is not None:
        err1 = (s1.logprobs.double() - reference).abs().max()
        err2 = (s2.logprobs.double() - reference).abs().max()
        assert err2 <= 2 * err1 + 16 * EPS32 * scale, f"tp2 error {float(err2):.3g}, tp1 error {float(err1):.3g}"
    return s1


# ------------------------------------------------------------------ sharding
def test_rank_shards_cover_the_model_once_and_follow_the_trtllm_rule():
    cfg = ModelConfig(vocab_size=101, hidden_size=32, intermediate_size=50, num_layers=1, num_heads=12,
                      num_kv_heads=3, head_dim=8)
    check_parallelism(cfg, 2, even=False)
    with pytest.raises(UnsupportedError, match="num_key_value_heads 3 is not divisible by tp 2"):
        check_parallelism(cfg, 2)  # TensorRT-LLM's equal shares
    shards = [rank_shard(cfg, 2, r) for r in range(2)]
    assert [s.kv_heads for s in shards] == [range(0, 2), range(2, 3)]
    assert [s.q_heads for s in shards] == [range(0, 8), range(8, 12)]  # each KV head's group of 4
    assert [s.intermediate for s in shards] == [range(0, 25), range(25, 50)]
    assert [s.vocab for s in shards] == [range(0, 51), range(51, 101)] and shards[1].vocab_per_rank == 51
    # tp > kv heads: rank r duplicates KV head r // (tp / kv_heads), as TensorRT-LLM's dup_kv_weight
    six = [rank_shard(cfg, 6, r) for r in range(6)]
    assert [s.kv_heads.start for s in six] == [0, 0, 1, 1, 2, 2]
    assert [s.q_heads for s in six] == [range(2 * r, 2 * r + 2) for r in range(6)]
    with pytest.raises(UnsupportedError, match="tp 4 is not a multiple of num_key_value_heads 3"):
        check_parallelism(cfg, 4, even=False)


def test_sharded_weights_are_exact_slices(tiny_gqa):
    cfg = ModelConfig.from_dir(tiny_gqa)
    full = SafetensorsWeights(tiny_gqa, cfg)
    d = cfg.head_dim
    for r in range(2):
        shard = rank_shard(cfg, 2, r)
        mine = ShardedWeights(full, cfg, shard)
        for name in expected_shapes(cfg):
            w, part = full.get(name, torch.float32, "cpu"), mine.get(name, torch.float32, "cpu")
            assert part.is_contiguous() and part.untyped_storage().nbytes() == part.numel() * 4, name
            if "q_proj" in name:
                want = w[shard.q_heads.start * d:shard.q_heads.stop * d]
            elif "k_proj" in name or "v_proj" in name:
                want = w[shard.kv_heads.start * d:shard.kv_heads.stop * d]
            elif "o_proj" in name:
                want = w[:, shard.q_heads.start * d:shard.q_heads.stop * d]
            elif "gate_proj" in name or "up_proj" in name:
                want = w[shard.intermediate.start:shard.intermediate.stop]
            elif "down_proj" in name:
                want = w[:, shard.intermediate.start:shard.intermediate.stop]
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                want = torch.zeros(shard.vocab_per_rank, cfg.hidden_size)
                want[:len(shard.vocab)] = w[shard.vocab.start:shard.vocab.stop]
            else:
                want = w
            assert torch.equal(part, want), name


def test_bad_tp_is_refused_before_any_rank_starts(tiny_gqa, tmp_path):
    with pytest.raises(UnsupportedError, match="tp 3 is not a multiple of num_key_value_heads 2"):
        Engine.from_dir(tiny_gqa, device="cpu", tp=3)
    bad = tmp_path / "engine"
    bad.mkdir()
    for f in tiny_gqa.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "engine.json").write_text('{"tp": 0}')
    with pytest.raises(InputError, match="tp must be a positive integer"):
        Engine.from_dir(bad, device="cpu")
    assert multiprocessing.active_children() == []


# ------------------------------------------------------------- equivalence
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 41, 7], list(range(40, 80))]
SCORED = [(7 * i + 3) % 500 + 1 for i in range(48)]


def test_tiny_gqa_unquantized_and_fp64(tiny_gqa):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_gqa, dtype=torch.float64).eval()
    assert_tp_matches(tiny_gqa, "fp32", PROMPTS, SCORED, 12, reference=fp64_logprobs(hf, SCORED))


@pytest.mark.parametrize("fmt", ["int8-per_token", "int4-per_token-asym"])
def test_tiny_gqa_quantized_kv(tiny_gqa, fmt):
    assert_tp_matches(tiny_gqa, fmt, PROMPTS, SCORED, 12, tp_invariant=True)


def test_tiny_gqa_static_per_head_scales_are_sliced(tiny_gqa):
    fmt = KVFormat("int8", "per_head")
    scales = per_head_scales(tiny_gqa, fmt, SCORED)
    assert_tp_matches(tiny_gqa, fmt.name, PROMPTS, SCORED, 12, kv_scales=scales, tp_invariant=True)


def test_duplicated_kv_head(tiny_one_kv_head):
    fmt = KVFormat("int8", "per_head")
    assert_tp_matches(tiny_one_kv_head, "fp32", PROMPTS, SCORED, 8)
    scales = per_head_scales(tiny_one_kv_head, fmt, SCORED)
    assert_tp_matches(tiny_one_kv_head, fmt.name, PROMPTS, SCORED, 8, kv_scales=scales, tp_invariant=True)


def test_second_engine_while_one_runs_is_refused(tiny_gqa):
    engine = Engine.from_dir(tiny_gqa, device="cpu", tp=2)
    try:
        with pytest.raises(InputError, match="another tensor-parallel engine is running"):
            Engine.from_dir(tiny_gqa, device="cpu", tp=2)
        assert engine.generate([[5, 6, 7]], max_tokens=2)[0].finish_reason == "length"
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp32", "int8-per_token"])
def test_smollm2(tmp_path_factory, fmt):
    """SmolLM2-135M: 9 heads and 3 KV heads over 2 ranks (2 + 1 KV heads, 6 + 3 query heads)."""
    d = H.smollm2_dir(tmp_path_factory)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    prompts = [H.chat_prompt_ids(tok, q) for q in H.CHAT_QUESTIONS[:2]]
    scored = tok(H.sample_text()).input_ids[:64]
    reference = None
    if fmt == "fp32":
        reference = fp64_logprobs(copy.deepcopy(H.smollm2_hf(tmp_path_factory)).double(), scored)
    assert_tp_matches(d, fmt, prompts, scored, 8, reference=reference, max_seq_len=512,
                      tp_invariant=fmt != "fp32")


@pytest.mark.slow
def test_kvq_serve_runs_a_tensor_parallel_engine(tmp_path_factory, tmp_path):
    """engine.json "tp": 2 deployed with `kvq deploy` and served by the real tritonserver: the model
    instance's engine process is rank 0 and starts rank 1; the answer is the tp=1 engine's own."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    from click.testing import CliRunner

    from builder.cli import cli
    from triton_repo import client, protocol
    from triton_repo.server import free_port

    src = H.smollm2_dir(tmp_path_factory)
    eng = tmp_path / "engine"
    eng.mkdir()
    for f in src.iterdir():
        (eng / f.name).symlink_to(f)
    (eng / "engine.json").write_text(json.dumps({"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128,
                                                 "block_size": 16, "tp": 2}))
    question = H.CHAT_QUESTIONS[0]
    direct = Engine.from_dir(eng, device="cpu", tp=1)
    try:
        ids = protocol.encode_prompt(direct.tokenizer, question, chat=True)
        want = direct.generate([ids], max_tokens=12)[0].text
    finally:
        direct.shutdown()
    repo = tmp_path / "repo"
    r = CliRunner().invoke(cli, ["deploy", str(eng), "--out", str(repo), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    ports = {k: free_port() for k in ("http", "grpc", "metrics")}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "kvq"), "serve", str(repo), "--log-dir", str(tmp_path),
                             *(a for k, p in ports.items() for a in (f"--{k}-port", str(p)))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not any(ln.startswith("ready") for ln in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        got = client.generate(f"127.0.0.1:{ports['http']}",
                              client.GenerateRequest(question, max_tokens=12, apply_chat_template=True))
        assert got == want
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(lines)
    server_pid = int(re.search(r"tritonserver pid (\d+)", "".join(lines)).group(1))
    deadline = time.monotonic() + 30
    while True:  # neither the server nor its stub nor the stub's rank is left
        try:
            os.killpg(server_pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, f"a process of tritonserver's group {server_pid} outlived kvq serve"
        time.sleep(0.2)


def test_deploy_refuses_several_instances_of_a_tensor_parallel_engine(tiny_gqa, tmp_path):
    from triton_repo.repo_torch import write_repository

    eng = tmp_path / "engine"
    eng.mkdir()
    for f in tiny_gqa.iterdir():
        (eng / f.name).symlink_to(f)
    (eng / "engine.json").write_text('{"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128, "tp": 2}')
    write_tiny_tokenizer(eng, ModelConfig.from_dir(eng).vocab_size)
    repo = tmp_path / "repo"
    repo.mkdir()
    with pytest.raises(InputError, match="instance_count 2: the engine is tensor-parallel"):
        write_repository(eng, repo, {"instance_count": 2})
    assert not any(repo.iterdir())
