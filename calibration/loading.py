"""Open a converted model directory for calibration and accuracy checks.

The runtime's dense model (runtime.model.LlamaModel) is what both stages run:
whole-model, or layer-streaming (one decoder layer's weights resident at a
time). The tokenizer is transformers' (the convert stage saves one).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.config import ModelConfig
from runtime.errors import InputError
from runtime.model import LlamaModel
from runtime.rotation import NO_ROTATION, KVRotation
from runtime.weights import open_weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def is_synthetic(model_dir: str | Path) -> bool:
    return (Path(model_dir) / "synthetic.json").is_file()


def model_dtype(model_dir: str | Path, dtype: str | None = None) -> torch.dtype:
    """The requested dtype, else the one config.json records, else float32."""
    if dtype is None:
        try:
            d = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            d = {}
        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    if dtype not in _DTYPES:
        raise InputError(f"dtype {dtype!r} is not supported; choose one of float32, bfloat16, float16.")
    return _DTYPES[dtype]


def load_model(model_dir: str | Path, device: str = "cpu", dtype: str | None = None,
               streaming: bool = False, rotation: KVRotation = NO_ROTATION) -> LlamaModel:
    """rotation: the KV rotation folded into the weights (runtime/rotation.py), so observers see the
    K and V a rotated engine stores."""
    cfg = ModelConfig.from_dir(model_dir)
    weights = open_weights(model_dir, cfg)
    return LlamaModel(cfg, weights, device=device, dtype=model_dtype(model_dir, dtype), stream_layers=streaming,
                      rotation=rotation)


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise InputError(
            f"{model_dir} has no usable tokenizer ({e}); convert the model with `kvq convert`, "
            "which saves the tokenizer files beside the weights."
        ) from None
