"""Our Llama vs transformers' LlamaForCausalLM on the same weights.

Acceptance (fp32, unquantized KV): logits within 1e-3 on a 256-token prompt --
through the dense path, the paged prefill path and token-by-token paged
decode -- and greedy generation token-identical to transformers' generate.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers_runtime import (
    sample_text,
    smollm2_dir,
    smollm2_hf,
    tiny_llama_dir,
)

from benchmarks import cpu_generate
from runtime.block_manager import BlockManager
from runtime.config import ModelConfig
from runtime.engine import Engine
from runtime.errors import InputError
from runtime.kv_format import KVFormat
from runtime.model import LlamaModel, PagedBatch
from runtime.runner import PoolPlan, allocate_pool
from runtime.weights import open_weights

ATOL = 1e-3


def _load(d, dtype=torch.float32, **kw) -> LlamaModel:
    cfg = ModelConfig.from_dir(d)
    return LlamaModel(cfg, open_weights(d, cfg), "cpu", dtype, **kw)


def _paged_logits(model: LlamaModel, ids: list[int], prefill_len: int) -> torch.Tensor:
    """Logits of every position: one paged prefill of `prefill_len` tokens (all rows
    kept), then paged decode one token at a time through the KV cache."""
    cfg = model.cfg
    bs = 16
    fmt = KVFormat("fp32")
    caches = allocate_pool(cfg, fmt, PoolPlan(64, bs, 0.0, "test"), model.device, None, None)
    blocks = BlockManager(64, bs)
    blocks.allocate("s", prefill_len)
    slots = torch.tensor([blocks.slot("s", p) for p in range(prefill_len)])
    pre = PagedBatch(
        input_ids=torch.tensor(ids[:prefill_len]), positions=torch.arange(prefill_len), slot_mapping=slots,
        num_decode=0, block_tables=torch.zeros(0, 1, dtype=torch.int32), seq_lens=torch.zeros(0, dtype=torch.int32),
        cu_seqlens=torch.tensor([0, prefill_len], dtype=torch.int32), logits_indices=torch.arange(prefill_len),
    )
    rows = [model.forward_paged(pre, caches)]
    for pos in range(prefill_len, len(ids)):
        blocks.append("s")
        dec = PagedBatch(
            input_ids=torch.tensor([ids[pos]]), positions=torch.tensor([pos]),
            slot_mapping=torch.tensor([blocks.slot("s", pos)]), num_decode=1,
            block_tables=torch.tensor([blocks.block_table("s")], dtype=torch.int32),
            seq_lens=torch.tensor([pos + 1], dtype=torch.int32), cu_seqlens=torch.tensor([0], dtype=torch.int32),
            logits_indices=torch.tensor([0]),
        )
        rows.append(model.forward_paged(dec, caches))
    return torch.cat(rows)


def _hf_greedy(hf, ids: list[int], n: int, eos: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_k=None, top_p=None,
                      temperature=None, pad_token_id=eos)[0, len(ids):].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


# ------------------------------------------------------------------ tiny
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaForCausalLM

    d = tiny_llama_dir(tmp_path_factory)
    return d, LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def test_tiny_config_is_llama3_scaled_gqa(tiny):
    cfg = ModelConfig.from_dir(tiny[0])
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.num_heads == 4 * cfg.num_kv_heads


def test_tiny_logits_match_transformers_dense_prefill_and_decode(tiny):
    d, hf = tiny
    ids = torch.randint(0, 512, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ref.std() > 0.5  # logits carry signal, so the comparison means something
    model = _load(d)
    assert (model.forward_dense(torch.tensor(ids)) - ref).abs().max() <= ATOL
    assert (_paged_logits(model, ids, 200) - ref).abs().max() <= ATOL


def test_tiny_greedy_matches_transformers_generate(tiny):
    d, hf = tiny
    prompts = [[1, 17, 33, 250], list(range(3, 70)), [9] * 5 + [100, 200, 300]]
    eng = Engine.from_dir(d, num_blocks=64)
    try:
        got = eng.generate(prompts, max_tokens=32)
    finally:
        eng.shutdown()
    for p, g in zip(prompts, got):
        assert g.token_ids == _hf_greedy(hf, p, 32, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiny_half_precision_error_no_worse_than_transformers(tiny, dtype):
    """Relative oracle: our error vs the fp32 reference <= 2x transformers' own error at that dtype + floor."""
    from transformers import LlamaForCausalLM

    d, hf32 = tiny
    ids = torch.randint(0, 512, (128,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf32(ids[None]).logits[0]
        hf_half = LlamaForCausalLM.from_pretrained(d, dtype=dtype).eval()
        hf_err = (hf_half(ids[None]).logits[0].float() - ref).abs().max()
    ours = _load(d, dtype).forward_dense(ids)
    assert (ours - ref).abs().max() <= 2 * hf_err + 1e-2


def test_sharded_checkpoint_and_layer_streaming_give_same_logits(tiny, tmp_path):
    d, hf = tiny
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    ids = torch.arange(40)
    full = _load(d).forward_dense(ids)
    assert torch.equal(_load(tmp_path).forward_dense(ids), full)
    seen = []
    streamed = _load(tmp_path, stream_layers=True)
    out = streamed.forward_dense(ids, observer=lambda i, k, v: seen.append((i, k.shape, v.dtype)))
    assert torch.equal(out, full)
    cfg = streamed.cfg
    assert seen == [(i, (40, cfg.num_kv_heads, cfg.head_dim), torch.float32) for i in range(cfg.num_layers)]


def test_observer_sees_k_after_rope_as_transformers_computes_it(tiny):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    d, hf = tiny
    ids = torch.arange(50)[None]
    cfg = ModelConfig.from_dir(d)
    with torch.no_grad():
        attn = hf.model.layers[0].self_attn
        x = hf.model.layers[0].input_layernorm(hf.model.embed_tokens(ids))
        k = attn.k_proj(x).view(1, 50, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q = attn.q_proj(x).view(1, 50, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = hf.model.rotary_emb(x, torch.arange(50)[None])
        _, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
    seen = {}
    model = _load(d)
    model.layer_dense(0, model.embed(ids[0]), observer=lambda i, k, v: seen.update({i: k}))
    assert (seen[0] - k_rot[0].transpose(0, 1)).abs().max() <= 1e-5


def test_bad_checkpoints_name_the_tensor(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    d, _ = tiny
    tensors = load_file(str(d / "model.safetensors"))
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(InputError, match="model.layers.1.mlp.up_proj.weight"):
        _load(tmp_path)
    wrong = dict(tensors, **{"model.norm.weight": torch.ones(7)})
    save_file(wrong, str(tmp_path / "model.safetensors"))
    with pytest.raises(InputError, match=r"model.norm.weight.*\[7\]"):
        _load(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InputError, match="not a readable safetensors"):
        _load(tmp_path)


# ---------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    return smollm2_dir(tmp_path_factory), smollm2_hf(tmp_path_factory)


@pytest.mark.slow
def test_smollm2_logits_match_transformers_on_256_tokens(smol):
    d, hf = smol
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(d)(sample_text()).input_ids[:256]
    assert len(ids) == 256
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    model = _load(d)
    assert (model.forward_dense(torch.tensor(ids)) - ref).abs().max() <= ATOL
    assert (_paged_logits(model, ids, 248) - ref).abs().max() <= ATOL


@pytest.mark.slow
def test_smollm2_greedy_identical_to_transformers_at_batch_1_and_8(smol):
    """The prompts benchmarks/cpu_generate.py times, on the CPU engine's default path (batch-invariant mode,
    oneDNN-packed weights: a lone row's GEMM unpadded): 24 greedy tokens of each, generated alone and all 8
    together, equal transformers' fp32 greedy tokens."""
    d, hf = smol
    eng = Engine.from_dir(d, num_blocks=128)
    assert eng.stats.batch_invariant
    try:
        prompts = cpu_generate.prompts(eng.tokenizer, 8)
        together = eng.generate(prompts, max_tokens=24)
        alone = [eng.generate([p], max_tokens=24)[0] for p in prompts]
    finally:
        eng.shutdown()
    for p, g, a in zip(prompts, together, alone):
        ref = _hf_greedy(hf, p, 24, eng.cfg.eos_token_id)
        assert (g.token_ids, a.token_ids) == (ref, ref)
    assert "Paris" in together[0].text
