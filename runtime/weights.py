"""Llama weights, read lazily one tensor (or one layer) at a time.

Sources:
* `SafetensorsWeights`: `model.safetensors`, or shards listed in
  `model.safetensors.index.json` (HF tensor names). Each tensor is read with
  `safetensors.safe_open` only when asked for, so a 70B checkpoint can be
  streamed layer by layer (calibration) without holding it all.
* `SyntheticWeights`: random weights created directly on the target device and
  dtype (std 0.02, norms 1), for capacity/throughput runs of large shapes
  without a checkpoint.

Names and shapes are validated against the ModelConfig up front, so a wrong or
truncated checkpoint fails with the file and tensor named, before any compute.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .errors import InputError

LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint must hold, with its HF shape."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (cfg.num_heads * d, h),
        "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
        "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
        "self_attn.o_proj.weight": (h, cfg.num_heads * d),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for layer in range(cfg.num_layers):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{name}"] = shape
    return shapes


def _is_view_of_more(t: torch.Tensor) -> bool:
    return not t.is_contiguous() or t.untyped_storage().nbytes() > t.numel() * t.element_size()


def layer_name(layer: int, name: str) -> str:
    return f"model.layers.{layer}.{name}"


class SafetensorsWeights:
    """Lazy reader over one safetensors file or an HF sharded index."""

    def __init__(self, directory: str | Path, cfg: ModelConfig):
        self.dir = Path(directory)
        self.cfg = cfg
        self._where: dict[str, Path] = {}  # tensor name -> file
        self._shapes: dict[str, tuple[int, ...]] = {}
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise InputError(f"{index} is not a valid safetensors index ({e}); re-run the convert stage.") from None
            files = sorted({self.dir / f for f in weight_map.values()})
        elif single.is_file():
            files = [single]
        else:
            raise InputError(
                f"{self.dir} has no model.safetensors or model.safetensors.index.json; "
                "point to a converted model directory (kvq convert) or a synthetic one."
            )
        for f in files:
            if not f.is_file():
                raise InputError(f"{f} is listed in the safetensors index but missing; re-run the convert stage.")
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                        self._where[name] = f
                        self._shapes[name] = tuple(sf.get_slice(name).get_shape())
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for corrupt headers
                raise InputError(f"{f} is not a readable safetensors file ({e}); re-run the convert stage.") from None
        self._validate()

    def _validate(self) -> None:
        for name, shape in expected_shapes(self.cfg).items():
            if name not in self._where:
                raise InputError(
                    f"{self.dir}: tensor {name!r} is missing from the checkpoint; the weights do not match "
                    "config.json (or the file is truncated). Re-run the convert stage."
                )
            if self._shapes[name] != shape:
                raise InputError(
                    f"{self._where[name]}: tensor {name!r} has shape {list(self._shapes[name])}, but config.json "
                    f"implies {list(shape)}; the weights and config.json do not belong together."
                )

    def get(self, name: str, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        if name not in self._where:
            raise InputError(f"{self.dir}: tensor {name!r} is not in the checkpoint.")
        with safe_open(str(self._where[name]), framework="pt", device="cpu") as sf:
            t = sf.get_tensor(name)
        return t.to(device=device, dtype=dtype)

    def get_slice(self, name: str, rows: range | None, cols: range | None, dtype: torch.dtype,
                  device: torch.device | str) -> torch.Tensor:
        """Rows and/or columns of one tensor, read from the file without loading the rest of it
        (a tensor-parallel rank's shard)."""
        if name not in self._where:
            raise InputError(f"{self.dir}: tensor {name!r} is not in the checkpoint.")
        shape = self._shapes[name]
        r = slice(None) if rows is None else slice(rows.start, rows.stop)
        c = slice(None) if cols is None else slice(cols.start, cols.stop)
        with safe_open(str(self._where[name]), framework="pt", device="cpu") as sf:
            part = sf.get_slice(name)
            # a view of the memory-mapped file: only the pages under the slice are read
            t = (part[r] if len(shape) == 1 else part[r, c]).to(device=device, dtype=dtype)
        # own exactly the shard's bytes: a view would keep the whole tensor's mapping alive, and
        # a strided (column) view makes every matmul over it slow
        return t.clone(memory_format=torch.contiguous_format) if _is_view_of_more(t) else t

    @property
    def has_lm_head(self) -> bool:
        return "lm_head.weight" in self._where


class SyntheticWeights:
    """Random weights of the config's shape, deterministic per (seed, name)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.cfg = cfg
        self.seed = int(seed)
        self._shapes = expected_shapes(cfg)
        self._order = {name: n for n, name in enumerate(self._shapes)}

    def get(self, name: str, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        shape = self._shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=device)
        g = torch.Generator(device=device)
        g.manual_seed(self.seed * 1_000_003 + self._order[name])
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.normal_(0.0, 0.02, generator=g)

    def get_slice(self, name: str, rows: range | None, cols: range | None, dtype: torch.dtype,
                  device: torch.device | str) -> torch.Tensor:
        """A shard drawn on its own (seeded by name and offsets), so no rank ever creates a full
        tensor: shards of a tensor-parallel engine are random weights, not slices of `get`'s."""
        if rows is None and cols is None:
            return self.get(name, dtype, device)
        shape = self._shapes[name]
        r = range(shape[0]) if rows is None else rows
        c = range(shape[1]) if cols is None and len(shape) > 1 else cols
        part = (len(r),) if len(shape) == 1 else (len(r), len(c))
        if name.endswith("norm.weight"):
            return torch.ones(part, dtype=dtype, device=device)
        g = torch.Generator(device=device)
        g.manual_seed(hash((self.seed, self._order[name], r.start, c.start if c else 0)) % 2**62)
        return torch.empty(part, dtype=dtype, device=device).normal_(0.0, 0.02, generator=g)

    @property
    def has_lm_head(self) -> bool:
        return not self.cfg.tie_word_embeddings


def open_weights(directory: str | Path, cfg: ModelConfig) -> SafetensorsWeights | SyntheticWeights:
    """The weight source a directory describes: synthetic.json wins over safetensors."""
    d = Path(directory)
    syn = d / "synthetic.json"
    if syn.is_file():
        try:
            seed = int(json.loads(syn.read_text()).get("seed", 0))
        except (OSError, json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
            raise InputError(f"{syn} is not valid JSON with an integer 'seed' ({e}).") from None
        return SyntheticWeights(cfg, seed)
    return SafetensorsWeights(d, cfg)
