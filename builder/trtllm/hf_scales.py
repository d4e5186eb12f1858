"""Export kvq's calibrated KV scales in the Hugging Face layout (trtllm.md §1.5).

vLLM and TensorRT-LLM's PyTorch path read KV scales from a ModelOpt-style HF
checkpoint. `export_hf_kv_scales` writes one into `out_dir`:

* the model's own files (config, weights, tokenizer) hard-linked from
  `model_dir` (copied when linking is impossible), untouched;
* `kv_scales.safetensors`: `model.layers.{i}.self_attn.k_proj.k_scale` and
  `...v_proj.v_scale`, scalar float32 each, = amax / 448 (K and V separately:
  these engines keep two scales, unlike the TRT-LLM checkpoint's max);
* `model.safetensors.index.json` listing the weights and the scales, so loaders
  that follow the index find both files;
* `hf_quant_config.json` {"producer", "quantization": {"quant_algo": null,
  "kv_cache_quant_algo": "FP8", ...}} (ModelOpt's file, read by TensorRT-LLM);
* `config.json` gains `quantization_config` with `kv_cache_scheme`
  {"dynamic": false, "num_bits": 8, "type": "float"} and `quant_method`
  "modelopt" (what ModelOpt's convert_hf_quant_config_format writes).

Only FP8: neither consumer has an INT8 KV cache (trtllm.md §1.1), and the
ModelOpt HF exporter refuses INT8 too.
"""

from __future__ import annotations

import json
import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from calibration.files import write_json_atomic
from runtime.errors import UnsupportedError

from ..convert.hf import INDEX_FILE, HFCheckpoint
from ..convert.tokenizer import TOKENIZER_FILES
from ..convert.writer import TensorSpec, write_streaming
from .checkpoint import kv_cache_scales

SCALES_FILE = "kv_scales.safetensors"


def _kvq_version() -> str:
    try:
        return metadata.version("kvq")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def hf_quant_config(kv_algo: str) -> dict[str, Any]:
    return {"producer": {"name": "kvq", "version": _kvq_version()},
            "quantization": {"quant_algo": None, "kv_cache_quant_algo": kv_algo, "exclude_modules": []}}


def export_hf_kv_scales(model_dir: str | Path, out_dir: str | Path, kv_dtype: str, k_amax: torch.Tensor,
                        v_amax: torch.Tensor, clamp_fp8_scales_to_one: bool = False) -> dict[str, Any]:
    """Fill `out_dir` (existing, empty) with the model plus HF-layout KV scales; returns facts."""
    if kv_dtype != "fp8":
        raise UnsupportedError(f"HF-layout KV scales exist for FP8 only (vLLM, TensorRT-LLM's PyTorch path); "
                               f"{kv_dtype!r} has no consumer there. Use kv dtype fp8, or the TRT-LLM engine checkpoint for int8.")
    src = HFCheckpoint(model_dir)
    src.check_llama()
    n = src.cfg.num_layers
    # Same validation and formula as the TRT-LLM scale, applied to K and V separately.
    k_scale = kv_cache_scales(kv_dtype, k_amax, k_amax, n, clamp_fp8_scales_to_one)
    v_scale = kv_cache_scales(kv_dtype, v_amax, v_amax, n, clamp_fp8_scales_to_one)
    out = Path(out_dir)
    for f in [*src.files, *(src.dir / name for name in TOKENIZER_FILES)]:
        if f.is_file():
            _link_or_copy(f, out / f.name)
    values: dict[str, torch.Tensor] = {}
    for i in range(n):
        values[f"model.layers.{i}.self_attn.k_proj.k_scale"] = k_scale[i].reshape(())
        values[f"model.layers.{i}.self_attn.v_proj.v_scale"] = v_scale[i].reshape(())
    specs = [TensorSpec(name, (), torch.float32) for name in values]
    write_streaming(out / SCALES_FILE, specs, lambda s: values[s.name], metadata={"format": "pt"})
    weight_map = {name: Path(src.origin(name)).name for name in src.shapes}
    weight_map.update({name: SCALES_FILE for name in values})
    total = sum(f.stat().st_size for f in src.files)
    write_json_atomic(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    quant = hf_quant_config("FP8")
    write_json_atomic(out / "hf_quant_config.json", quant)
    config = json.loads((src.dir / "config.json").read_text())
    config["quantization_config"] = {
        "ignore": [],
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
        "producer": quant["producer"],
        "quant_method": "modelopt",
    }
    write_json_atomic(out / "config.json", config)
    return {"format": "hf_kv_scales", "kv_cache_quant_algo": "FP8", "scales_file": SCALES_FILE,
            "k_scale": [float(s) for s in k_scale], "v_scale": [float(s) for s in v_scale],
            "clamp_fp8_scales_to_one": clamp_fp8_scales_to_one}
