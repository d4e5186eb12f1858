"""Small random Hugging Face Llama directories for converter and TRT-LLM tests.

Written with safetensors' own `save_file` (not kvq's streaming writer), so the
tests compare kvq's output against an independently produced source.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.config import ModelConfig


def tiny_cfg(heads: int = 4, kv_heads: int = 4, layers: int = 2, vocab: int = 97, tied: bool = False,
             hidden: int = 32, inter: int = 48, head_dim: int = 8) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=10000.0,
                       max_position_embeddings=256, tie_word_embeddings=tied)


def random_state_dict(cfg: ModelConfig, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": r(cfg.vocab_size, h)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        sd[p + "input_layernorm.weight"] = 1 + 0.1 * r(h)
        sd[p + "self_attn.q_proj.weight"] = r(cfg.num_heads * d, h)
        sd[p + "self_attn.k_proj.weight"] = r(cfg.num_kv_heads * d, h)
        sd[p + "self_attn.v_proj.weight"] = r(cfg.num_kv_heads * d, h)
        sd[p + "self_attn.o_proj.weight"] = r(h, cfg.num_heads * d)
        sd[p + "post_attention_layernorm.weight"] = 1 + 0.1 * r(h)
        sd[p + "mlp.gate_proj.weight"] = r(i, h)
        sd[p + "mlp.up_proj.weight"] = r(i, h)
        sd[p + "mlp.down_proj.weight"] = r(h, i)
    sd["model.norm.weight"] = 1 + 0.1 * r(h)
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = r(cfg.vocab_size, h)
    return sd


def write_tiny_tokenizer(out: Path, vocab: int) -> None:
    """A word-level tokenizer (no download) that AutoTokenizer loads from the directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{k}": k for k in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))


def make_hf_dir(out: Path, cfg: ModelConfig, seed: int = 0, shards: int = 1, dtype=torch.float32,
                tokenizer: bool = True) -> dict[str, torch.Tensor]:
    """Write config.json, weights (one file or `shards` files + index) and a tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    sd = random_state_dict(cfg, seed, dtype)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict("float32")))
    if shards == 1:
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = list(sd)
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: sd[n] for n in names[s::shards]}
            save_file(part, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if tokenizer:
        write_tiny_tokenizer(out, cfg.vocab_size)
    return sd
