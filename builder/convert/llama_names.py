"""The Llama weight table: HF names and shapes, and llama.cpp's names for them.

One table per architecture, not code per model (style.md §3). The HF names and
shapes are the runtime's (runtime.weights.expected_shapes, re-exported here as
hf_tensor_shapes); this module adds what only converters need.
"""

from __future__ import annotations

import re

from runtime.weights import expected_shapes as hf_tensor_shapes

__all__ = ["GLOBAL_TENSORS", "IGNORABLE", "LAYER_TENSORS", "hf_name_to_gguf", "hf_tensor_shapes"]

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


def hf_name_to_gguf(name: str) -> str:
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m or m.group(2) not in LAYER_TENSORS:
        raise KeyError(name)
    return f"blk.{m.group(1)}.{LAYER_TENSORS[m.group(2)]}"
