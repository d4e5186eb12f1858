"""The `build` stage: turn converted weights + calibrated scales into an engine.

torch backend: the engine directory is the converted model (hard-linked, so
four engines of one model cost no extra disk) plus kv_format.json,
kv_scales.safetensors (static formats) and engine.json.

tensorrt-llm backend: a TensorRT-LLM checkpoint (config.json + rank{N}.safetensors
with our calibrated kv_cache_scaling_factor), the same scales exported in the
HF layout vLLM / TensorRT-LLM's PyTorch path read, and the trtllm-build command;
the engine is built when trtllm-build is installed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from runtime.errors import StageError
from runtime.kv_format import KVFormat, format_fields

from .pipeline import Context

ENGINE_FILES_SKIP = {"manifest.json"}


def link_tree(src: Path, dst: Path) -> list[str]:
    """Hard-link (or copy across filesystems) every file of src into dst."""
    names = []
    for p in sorted(src.iterdir()):
        if p.name in ENGINE_FILES_SKIP or p.is_dir():
            continue
        try:
            os.link(p, dst / p.name)
        except OSError:
            shutil.copy2(p, dst / p.name)
        names.append(p.name)
    return names


def calibrated_scales(ctx: Context, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Static k/v dequant scales for `fmt` from the calibrate stage (ModelOpt clamp applied on request)."""
    from calibration.calibrate import scales_for

    if "calibrate" not in ctx.dirs:
        raise StageError(f"{fmt.name} needs calibrated scales but the calibrate stage did not run.")
    k, v = scales_for(ctx.dirs["calibrate"], fmt, ctx.recipe.calibration.policy)
    if ctx.recipe.kv.clamp_fp8_scales_to_one and fmt.is_fp8:
        # ModelOpt's TensorRT-LLM export numerics: FP8 KV scales clamped to >= 1.0.
        k, v = k.clamp_min(1.0), v.clamp_min(1.0)
    return k.float().contiguous(), v.float().contiguous()


def engine_settings(ctx: Context) -> dict[str, Any]:
    b = ctx.recipe.build
    return {
        "max_batch_size": b.max_batch_size,
        "max_input_len": b.max_input_len,
        "max_seq_len": b.max_seq_len,
        "max_num_tokens": b.max_num_tokens,
        "block_size": b.block_size,
        "gpu_memory_fraction": b.gpu_memory_fraction,
        "cuda_graphs": b.cuda_graphs,
    }


def trtllm_build_params(ctx: Context) -> dict[str, Any]:
    """trtllm-build settings, with the plugin switches set explicitly from the KV format.

    TensorRT-LLM's builder silently turns paged context FMHA off for an INT8 KV
    cache, and for an FP8 KV cache unless the weights are FP8 too (trtllm.md §1.6);
    older builders raise instead. kvq's weights are fp16/bf16, so we state the
    outcome on the command line rather than rely on either behaviour. Without
    paged context FMHA there is no KV-cache reuse and no chunked context.
    """
    from .convert.writer import weight_dtype

    fmt = ctx.recipe.kv_format()
    # The model dtype by name: every release's plugin options take it, while "auto" is
    # newer than some releases that build from checkpoints (tests/data/trtllm_upstream.json).
    attention_dtype = weight_dtype(ctx.recipe.model.dtype)[2]
    params = {**engine_settings(ctx), "gpt_attention_plugin": attention_dtype, "context_fmha": True,
              "remove_input_padding": True, "use_paged_context_fmha": not fmt.quantized,
              "use_fp8_context_fmha": False}
    return params


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str))


def build_torch_engine(ctx: Context, out: Path) -> dict[str, Any]:
    fmt = ctx.recipe.kv_format()
    files = link_tree(ctx.dirs["convert"], out)
    _write_json(out / "kv_format.json", format_fields(fmt))
    outputs: dict[str, Any] = {"backend": "torch", "kv_format": fmt.name, "files": files}
    if fmt.static:
        k, v = calibrated_scales(ctx, fmt)
        save_file({"k_scale": k, "v_scale": v}, str(out / "kv_scales.safetensors"))
        outputs["scale_range"] = [float(min(k.min(), v.min())), float(max(k.max(), v.max()))]
    # a runtime setting of kvq's own engine only: trtllm-build has no such flag
    settings = {**engine_settings(ctx), "batch_invariant": ctx.recipe.build.batch_invariant,
                "prefix_caching": ctx.recipe.build.prefix_caching}
    _write_json(out / "engine.json", settings)
    outputs["engine"] = settings
    outputs["summary"] = f"torch engine, KV {fmt.name}"
    return outputs


def build_trtllm_engine(ctx: Context, out: Path) -> dict[str, Any]:
    from runtime.config import ModelConfig

    from .trtllm.build_cmd import run_trtllm_build, trtllm_build_available, trtllm_build_command
    from .trtllm.checkpoint import write_trtllm_checkpoint
    from .trtllm.hf_scales import export_hf_kv_scales
    from .trtllm.pp_split import check_pp_split, target_version

    r, fmt = ctx.recipe, ctx.recipe.kv_format()
    check_pp_split(ModelConfig.from_dir(ctx.dirs["convert"]).num_layers, r.build.pp,
                   *target_version(r.build.trtllm_version))
    # `out` is the stage's temporary directory; what the manifest and messages record must
    # name the directory it becomes.
    final = ctx.stage_dir or out
    kv_dtype = {"int8": "int8", "fp8_e4m3": "fp8"}.get(fmt.dtype)
    k_amax = v_amax = None
    if kv_dtype is not None:
        from calibration.calibrate import layer_amax

        k_amax, v_amax = layer_amax(ctx.dirs["calibrate"])
    ckpt = out / "checkpoint"
    ckpt.mkdir()
    info = write_trtllm_checkpoint(
        ctx.dirs["convert"], ckpt, dtype=r.model.dtype, tp=r.build.tp, pp=r.build.pp, kv_dtype=kv_dtype,
        k_amax=k_amax, v_amax=v_amax, clamp_fp8_scales_to_one=r.kv.clamp_fp8_scales_to_one,
    )
    outputs: dict[str, Any] = {"backend": "tensorrt-llm", "kv_format": fmt.name, "checkpoint": info,
                               "tp": r.build.tp, "pp": r.build.pp, "world_size": r.build.tp * r.build.pp}
    if kv_dtype == "fp8":  # vLLM / TensorRT-LLM's PyTorch path read FP8 k_scale/v_scale; neither has INT8 KV
        hf = out / "hf_kv_scales"
        hf.mkdir()
        outputs["hf_kv_scales"] = export_hf_kv_scales(ctx.dirs["convert"], hf, kv_dtype, k_amax, v_amax)
    settings = engine_settings(ctx)
    _write_json(out / "engine.json", settings)
    params = trtllm_build_params(ctx)
    cmd = trtllm_build_command(final / "checkpoint", final / "trt_engine", params)
    outputs["trtllm_build_command"] = cmd
    if trtllm_build_available():
        facts = run_trtllm_build(trtllm_build_command(ckpt, out / "trt_engine", params), out / "trtllm-build.log")
        outputs["trtllm_build"] = {**facts, "command": cmd, "log": str(final / "trtllm-build.log")}
        outputs["engine_built"] = True
        outputs["summary"] = f"TensorRT-LLM engine TP{r.build.tp}xPP{r.build.pp}, KV {fmt.name}"
    else:
        outputs["engine_built"] = False
        outputs["summary"] = f"TensorRT-LLM checkpoint TP{r.build.tp}xPP{r.build.pp}, KV {fmt.name} (engine not built)"
    return outputs


def build_engine(ctx: Context, out: Path) -> dict[str, Any]:
    if ctx.recipe.backend == "tensorrt-llm":
        return build_trtllm_engine(ctx, out)
    return build_torch_engine(ctx, out)
