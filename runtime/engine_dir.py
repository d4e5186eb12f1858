"""Reading an engine (or converted model, or synthetic) directory into typed settings.

    config.json            model geometry (always)
    model.safetensors[...] weights, or synthetic.json {"seed"} for random weights
    kv_format.json         KVFormat fields (absent: unquantized KV in the model dtype)
    kv_scales.safetensors  k_scale, v_scale [layers] or [layers, kv_heads] (static formats)
    engine.json            max_batch_size, max_input_len, max_seq_len, block_size, gpu_memory_fraction,
                           cuda_graphs, batch_invariant
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .errors import InputError, KvqError
from .kv_format import KVFormat, format_from_name

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_KV_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class EngineSettings:
    max_batch_size: int | None = None
    max_input_len: int | None = None
    max_seq_len: int | None = None
    block_size: int = 16
    gpu_memory_fraction: float = 0.9
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (CUDA + Triton attention only)
    batch_invariant: bool | None = None  # None: on for CPU engines, off on CUDA (runtime/batch_invariant.py)
    prefix_caching: bool = True  # reuse cached full KV pages across requests (runtime/block_manager.py)


def read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is not readable JSON ({e}); rebuild the engine (kvq build).") from None
    if not isinstance(d, dict):
        raise InputError(f"{path} must hold a JSON object; rebuild the engine (kvq build).")
    return d


def read_settings(d: Path) -> EngineSettings:
    p = d / "engine.json"
    if not p.is_file():
        return EngineSettings()
    raw = read_json(p)
    known = {f.name for f in dataclasses.fields(EngineSettings)}
    try:
        s = EngineSettings(**{k: v for k, v in raw.items() if k in known and v is not None})
    except TypeError as e:
        raise InputError(f"{p}: {e}") from None
    for name in ("max_batch_size", "max_input_len", "max_seq_len", "block_size"):
        v = getattr(s, name)
        if v is not None and (not isinstance(v, int) or v < 1):
            raise InputError(f"{p}: {name} must be a positive integer, got {v!r}; fix engine.json or rebuild.")
    if not 0 < s.gpu_memory_fraction <= 1:
        raise InputError(f"{p}: gpu_memory_fraction must be in (0, 1], got {s.gpu_memory_fraction!r}.")
    for name in ("cuda_graphs", "batch_invariant", "prefix_caching"):
        v = getattr(s, name)
        if not isinstance(v, bool) and not (name == "batch_invariant" and v is None):
            raise InputError(f"{p}: {name} must be true or false, got {v!r}; fix engine.json or rebuild.")
    return s


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, d: Path) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _KV_NAME:
            raise InputError(f"model dtype {dtype} is not supported; use float32, bfloat16 or float16.")
        return dtype
    if dtype is not None:
        if dtype not in MODEL_DTYPES:
            raise InputError(f"model dtype {dtype!r} is not supported; use float32, bfloat16 or float16.")
        return MODEL_DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slower and less exact
    cfg = read_json(d / "config.json")
    stored = MODEL_DTYPES.get(cfg.get("dtype") or cfg.get("torch_dtype") or "", torch.bfloat16)
    return stored if stored != torch.float32 else torch.bfloat16


def parse_kv_format_name(name: str) -> KVFormat:
    """The inverse of KVFormat.name ("fp16", "int8-per_head", "k.int8-per_token+v.int4-per_token-asym")."""
    try:
        return format_from_name(name)
    except KvqError as e:
        raise InputError(f"KV format {name!r}: {e}") from None


def resolve_kv_format(kv_format: KVFormat | dict | str | None, d: Path, dtype: torch.dtype) -> KVFormat:
    if isinstance(kv_format, KVFormat):
        return kv_format
    if isinstance(kv_format, str):
        return parse_kv_format_name(kv_format)
    if kv_format is None:
        p = d / "kv_format.json"
        if not p.is_file():
            return KVFormat(dtype=_KV_NAME[dtype])
        kv_format, where = read_json(p), str(p)
    else:
        where = "kv_format"
    known = {f.name for f in dataclasses.fields(KVFormat)}
    try:
        return KVFormat(**{k: v for k, v in kv_format.items() if k in known})
    except KvqError as e:
        raise InputError(f"{where}: {e}") from None
    except TypeError as e:
        raise InputError(f"{where}: {e}; expected the KVFormat fields {sorted(known)}.") from None


def resolve_scales(
    fmt: KVFormat, kv_scales: str | Path | dict | None, d: Path, cfg: ModelConfig
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Static formats: calibrated dequant scales, validated per layer (and head)."""
    if not fmt.static:
        return None, None
    where = "kv_scales"
    if kv_scales is None or isinstance(kv_scales, (str, Path)):
        p = Path(kv_scales) if kv_scales is not None else d / "kv_scales.safetensors"
        if not p.is_file():
            raise InputError(
                f"KV format {fmt.name} needs calibrated scales but {p} does not exist; run the calibrate "
                "stage (kvq calibrate) or choose a per_token format."
            )
        from safetensors.torch import load_file

        try:
            kv_scales, where = load_file(str(p)), str(p)
        except Exception as e:  # noqa: BLE001 - safetensors' own error types for corrupt files
            raise InputError(f"{p} is not a readable safetensors file ({e}); re-run calibration.") from None
    want = (cfg.num_layers,) if fmt.granularity == "per_tensor" else (cfg.num_layers, cfg.num_kv_heads)
    out = []
    for key in ("k_scale", "v_scale"):
        t = kv_scales.get(key)
        if t is None:
            raise InputError(f"{where}: {key!r} is missing; re-run calibration for {fmt.name}.")
        t = torch.as_tensor(t, dtype=torch.float32)
        if tuple(t.shape) != want:
            raise InputError(
                f"{where}: {key} has shape {list(t.shape)}, {fmt.granularity} needs {list(want)} "
                "(layers[, kv_heads]); the scales were calibrated for another granularity or model."
            )
        if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
            raise InputError(f"{where}: {key} has non-positive or non-finite values; re-run calibration.")
        out.append(t)
    return out[0], out[1]


def load_tokenizer(d: Path):
    """transformers tokenizer, or None for synthetic directories / no tokenizer files."""
    if (d / "synthetic.json").is_file():
        return None
    if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:  # the GPU machine may run token-id prompts only
        return None
    try:
        return AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - tokenizer loading raises many types; all mean the same here
        raise InputError(f"{d}: the tokenizer files cannot be loaded ({e}); re-run the convert stage.") from None
