"""Rotary position embeddings: default RoPE and Llama-3 frequency scaling.

The frequencies follow transformers' `_compute_default_rope_parameters` and
`_compute_llama3_parameters` exactly, and cos/sin are computed in fp32 from
`position * inv_freq` (one fp32 multiply, as transformers' matmul does), then
cast to the activation dtype -- so our logits match LlamaForCausalLM bit for
bit in the RoPE step.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, llama3-scaled when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if not sc:
        return inv_freq
    factor = float(sc["factor"])
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_len = float(sc["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept,
    # and the band between is interpolated smoothly.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """cos/sin tables per device, grown on demand (a 128k-position table for a
    128-dim head is 64 MiB in fp32, so we only build what positions need)."""

    def __init__(self, cfg: ModelConfig):
        self.inv_freq = inv_frequencies(cfg)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def table(self, device: torch.device, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self._tables.get(device)
        if cos_sin is None or cos_sin[0].shape[0] < needed:
            n = max(256, 1 << (needed - 1).bit_length())
            pos = torch.arange(n, dtype=torch.float32, device=device)
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos_sin = (emb.cos(), emb.sin())
            self._tables[device] = cos_sin
        return cos_sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, head_dim] cos and sin for int64 positions, in `dtype` ([T, 1, D] ready to broadcast).

        max_position: a bound on the positions known on the host; without it the table size
        comes from the positions themselves, a device-to-host sync (not allowed while a CUDA
        graph is being captured)."""
        cos, sin = self.table_for(positions, max_position)
        return cos[positions].to(dtype)[:, None, :], sin[positions].to(dtype)[:, None, :]

    def table_for(self, positions: torch.Tensor, max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 tables covering `positions` (bounded by max_position where the host knows it: no sync)."""
        if max_position is not None:
            needed = max_position + 1
        else:
            needed = int(positions.max().item()) + 1 if positions.numel() else 1
        return self.table(positions.device, needed)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] (HF's rotate-half convention)."""
    return x * cos + _rotate_half(x) * sin
