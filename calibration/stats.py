"""K/V statistics from real forward passes.

`KVStats` is the observer the runtime model calls once per layer with K (after
RoPE, exactly what the cache stores) and V, `[tokens, kv_heads, head_dim]`. It
keeps, per layer, for K and V:

* amax per KV head and channel (`[layers, 2, kv_heads, head_dim]`), from which
  per-head / per-tensor amax and outlier channels follow;
* a histogram of |x| per KV head on fixed log2-spaced bins
  (`[layers, 2, kv_heads, bins]`). Fixed bins make histograms of different
  batches (and of the two collection modes) add exactly, and the log spacing
  keeps ~1% relative resolution at every magnitude, which is what the
  percentile and MSE clip searches need.

Two ways to drive the model: `collect_whole_model` (one sample at a time
through all layers) and `collect_layer_streaming` (one layer's weights resident
at a time, hidden states of all samples carried from layer to layer). Both call
the same per-layer function in the same order, so they give identical
statistics; streaming is what fits a 70B model on one GPU or on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from runtime.errors import InputError, NumericsError

# Bins: [0, 2^LO) in bin 0, then BINS_PER_OCTAVE bins per octave up to 2^HI (last bin open).
LOG2_LO, LOG2_HI, BINS_PER_OCTAVE = -20, 17, 64
NUM_BINS = 1 + (LOG2_HI - LOG2_LO) * BINS_PER_OCTAVE
KV = ("k", "v")


def bin_edges() -> torch.Tensor:
    """Upper edge of every bin (fp64), `[NUM_BINS]`; the last is +inf."""
    exps = LOG2_LO + torch.arange(NUM_BINS, dtype=torch.float64) / BINS_PER_OCTAVE
    edges = torch.pow(2.0, exps)
    edges[-1] = float("inf")
    return edges


def bin_centers() -> torch.Tensor:
    """A representative |x| per bin: 0 for the underflow bin, the geometric middle otherwise."""
    exps = LOG2_LO + (torch.arange(NUM_BINS, dtype=torch.float64) - 0.5) / BINS_PER_OCTAVE
    c = torch.pow(2.0, exps)
    c[0] = 0.0
    return c


class KVStats:
    """Accumulates amax and |x| histograms per layer, K/V, KV head (and channel)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.channel_amax = torch.zeros(num_layers, 2, kv_heads, head_dim, dtype=torch.float32)
        self.hist = torch.zeros(num_layers, 2, kv_heads, NUM_BINS, dtype=torch.int64)
        self.tokens = torch.zeros(num_layers, dtype=torch.int64)

    # The runtime model calls this: observer(layer_idx, k, v).
    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for which, x in enumerate((k, v)):
            x = x.detach().to(torch.float32)
            if x.dim() != 3 or x.shape[1:] != (self.kv_heads, self.head_dim):
                raise NumericsError(
                    f"layer {layer}: expected {KV[which].upper()} of shape [tokens, {self.kv_heads}, "
                    f"{self.head_dim}], got {tuple(x.shape)}; the model and its config disagree."
                )
            if not torch.isfinite(x).all():
                raise NumericsError(
                    f"layer {layer}: {KV[which].upper()} activations contain NaN/Inf; calibration stopped. "
                    "Check the weights of this layer (or run in float32: --dtype float32)."
                )
            a = x.abs()
            self.channel_amax[layer, which] = torch.maximum(self.channel_amax[layer, which], a.amax(dim=0).cpu())
            self.hist[layer, which] += self._histogram(a).cpu()
        self.tokens[layer] += k.shape[0]

    def _histogram(self, a: torch.Tensor) -> torch.Tensor:
        """Per-head counts on the fixed log2 bins: [kv_heads, NUM_BINS]."""
        log2 = torch.log2(a.clamp_min(2.0**LOG2_LO))  # zeros land in bin 0
        idx = torch.floor((log2 - LOG2_LO) * BINS_PER_OCTAVE).long() + 1
        idx = torch.where(a < 2.0**LOG2_LO, torch.zeros_like(idx), idx).clamp_(0, NUM_BINS - 1)
        heads = torch.arange(self.kv_heads, device=a.device).view(1, -1, 1)
        flat = (heads * NUM_BINS + idx).flatten()
        return torch.bincount(flat, minlength=self.kv_heads * NUM_BINS).view(self.kv_heads, NUM_BINS)

    # ------------------------------------------------------------- views
    def head_amax(self) -> torch.Tensor:
        """[layers, 2, kv_heads]"""
        return self.channel_amax.amax(dim=-1)

    def layer_amax(self) -> torch.Tensor:
        """[layers, 2]: what a per-tensor (ModelOpt / TensorRT-LLM) calibration sees."""
        return self.channel_amax.amax(dim=(-1, -2))

    def check_complete(self) -> None:
        missing = [i for i in range(self.num_layers) if int(self.tokens[i]) == 0]
        if missing:
            raise NumericsError(
                f"no K/V statistics for layers {missing}; the model did not report them. "
                "This is a bug in the model's observer hook."
            )

    # ------------------------------------------------------------- storage
    def tensors(self) -> dict[str, torch.Tensor]:
        return {"channel_amax": self.channel_amax, "hist": self.hist, "tokens": self.tokens}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "KVStats":
        layers, _, heads, dim = t["channel_amax"].shape
        if t["hist"].shape[-1] != NUM_BINS:
            raise InputError("kv_stats.safetensors uses a different histogram layout; re-run `kvq calibrate`.")
        s = cls(layers, heads, dim)
        s.channel_amax, s.hist, s.tokens = t["channel_amax"], t["hist"], t["tokens"]
        return s

    @classmethod
    def load(cls, path: str | Path) -> "KVStats":
        try:
            return cls.from_tensors(load_file(str(path)))
        except (OSError, KeyError, ValueError) as e:
            raise InputError(f"cannot read K/V statistics from {path} ({e}); re-run `kvq calibrate`.") from None


def outlier_channels(stats: KVStats, ratio: float = 4.0, top: int = 8) -> list[dict]:
    """Channels whose amax exceeds `ratio` x the median channel amax of their head.

    Key outliers concentrate in a few channels (KIVI, KVQuant); they are what
    makes per-tensor and per-head INT4 keys lose precision.
    """
    out = []
    med = stats.channel_amax.median(dim=-1).values.clamp_min(1e-12)  # [L, 2, H]
    rel = stats.channel_amax / med.unsqueeze(-1)
    for layer in range(stats.num_layers):
        for which in range(2):
            for head in range(stats.kv_heads):
                r = rel[layer, which, head]
                hits = torch.nonzero(r > ratio).flatten()
                for ch in sorted(hits.tolist(), key=lambda c: -float(r[c]))[:top]:
                    out.append({
                        "layer": layer, "tensor": KV[which], "head": head, "channel": ch,
                        "amax": round(float(stats.channel_amax[layer, which, head, ch]), 5),
                        "ratio_to_median": round(float(r[ch]), 2),
                    })
    return out


# ------------------------------------------------------------ collection
def collect_whole_model(model, windows: torch.Tensor, stats: KVStats, batch_size: int = 8,
                        advance: Callable[[int], None] | None = None) -> KVStats:
    """Each batch of samples runs through every layer; the whole model is resident.
    advance(n): called after each batch with its number of samples (progress bars)."""
    positions = torch.arange(windows.shape[1], device=model.device)
    with torch.inference_mode():
        for b in range(0, windows.shape[0], batch_size):
            h = model.embed(windows[b : b + batch_size])
            for layer in range(model.cfg.num_layers):
                h = model.layer_dense(layer, h, positions, observer=stats)
            if advance is not None:
                advance(h.shape[0])
    stats.check_complete()
    return stats


def collect_layer_streaming(model, windows: torch.Tensor, stats: KVStats, batch_size: int = 8,
                            advance: Callable[[int], None] | None = None) -> KVStats:
    """One layer resident at a time; all samples' hidden states go from layer to layer.

    `model` is a runtime LlamaModel opened with stream_layers=True: `layer_dense(i)`
    loads layer i's weights and drops the previous layer's. Hidden states stay on
    the model's device: 64 x 512 tokens of a 70B model (hidden 8192) is 1 GiB in fp32.
    advance(n): called after each batch of each layer with its number of samples (progress bars).
    """
    positions = torch.arange(windows.shape[1], device=model.device)
    with torch.inference_mode():
        hs = [model.embed(windows[b : b + batch_size]) for b in range(0, windows.shape[0], batch_size)]
        for layer in range(model.cfg.num_layers):
            for j, h in enumerate(hs):
                hs[j] = model.layer_dense(layer, h, positions, observer=stats)
                if advance is not None:
                    advance(h.shape[0])
    stats.check_complete()
    return stats
