"""KV-cache formats: what a stored K/V element is, and the reference math.

A format is (dtype, granularity, symmetric, scale dtype). The scale convention
is TensorRT-LLM's: the stored scale *dequantizes*, x ~= q * s (+ zero for
asymmetric integers), with s = amax / qmax.

Everything that quantizes or dequantizes KV in kvq -- the reference attention
path, calibration's error estimates, the Triton kernels' tests -- uses the
functions here, so there is one definition of every rounding decision:

* write path: divide by the scale, clamp to the representable range, then
  round to nearest even (integers: torch.round; fp8: the cast itself). Clamping
  first matters: an fp8 cast of an out-of-range value is NaN in some torch
  builds and saturates in Triton, so we never rely on either.
* dynamic (per_token) scales are rounded *up* to the scale dtype, and
  asymmetric zero points *down*, so every element of the token-head is inside
  the representable range after rounding and the round-trip error stays within
  half a quantization step of the scale that is actually stored.
* int4 packs two values per byte: element 2j in the low nibble, 2j+1 in the
  high nibble. Symmetric values [-7, 7] are stored with a +8 offset;
  asymmetric values are [0, 15].

Storage layout of the paged pool (see kv_cache.py): values
`[num_blocks, kv_heads, block_size, head_dim_stored]`, per-token metadata
`[num_blocks, kv_heads, block_size]`. Heads-major pages keep one KV head's
tokens contiguous, so a decode kernel reads each page of a head as one block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import ModelConfig, ceil_div
from .errors import UnsupportedError

# fp32 is an unquantized reference format (parity tests, calibration baselines);
# fp16/bf16 are the serving baselines.
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
GRANULARITIES = ("per_tensor", "per_head", "per_token")
SCALE_DTYPES = ("float16", "bfloat16", "float32")

_TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_SCALE_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "int4": 4}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


@dataclass(frozen=True)
class KVFormat:
    dtype: str = "fp16"
    granularity: str = "per_tensor"
    symmetric: bool = True
    scale_dtype: str = "float16"  # storage of per_token scales/zeros; static scales are fp32

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise UnsupportedError(f"unknown KV dtype {self.dtype!r}; choose one of {', '.join(KV_DTYPES)}.")
        if self.granularity not in GRANULARITIES:
            raise UnsupportedError(
                f"unknown KV granularity {self.granularity!r}; choose one of {', '.join(GRANULARITIES)}."
            )
        if self.scale_dtype not in SCALE_DTYPES:
            raise UnsupportedError(
                f"unknown scale dtype {self.scale_dtype!r}; choose one of {', '.join(SCALE_DTYPES)}."
            )
        if not self.symmetric and not (self.is_int and self.granularity == "per_token"):
            raise UnsupportedError(
                "asymmetric KV quantization needs an integer dtype (int8/int4) with per_token "
                "granularity (a zero point per token and head); use symmetric: true otherwise."
            )

    # ------------------------------------------------------------ properties
    @property
    def quantized(self) -> bool:
        return self.dtype not in ("fp32", "fp16", "bf16")

    @property
    def is_int(self) -> bool:
        return self.dtype in ("int8", "int4")

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_MAX

    @property
    def dynamic(self) -> bool:
        """Scales computed when a token is written (no calibration)."""
        return self.quantized and self.granularity == "per_token"

    @property
    def static(self) -> bool:
        """Scales calibrated offline and handed to the engine."""
        return self.quantized and not self.dynamic

    @property
    def bits(self) -> int:
        return _BITS[self.dtype]

    @property
    def qmax(self) -> float:
        """Largest representable |q| (symmetric) or top of the range (asymmetric)."""
        if self.is_fp8:
            return FP8_MAX[self.dtype]
        if self.is_int:
            levels = 2**self.bits - 1  # 255 / 15
            return float(levels if not self.symmetric else levels // 2)  # 127 / 7
        raise ValueError("unquantized formats have no qmax")

    @property
    def qmin(self) -> float:
        return 0.0 if not self.symmetric else -self.qmax

    @property
    def storage_dtype(self) -> torch.dtype:
        if self.dtype in _TORCH_DTYPES:
            return _TORCH_DTYPES[self.dtype]
        if self.dtype == "int8" and self.symmetric:
            return torch.int8
        return torch.uint8  # asymmetric int8, and packed int4

    @property
    def scale_torch_dtype(self) -> torch.dtype:
        return _SCALE_TORCH[self.scale_dtype]

    def stored_head_dim(self, head_dim: int) -> int:
        if self.dtype == "int4":
            if head_dim % 2:
                raise UnsupportedError(f"int4 KV packs two values per byte and needs an even head_dim, got {head_dim}.")
            return head_dim // 2
        return head_dim

    def metadata_bytes_per_token_head(self) -> int:
        """Per-token scale (+ zero point) bytes, 0 for static formats."""
        if not self.dynamic:
            return 0
        per = torch.tensor([], dtype=self.scale_torch_dtype).element_size()
        return per * (1 if self.symmetric else 2)

    def bytes_per_token_head(self, head_dim: int) -> float:
        return head_dim * self.bits / 8 + self.metadata_bytes_per_token_head()

    @property
    def name(self) -> str:
        if not self.quantized:
            return self.dtype
        s = f"{self.dtype}-{self.granularity}"
        return s if self.symmetric else s + "-asym"


def kv_bytes_per_token(cfg: ModelConfig, fmt: KVFormat | Sequence[KVFormat], tp: int = 1, pp: int = 1) -> float:
    """KV bytes one token occupies on the most loaded rank (K and V, all its layers).

    `fmt` is one format for every layer or one per layer (runtime/layer_formats.py):
    the sum over a rank's layers of 2 x ceil(kv_heads/tp) x (head_dim x bytes/element +
    scale metadata). Pipeline stages hold consecutive layers, the first `layers % pp`
    stages one more (builder/trtllm/pp_split.py). KV heads are replicated when
    tp > kv_heads (as TensorRT-LLM does), so the per-rank KV never shrinks below one head
    per layer. The planner and the runtime's pool sizing both call this.
    """
    formats = (fmt,) * cfg.num_layers if isinstance(fmt, KVFormat) else tuple(fmt)
    if len(formats) != cfg.num_layers:
        raise ValueError(f"{len(formats)} per-layer KV formats for {cfg.num_layers} layers")
    heads = ceil_div(cfg.num_kv_heads, tp)
    per_layer = [2 * heads * f.bytes_per_token_head(cfg.head_dim) for f in formats]
    base, extra = divmod(cfg.num_layers, pp)
    stages, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        stages.append(sum(per_layer[start:start + size]))
        start += size
    return max(stages)


# ---------------------------------------------------------------- rounding
def _tiny(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).tiny)


def round_up_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Smallest value of `dtype` >= x (x finite), returned in `dtype`."""
    r = x.to(dtype)
    if dtype == x.dtype:
        return r
    return torch.where(r.to(x.dtype) < x, torch.nextafter(r, torch.full_like(r, float("inf"))), r)


def round_down_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest value of `dtype` <= x (x finite), returned in `dtype`."""
    r = x.to(dtype)
    if dtype == x.dtype:
        return r
    return torch.where(r.to(x.dtype) > x, torch.nextafter(r, torch.full_like(r, float("-inf"))), r)


# ------------------------------------------------------------------ scales
def static_scale_from_amax(amax: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Calibrated dequantization scale s = amax / qmax (fp32), never zero."""
    if not fmt.static:
        raise ValueError(f"{fmt.name} has no static scales")
    s = amax.to(torch.float32) / fmt.qmax
    return s.clamp_min(_tiny(torch.float32))


def dynamic_scales(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-(token, head) scale and zero point for x[..., head_dim], in fmt.scale_dtype.

    Symmetric: s = amax / qmax rounded up. Asymmetric: zero = min rounded down,
    s = (max - zero) / qmax rounded up, so [min, max] fits in [0, qmax].
    NaNs are left out of amax / min / max (quantize stores them as 0), so one NaN
    does not turn its token's scale into NaN -- as the GPU's min/max instructions do.
    """
    if not fmt.dynamic:
        raise ValueError(f"{fmt.name} has no dynamic scales")
    xf = x.to(torch.float32)
    nan = xf.isnan()
    sd = fmt.scale_torch_dtype
    # Clamp to the scale dtype's finite range: a token beyond max * qmax saturates
    # (like a static scale clips) instead of storing an inf scale that dequantizes to NaN.
    big = float(torch.finfo(sd).max)
    if fmt.symmetric:
        s = xf.abs().masked_fill(nan, 0.0).amax(dim=-1) / fmt.qmax
        return round_up_to(s.clamp(_tiny(sd), big), sd), None
    zero = round_down_to(xf.masked_fill(nan, float("inf")).amin(dim=-1).clamp(-big, big), sd)
    s = (xf.masked_fill(nan, float("-inf")).amax(dim=-1) - zero.to(torch.float32)) / fmt.qmax
    return round_up_to(s.clamp(_tiny(sd), big), sd), zero


# ------------------------------------------------------------ int4 packing
def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 2n] values in 0..15 -> [..., n] uint8 (even index in the low nibble)."""
    n = nibbles.to(torch.uint8)
    return n[..., 0::2] | (n[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2n] uint8 values in 0..15."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ------------------------------------------------------- quantize / dequant
def _expand(t: torch.Tensor | None) -> torch.Tensor | None:
    """Scales are shaped like x[..., :-1] (or broadcast to it): add the head_dim axis."""
    if t is None:
        return None
    t = t.to(torch.float32)
    return t.unsqueeze(-1) if t.dim() else t


def quantize(
    x: torch.Tensor, fmt: KVFormat, scale: torch.Tensor | None = None, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """x[..., head_dim] -> storage tensor (packed for int4).

    `scale`/`zero` broadcast to x.shape[:-1]: a scalar (per_tensor), [kv_heads]
    (per_head, x laid out [..., kv_heads, head_dim]) or [..., kv_heads] (per_token).
    """
    if not fmt.quantized:
        return x.to(fmt.storage_dtype)
    if scale is None:
        raise ValueError(f"{fmt.name} needs a scale")
    y = x.to(torch.float32)
    if zero is not None:
        y = y - _expand(zero)
    y = torch.nan_to_num(y / _expand(scale), nan=0.0)
    y = y.clamp(fmt.qmin, fmt.qmax)
    if fmt.is_fp8:
        return y.to(fmt.storage_dtype)  # the cast rounds to nearest even
    q = torch.round(y)  # round half to even
    if fmt.dtype == "int8":
        return q.to(fmt.storage_dtype)
    nib = q + 8 if fmt.symmetric else q
    return pack_int4(nib)


def dequantize(
    q: torch.Tensor,
    fmt: KVFormat,
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of quantize: storage -> values in `dtype` (x ~= q * s + zero)."""
    if not fmt.quantized:
        return q.to(dtype)
    if fmt.dtype == "int4":
        v = unpack_int4(q).to(torch.float32)
        if fmt.symmetric:
            v = v - 8
    else:
        v = q.to(torch.float32)
    v = v * _expand(scale)
    if zero is not None:
        v = v + _expand(zero)
    return v.to(dtype)


def quantize_dynamic(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token write: (storage, scale, zero) for x[..., head_dim]."""
    scale, zero = dynamic_scales(x, fmt)
    return quantize(x, fmt, scale, zero), scale, zero
