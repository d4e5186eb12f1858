"""Scale policies: from K/V statistics to a clip value, then to s = clip / qmax.

* `max` -- clip at the observed amax (ModelOpt's and TensorRT-LLM's choice):
  nothing saturates on the calibration data.
* `percentile` -- clip at the given percentile of |x| (default 99.99): a few
  outliers saturate so that everything else gets finer steps.
* `mse` -- the clip that minimises the expected squared quantization error
  over the |x| histogram, searched on a geometric grid below amax. The error
  of each candidate is computed with runtime.kv_format's own quantize /
  dequantize, so it is exactly the rounding the cache performs.

Granularity: `per_tensor` pools a layer's KV heads (one clip per layer),
`per_head` clips each KV head. The dequantization scale follows the project's
convention, s = clip / qmax (runtime.kv_quant.static_scale_from_amax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.errors import InputError
from runtime.kv_format import KVFormat
from runtime.kv_quant import dequantize, quantize, static_scale_from_amax

from .stats import KVStats, bin_centers, bin_edges

POLICIES = ("max", "percentile", "mse")
STATIC_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
STATIC_GRANULARITIES = ("per_tensor", "per_head")
DEFAULT_PERCENTILE = 99.99
# MSE search: clips amax * 2^(-j/32), j = 0..95, i.e. down to amax/8.
_MSE_STEPS, _MSE_OCTAVES = 96, 3.0


def static_formats() -> list[KVFormat]:
    """Every calibrated (static-scale) format the torch backend runs."""
    return [KVFormat(d, g) for d in STATIC_DTYPES for g in STATIC_GRANULARITIES]


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise InputError(f"unknown scale policy {policy!r}; choose one of {', '.join(POLICIES)}.")


def pooled(stats: KVStats, which: int, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, hist) for K (which=0) or V (1): [L], [L, B] per_tensor; [L, H], [L, H, B] per_head."""
    amax = stats.channel_amax[:, which].amax(dim=-1)  # [L, H]
    hist = stats.hist[:, which]  # [L, H, B]
    if granularity == "per_tensor":
        return amax.amax(dim=-1), hist.sum(dim=-2)
    if granularity == "per_head":
        return amax, hist
    raise InputError(f"granularity {granularity!r} has no calibrated scales (per_token scales are dynamic).")


def _sq_errors(hist: torch.Tensor, clips: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Expected squared error sum_b count_b (x_b - dq(q(x_b)))^2: hist [N, B], clips [N, C] -> [N, C].

    Only bins that hold values anywhere in `hist` are evaluated (the rest add
    nothing), in chunks of rows to bound memory.
    """
    used = torch.nonzero(hist.sum(dim=0) > 0).flatten()
    if used.numel() % 2:  # int4 quantize packs pairs of values
        used = torch.cat((used, used[-1:]))
        weights = torch.cat((hist[:, used[:-1]], torch.zeros_like(hist[:, :1])), dim=1).double()
    else:
        weights = hist[:, used].double()
    x = bin_centers()[used].to(torch.float32)
    out = torch.empty(clips.shape, dtype=torch.float64)
    rows = max(1, 2_000_000 // max(1, clips.shape[1] * x.numel()))
    for a in range(0, clips.shape[0], rows):
        c = clips[a : a + rows]  # [n, C]
        s = static_scale_from_amax(c.reshape(-1), fmt)  # [n*C]
        xs = x.expand(s.numel(), -1).contiguous()
        err = ((dequantize(quantize(xs, fmt, s), fmt, s) - xs).double() ** 2).view(*c.shape, -1)
        out[a : a + rows] = (err * weights[a : a + rows, None, :]).sum(dim=-1)
    return out


def _percentile_clip(amax: torch.Tensor, hist: torch.Tensor, pct: float) -> torch.Tensor:
    edges = bin_edges()
    cdf = hist.double().cumsum(-1)
    total = cdf[..., -1:]
    idx = torch.searchsorted(cdf.contiguous(), (total * pct / 100.0).contiguous()).squeeze(-1)
    clip = edges[idx.clamp(max=edges.numel() - 1)].to(torch.float32)
    return torch.minimum(clip, amax)


@dataclass(frozen=True)
class ClipResult:
    clip: torch.Tensor  # chosen clip (amax-equivalent) per layer [/ head]
    scale: torch.Tensor  # s = clip / qmax, fp32
    rel_error: torch.Tensor  # histogram estimate of E[(x - dq(q(x)))^2] / E[x^2] at the chosen clip
    rel_error_at_max: torch.Tensor  # the same with clip = amax, for comparison


def choose_clip(
    amax: torch.Tensor, hist: torch.Tensor, fmt: KVFormat, policy: str, percentile: float = DEFAULT_PERCENTILE
) -> ClipResult:
    """Clip, scale and estimated relative error for every leading index of amax/hist."""
    check_policy(policy)
    if not fmt.static:
        raise InputError(f"{fmt.name} has no calibrated scales.")
    if policy == "max":
        clip = amax.clone()
    elif policy == "percentile":
        if not 0.0 < percentile <= 100.0:
            raise InputError(f"percentile must be in (0, 100], got {percentile}.")
        clip = _percentile_clip(amax, hist, percentile)
    flat_amax = amax.reshape(-1).clamp_min(1e-12)
    flat_hist = hist.reshape(-1, hist.shape[-1])
    energy = (flat_hist.double() * bin_centers() ** 2).sum(dim=-1).clamp_min(1e-30)
    if policy == "mse":
        ratios = torch.pow(2.0, -torch.arange(_MSE_STEPS, dtype=torch.float32) * (_MSE_OCTAVES / _MSE_STEPS))
        cands = flat_amax[:, None] * ratios[None, :]  # descending: argmin keeps the largest of equal clips
        e = _sq_errors(flat_hist, torch.cat((cands, flat_amax[:, None]), dim=1), fmt)
        j = torch.argmin(e[:, :-1], dim=1)
        clip = cands.gather(1, j[:, None]).view_as(amax)
        err, err_max = e.gather(1, j[:, None]).squeeze(1), e[:, -1]
    else:
        e = _sq_errors(flat_hist, torch.stack((clip.reshape(-1).clamp_min(1e-12), flat_amax), dim=1), fmt)
        err, err_max = e[:, 0], e[:, 1]
    err, err_max = (err / energy).float().view_as(amax), (err_max / energy).float().view_as(amax)
    return ClipResult(clip, static_scale_from_amax(clip, fmt), err, err_max)


def scales_from_stats(
    stats: KVStats, fmt: KVFormat, policy: str, percentile: float = DEFAULT_PERCENTILE
) -> tuple[ClipResult, ClipResult]:
    """(K, V) clip results for one static format."""
    return tuple(choose_clip(*pooled(stats, w, fmt.granularity), fmt, policy, percentile) for w in (0, 1))
