"""`synthetic:<preset>`: a model directory with geometry and a seed, no weights.

Capacity and throughput runs of 8B/70B geometries need the shapes, not the
values; the runtime creates random weights directly on the target device and
dtype at load (so nothing multi-GB is written or read here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from calibration.files import write_json_atomic
from runtime.config import preset

from .output import config_digest
from .writer import weight_dtype

SYNTHETIC_FILE = "synthetic.json"


def write_synthetic(preset_name: str, out_dir: str | Path, dtype: str, seed: int = 0) -> dict[str, Any]:
    cfg = preset(preset_name)
    short, _, hf_dtype = weight_dtype(dtype)
    hf_config = cfg.to_hf_dict(hf_dtype)
    out = Path(out_dir)
    write_json_atomic(out / "config.json", hf_config)
    write_json_atomic(out / SYNTHETIC_FILE, {"seed": int(seed)})
    return {"dtype": short, "config_digest": config_digest(hf_config), "num_tensors": 0,
            "weight_bytes": 0, "num_parameters": cfg.num_parameters, "seed": int(seed)}
