"""Write a TensorRT-LLM checkpoint (config.json + rank{N}.safetensors) from a HF Llama dir.

Format: shared/reference/trtllm.md §2 (names/shapes table §2.3, config §2.2)
and §1.4-1.5 for the KV scale. Facts that are easy to get wrong, all from
TensorRT-LLM's llama/convert.py:

* `mlp.fc` holds HF `gate_proj` and `mlp.gate` holds `up_proj` (swapped names).
* qkv per rank is [q_r; k_r; v_r]: q, k, v are each split into tp chunks; when
  kv_heads < tp each KV head is first repeated tp/kv_heads times
  (`dup_kv_weight`), so rank r holds KV head r // (tp/kv_heads)
  (`runtime.parallel.sharding.rank_shard`, the embedded engine's split too).
* o_proj/down_proj split along dim 1 (row-parallel), fc/gate/qkv along dim 0.
* lm_head is zero-padded to a multiple of tp rows, then split along dim 0.
* rank = pp_rank * tp + tp_rank; layer indices are local to the PP stage; the
  embedding lives on the first stage, ln_f and lm_head on the last.
* `kv_cache_scaling_factor` is the dequantization scale, f32 [1], one per layer
  for K and V together: max(k_amax, v_amax) / qmax.

Each rank file is streamed: a tensor is produced from the source (reading only
the rows it needs where the split allows), cast slice by slice as it is
written, and dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from calibration.files import write_json_atomic
from runtime.config import ModelConfig
from runtime.errors import InputError, NumericsError, UnsupportedError
from runtime.kv_format import KVFormat
from runtime.kv_quant import static_scale_from_amax
from runtime.parallel.sharding import check_parallelism, rank_shard

from ..convert.hf import HFCheckpoint
from ..convert.writer import TensorSpec, weight_dtype, write_streaming

# kvq KV dtype -> (checkpoint kv_cache_quant_algo, KV format for the scale's qmax)
KV_ALGOS = {"int8": ("INT8", KVFormat("int8")), "fp8": ("FP8", KVFormat("fp8_e4m3"))}


def pp_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Layers of each pipeline stage (TensorRT-LLM's Mapping.pp_layers: torch.tensor_split)."""
    parts = torch.tensor_split(torch.arange(num_layers), pp)
    return [range(int(p[0]), int(p[-1]) + 1) if len(p) else range(0) for p in parts]


def kv_cache_scales(kv_dtype: str, k_amax: torch.Tensor | None, v_amax: torch.Tensor | None,
                    num_layers: int, clamp_fp8_scales_to_one: bool = False) -> torch.Tensor:
    """Per-layer f32 dequant scale max(k_amax, v_amax)/qmax, optionally ModelOpt's FP8 clamp to >= 1."""
    if kv_dtype not in KV_ALGOS:
        if kv_dtype == "int4":
            raise UnsupportedError("TensorRT-LLM has no INT4 KV cache (only INT8/FP8 on the engine path, "
                                   "NVFP4 on Blackwell via ModelOpt); use kv dtype int8 or fp8, or the torch backend.")
        raise UnsupportedError(f"KV dtype {kv_dtype!r} is not available in TensorRT-LLM engines; use int8 or fp8.")
    if k_amax is None or v_amax is None:
        raise InputError(f"a {kv_dtype} KV cache needs calibrated K and V amax per layer; run the calibrate stage first.")
    amax = torch.maximum(torch.as_tensor(k_amax, dtype=torch.float32), torch.as_tensor(v_amax, dtype=torch.float32))
    if amax.shape != (num_layers,):
        raise InputError(f"K/V amax have shape {list(amax.shape)}; expected [{num_layers}] (one per layer, max over heads).")
    if not torch.isfinite(amax).all() or (amax <= 0).any():
        raise NumericsError("calibrated K/V amax contain NaN/Inf or non-positive values; re-run calibration "
                            "with more or different sample data.")
    scale = static_scale_from_amax(amax, KV_ALGOS[kv_dtype][1])
    if clamp_fp8_scales_to_one and kv_dtype == "fp8":
        scale = scale.clamp_min(1.0)  # ModelOpt's export numerics (trtllm.md §1.4)
    return scale


def trtllm_config(cfg: ModelConfig, hf_dtype: str, tp: int, pp: int, kv_algo: str | None) -> dict[str, Any]:
    rotary_scaling = None
    if cfg.rope_scaling:
        # older TensorRT-LLM reads "type", newer "rope_type": give both
        rotary_scaling = dict(cfg.rope_scaling, type=cfg.rope_scaling["rope_type"])
    return {
        "architecture": "LlamaForCausalLM",
        "dtype": hf_dtype,
        "logits_dtype": "float32",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_size": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "norm_epsilon": cfg.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": cfg.rope_theta,
        "rotary_scaling": rotary_scaling,
        "attn_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "cp_size": 1,
                    "moe_tp_size": tp, "moe_ep_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": kv_algo},
    }


def _rank_plan(src: HFCheckpoint, tp: int, tp_rank: int, layers: range, first: bool, last: bool,
               dtype: torch.dtype, scales: torch.Tensor | None) -> list[tuple[TensorSpec, Callable[[], torch.Tensor]]]:
    """(spec, producer) for every tensor of one rank, in file order."""
    cfg = src.cfg
    h, d = cfg.hidden_size, cfg.head_dim
    # the embedded engine's split (runtime/parallel/sharding.py), in equal blocks (check_parallelism)
    shard = rank_shard(cfg, tp, tp_rank)
    q = range(shard.q_heads.start * d, shard.q_heads.stop * d)
    kv = range(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    mlp = shard.intermediate
    q_rows, kv_rows, inter = len(q), len(kv), len(mlp)
    plan: list[tuple[TensorSpec, Callable[[], torch.Tensor]]] = []

    def add(name, shape, fn, dt=dtype):
        plan.append((TensorSpec(name, tuple(shape), dt), fn))  # the writer casts to dt

    def rows(name, part: range):
        return lambda: src.load(name, rows=slice(part.start, part.stop))

    def cols(name, part: range):
        return lambda: src.load(name)[:, part.start:part.stop]

    if first:
        add("transformer.vocab_embedding.weight", (cfg.vocab_size, h), lambda: src.load("model.embed_tokens.weight"))
    for local, layer in enumerate(layers):
        hf, trt = f"model.layers.{layer}.", f"transformer.layers.{local}."
        a = hf + "self_attn."
        qkv = (rows(a + "q_proj.weight", q), rows(a + "k_proj.weight", kv), rows(a + "v_proj.weight", kv))
        add(trt + "input_layernorm.weight", (h,), lambda n=hf + "input_layernorm.weight": src.load(n))
        add(trt + "attention.qkv.weight", (q_rows + 2 * kv_rows, h), lambda f=qkv: torch.cat([g() for g in f]))
        add(trt + "attention.dense.weight", (h, q_rows), cols(a + "o_proj.weight", q))
        if scales is not None:
            add(trt + "attention.kv_cache_scaling_factor", (1,), lambda s=scales[layer]: s.reshape(1), torch.float32)
        add(trt + "post_layernorm.weight", (h,), lambda n=hf + "post_attention_layernorm.weight": src.load(n))
        add(trt + "mlp.fc.weight", (inter, h), rows(hf + "mlp.gate_proj.weight", mlp))
        add(trt + "mlp.gate.weight", (inter, h), rows(hf + "mlp.up_proj.weight", mlp))
        add(trt + "mlp.proj.weight", (h, inter), cols(hf + "mlp.down_proj.weight", mlp))
    if last:
        add("transformer.ln_f.weight", (h,), lambda: src.load("model.norm.weight"))
        per_rank = shard.vocab_per_rank
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"

        def lm_head() -> torch.Tensor:
            lo, hi = shard.vocab.start, shard.vocab.stop
            part = src.load(head, rows=slice(lo, hi)) if hi > lo else torch.empty(0, h)
            pad = torch.zeros(per_rank - part.shape[0], h, dtype=part.dtype)  # padded vocab rows
            return torch.cat([part, pad])

        add("lm_head.weight", (per_rank, h), lm_head)
    return plan


def write_trtllm_checkpoint(model_dir: str | Path, out_dir: str | Path, dtype: str, tp: int = 1, pp: int = 1,
                            kv_dtype: str | None = None, k_amax: torch.Tensor | None = None,
                            v_amax: torch.Tensor | None = None,
                            clamp_fp8_scales_to_one: bool = False) -> dict[str, Any]:
    """Fill `out_dir` (existing, empty) with a TensorRT-LLM checkpoint; returns manifest facts."""
    src = HFCheckpoint(model_dir)
    src.check_llama()
    cfg = src.cfg
    check_parallelism(cfg, tp, pp)
    short, tdtype, hf_dtype = weight_dtype(dtype)
    scales, kv_algo = None, None
    if kv_dtype is not None:
        scales = kv_cache_scales(kv_dtype, k_amax, v_amax, cfg.num_layers, clamp_fp8_scales_to_one)
        kv_algo = KV_ALGOS[kv_dtype][0]
    out = Path(out_dir)
    stages = pp_layer_ranges(cfg.num_layers, pp)
    total, largest, files = 0, 0, []
    for pp_rank, layers in enumerate(stages):
        for tp_rank in range(tp):
            plan = _rank_plan(src, tp, tp_rank, layers, pp_rank == 0, pp_rank == pp - 1, tdtype, scales)
            producers = {spec.name: fn for spec, fn in plan}
            fname = f"rank{pp_rank * tp + tp_rank}.safetensors"
            specs = [spec for spec, _ in plan]
            total += write_streaming(out / fname, specs, lambda s, p=producers: p[s.name]())
            largest = max([largest, *(s.nbytes for s in specs)])
            files.append(fname)
    write_json_atomic(out / "config.json", trtllm_config(cfg, hf_dtype, tp, pp, kv_algo))
    return {
        "format": "tensorrt_llm_checkpoint",
        "dtype": short,
        "tp": tp,
        "pp": pp,
        "world_size": tp * pp,
        "kv_cache_quant_algo": kv_algo,
        "kv_cache_scaling_factor": None if scales is None else [float(s) for s in scales],
        "clamp_fp8_scales_to_one": bool(clamp_fp8_scales_to_one and kv_dtype == "fp8"),
        "files": files,
        "weight_bytes": total,
        "largest_tensor_bytes": largest,
    }
