"""Model geometry for the Llama family, read from / written to HF config.json.

The engine directory's config.json is a Hugging Face `LlamaConfig` dict, so the
same directory loads in transformers (that is how parity is tested). We read
both the transformers 4.x layout (`rope_theta`, `rope_scaling`) and the 5.x
layout (`rope_parameters`), and always write both.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InputError, UnsupportedError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or the llama3 dict: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=True)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InputError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads}) for grouped-query attention."
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    # ----------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        if d.get("model_type", "llama") != "llama" or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedError(
                f"{source}: architecture {archs[0]!r} (model_type {d.get('model_type')!r}) is not "
                f"supported; kvq runs the Llama family ({', '.join(SUPPORTED_ARCHITECTURES)})."
            )
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            rope = d.get("rope_parameters") or {}
            scaling = d.get("rope_scaling")
            if scaling is None and rope.get("rope_type", "default") not in ("default", None):
                scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("default", None):
                scaling = None
            if scaling is not None:
                kind = scaling.get("rope_type", scaling.get("type"))
                if kind != "llama3":
                    raise UnsupportedError(
                        f"{source}: rope scaling {kind!r} is not supported; kvq implements "
                        "default RoPE and llama3 scaling."
                    )
                scaling = dict(scaling, rope_type="llama3")
                scaling.pop("type", None)
            eos = d.get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=eos,
            )
        except KeyError as e:
            raise InputError(f"{source}: required field {e.args[0]!r} is missing.") from None
        except (TypeError, ValueError) as e:
            raise InputError(f"{source}: a field has the wrong type ({e}).") from None

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = dict(self.rope_scaling, rope_theta=self.rope_theta)
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": dtype,
            "dtype": dtype,
        }

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise InputError(f"{p} does not exist; point to a directory with a Llama config.json.")
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"{p} is not readable JSON ({e}).") from None
        return cls.from_hf_dict(d, source=str(p))

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def _llama31_scaling() -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# Geometries by name: the planner uses them without weights, `synthetic:<name>`
# creates random weights of that shape. Llama-3 presets carry Llama-3.1's
# rope scaling and 128k positions, the setting long-context users run.
PRESETS: dict[str, ModelConfig] = {
    "llama3-70b": ModelConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_llama31_scaling(), max_position_embeddings=131072,
        bos_token_id=128000, eos_token_id=128001,
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_llama31_scaling(), max_position_embeddings=131072,
        bos_token_id=128000, eos_token_id=128001,
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
    # Small shapes for tests: GQA 4:1 with llama3 rope scaling.
    "tiny-llama3": ModelConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=8, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(_llama31_scaling(), original_max_position_embeddings=64),
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise InputError(
            f"unknown model preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}."
        ) from None


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


