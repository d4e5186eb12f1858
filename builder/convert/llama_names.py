"""The Llama weight table: Hugging Face names and shapes, and llama.cpp's names.

One table per architecture, not code per model (style.md §3). Every converter
and the TensorRT-LLM writer derive names and expected shapes from here.
"""

from __future__ import annotations

import re

from runtime.config import ModelConfig

# Per-layer tensors: HF suffix under model.layers.{i}. -> llama.cpp suffix under blk.{i}.
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# Tensors some HF checkpoints carry that hold nothing the model needs.
IGNORABLE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each per-layer tensor, keyed by HF suffix."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (cfg.num_heads * d, h),
        "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
        "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
        "self_attn.o_proj.weight": (h, cfg.num_heads * d),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the model in file order, with its shape (lm_head absent when tied)."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    per_layer = layer_shapes(cfg)
    for layer in range(cfg.num_layers):
        for suffix, shape in per_layer.items():
            out[f"model.layers.{layer}.{suffix}"] = shape
    out["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out


def hf_name_to_gguf(name: str) -> str:
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m or m.group(2) not in LAYER_TENSORS:
        raise KeyError(name)
    return f"blk.{m.group(1)}.{LAYER_TENSORS[m.group(2)]}"
