"""NVIDIA ModelOpt as a calibration peer: its per-layer FP8 KV amax on the same tokens.

ModelOpt (`nvidia-modelopt`, a dev dependency, imported lazily) calibrates
`k_bmm_quantizer` / `v_bmm_quantizer` on a transformers LlamaForCausalLM: one
per-tensor amax per layer for K (after RoPE) and V, with the `max` algorithm.
That is what our `max` policy must reproduce (tests/test_modelopt_crosscheck.py),
and what the README's "ModelOpt FP8 per-tensor KV" row uses as its scales:
s = amax / 448, and ModelOpt's TensorRT-LLM export clamps FP8 KV scales to
>= 1.0 (shared/reference/trtllm.md section 1.4), the "clamped" variant.
"""

from __future__ import annotations

import warnings

import torch

FP8_E4M3_MAX = 448.0


def modelopt_kv_amax(hf_model, windows: torch.Tensor, batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer (K, V) amax `[layers]` fp32 from ModelOpt FP8_KV_CFG max calibration.

    `hf_model` is modified in place (ModelOpt inserts quantizers); pass a copy
    you no longer need for anything else.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # modelopt warns about untested transformers versions
        import modelopt.torch.quantization as mtq
        from modelopt.torch.quantization.utils.core_utils import update_quant_cfg_with_kv_cache_quant

    cfg = update_quant_cfg_with_kv_cache_quant({"quant_cfg": None, "algorithm": "max"}, mtq.FP8_KV_CFG["quant_cfg"])

    def forward_loop(model):
        with torch.inference_mode():
            for b in range(0, windows.shape[0], batch_size):
                model(input_ids=windows[b : b + batch_size], use_cache=False)

    hf_model.config.architectures = ["LlamaForCausalLM"]
    model = mtq.quantize(hf_model, cfg, forward_loop)
    layers = model.model.layers
    k = torch.stack([layer.self_attn.k_bmm_quantizer.amax.detach().float().reshape(()) for layer in layers])
    v = torch.stack([layer.self_attn.v_bmm_quantizer.amax.detach().float().reshape(()) for layer in layers])
    return k, v


def modelopt_fp8_scales(k_amax: torch.Tensor, v_amax: torch.Tensor, clamp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt's FP8 KV scales: amax/448, clamped to >= 1.0 as its export does when `clamp`."""
    k, v = k_amax / FP8_E4M3_MAX, v_amax / FP8_E4M3_MAX
    return (k.clamp_min(1.0), v.clamp_min(1.0)) if clamp else (k, v)
