"""Reading an engine (or converted model, or synthetic) directory into typed settings.

    config.json            model geometry (always)
    model.safetensors[...] weights, or synthetic.json {"seed"} for random weights
    kv_format.json         KVFormat fields, or {"layers": [...]} one per layer (runtime/layer_formats.py);
                           absent: unquantized KV in the model dtype; and "rotation": {kind, seed, signs}
                           when K/V are rotated before they are stored (rotation.py)
    kv_scales.safetensors  k_scale, v_scale [layers] or [layers, kv_heads] (static formats), or
                           k_scale.<i>, v_scale.<i> per static layer of a mixed engine
    engine.json            max_batch_size, max_input_len, max_seq_len, block_size, gpu_memory_fraction,
                           cuda_graphs, batch_invariant, prefix_caching, tp, tp_invariant, burst_steps, fused_ops
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .errors import InputError, KvqError, UnsupportedError
from .kv_format import KVFormat, format_from_name
from .layer_formats import (
    LayerFormats,
    as_layer_formats,
    formats_from_json,
    formats_name,
    scales_from_tensors,
    uniform_format,
)
from .rotation import NO_ROTATION, KVRotation
from .tokenizer import TOKENIZER_JSON, load_fast_tokenizer

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
    tp: int = 1  # tensor-parallel ranks, one process (and GPU) each (runtime/parallel/)
    tp_invariant: bool = False  # outputs bit-identical for every tp (float64 row-parallel sums; slower)
    # greedy decode steps per host read-back (runtime/decode_burst.py); 0: every step; None: DEFAULT_BURST_STEPS on
    # a single CUDA device, else 0
    burst_steps: int | None = None
    # norms, RoPE, SwiGLU as fused Triton kernels (runtime/kernels/small_ops.py); None: on for a single CUDA device
    # outside the batch-invariant mode
    fused_ops: bool | None = None


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
    for name in ("max_batch_size", "max_input_len", "max_seq_len", "block_size", "tp"):
        v = getattr(s, name)
        if v is not None and (not isinstance(v, int) or v < 1):
            raise InputError(f"{p}: {name} must be a positive integer, got {v!r}; fix engine.json or rebuild.")
    if not 0 < s.gpu_memory_fraction <= 1:
        raise InputError(f"{p}: gpu_memory_fraction must be in (0, 1], got {s.gpu_memory_fraction!r}.")
    if s.burst_steps is not None and (not isinstance(s.burst_steps, int) or isinstance(s.burst_steps, bool)
                                      or s.burst_steps < 0):
        raise InputError(f"{p}: burst_steps must be an integer >= 0 (0: one host round trip per step), "
                         f"got {s.burst_steps!r}; fix engine.json or rebuild.")
    for name in ("cuda_graphs", "batch_invariant", "prefix_caching", "tp_invariant", "fused_ops"):
        v = getattr(s, name)
        if not isinstance(v, bool) and not (name in ("batch_invariant", "fused_ops") and v is None):
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
    """A uniform engine's one KV format (a mixed engine is an error here: use resolve_layer_formats)."""
    if isinstance(kv_format, (KVFormat, str)) or (isinstance(kv_format, dict) and "layers" not in kv_format):
        return resolve_layer_formats(kv_format, d, dtype, 1)[0]
    formats = resolve_layer_formats(kv_format, d, dtype, ModelConfig.from_dir(d).num_layers)
    one = uniform_format(formats)
    if one is None:
        raise UnsupportedError(f"{d}: the engine stores a KV format per layer ({formats_name(formats)}); "
                               "read it with runtime.engine_dir.resolve_layer_formats.")
    return one


def resolve_layer_formats(kv_format: KVFormat | Sequence[KVFormat] | dict | str | None, d: Path,
                          dtype: torch.dtype, num_layers: int) -> LayerFormats:
    """One KVFormat per layer, from the caller (a format, a name, a per-layer sequence, kv_format.json's
    content) or the directory's kv_format.json (absent: unquantized KV in the model dtype)."""
    if isinstance(kv_format, KVFormat):
        return (kv_format,) * num_layers
    if isinstance(kv_format, str):
        return (parse_kv_format_name(kv_format),) * num_layers
    if isinstance(kv_format, (list, tuple)):
        return as_layer_formats(kv_format, num_layers)
    if kv_format is None:
        p = d / "kv_format.json"
        if not p.is_file():
            return (KVFormat(dtype=_KV_NAME[dtype]),) * num_layers
        kv_format, where = read_json(p), str(p)
    else:
        where = "kv_format"
    return formats_from_json(kv_format, num_layers, where)


def resolve_rotation(rotation: KVRotation | str | None, d: Path, cfg: ModelConfig) -> KVRotation:
    """The KV rotation: given (a KVRotation, or 'none' / 'hadamard' with seed 0), else kv_format.json's."""
    try:
        if isinstance(rotation, KVRotation):
            rotation.check(cfg.head_dim)
            return rotation
        if isinstance(rotation, str):
            rot = KVRotation(rotation)
            rot.check(cfg.head_dim)
            return rot
        p = d / "kv_format.json"
        if not p.is_file():
            return NO_ROTATION
        return KVRotation.from_json(read_json(p).get("rotation"), cfg.head_dim, str(p))
    except KvqError as e:
        raise InputError(str(e)) from None


def resolve_scales(
    fmt: KVFormat | Sequence[KVFormat], kv_scales: str | Path | dict | None, d: Path, cfg: ModelConfig
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | tuple[None, None]:
    """Static layers' calibrated dequant scales, per layer ([] per_tensor, [kv_heads] per_head), validated;
    (None, None) when no layer has static scales."""
    formats = as_layer_formats(fmt, cfg.num_layers)
    if not any(f.static for f in formats):
        return None, None
    where = "kv_scales"
    if kv_scales is None or isinstance(kv_scales, (str, Path)):
        p = Path(kv_scales) if kv_scales is not None else d / "kv_scales.safetensors"
        if not p.is_file():
            names = sorted({f.name for f in formats if f.static})
            raise InputError(
                f"KV format {', '.join(names)} needs calibrated scales but {p} does not exist; run the calibrate "
                "stage (kvq calibrate) or choose a per_token format."
            )
        from safetensors.torch import load_file

        try:
            kv_scales, where = load_file(str(p)), str(p)
        except Exception as e:  # noqa: BLE001 - safetensors' own error types for corrupt files
            raise InputError(f"{p} is not a readable safetensors file ({e}); re-run calibration.") from None
    return scales_from_tensors(formats, kv_scales, cfg, where)


def load_tokenizer(d: Path):
    """The engine's fast tokenizer (runtime/tokenizer.py), or None for synthetic directories, directories
    without a tokenizer.json, and machines without transformers (token-id prompts only)."""
    if (d / "synthetic.json").is_file() or not (d / TOKENIZER_JSON).is_file():
        return None
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    return load_fast_tokenizer(d)
