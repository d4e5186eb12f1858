"""Write the converted model directory (docs/interfaces.md "Directories").

Shared by every weight source: config.json from ModelConfig.to_hf_dict, then
model.safetensors streamed one tensor at a time, cast to the requested dtype
as each tensor passes through.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from calibration.files import write_json_atomic
from runtime.config import ModelConfig
from runtime.errors import InputError

from .writer import TensorSpec, weight_dtype, write_streaming

WEIGHTS_FILE = "model.safetensors"
CHUNK_ELEMENTS = 16 << 20


def config_digest(hf_config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()


def write_model_dir(
    cfg: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    load: Callable[[str], torch.Tensor],
    origin: Callable[[str], str],
    out_dir: str | Path,
    dtype: str,
) -> dict[str, Any]:
    """Write config.json + model.safetensors; `shapes` is the file order (already validated)."""
    out = Path(out_dir)
    short, tdtype, hf_dtype = weight_dtype(dtype)
    hf_config = cfg.to_hf_dict(hf_dtype)
    specs = [TensorSpec(name, shape, tdtype) for name, shape in shapes.items()]

    def produce(spec: TensorSpec) -> torch.Tensor:
        t = load(spec.name)
        if tuple(t.shape) != spec.shape:  # a source whose header lied about the data
            raise InputError(f"{origin(spec.name)}: tensor {spec.name} has shape {list(t.shape)}, "
                             f"expected {list(spec.shape)}.")
        # Checked in slices: a whole-tensor isfinite() would allocate another tensor-sized mask.
        if not all(bool(torch.isfinite(c).all()) for c in t.reshape(-1).split(CHUNK_ELEMENTS)):
            raise InputError(f"{origin(spec.name)}: tensor {spec.name} contains NaN/Inf; the weights are corrupt.")
        return t  # the writer casts to the target dtype slice by slice

    nbytes = write_streaming(out / WEIGHTS_FILE, specs, produce, metadata={"format": "pt"})
    write_json_atomic(out / "config.json", hf_config)
    return {
        "dtype": short,
        "config_digest": config_digest(hf_config),
        "num_tensors": len(specs),
        "weight_bytes": nbytes,
        "num_parameters": cfg.num_parameters,
    }
