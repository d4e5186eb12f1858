"""KV-cache formats: what a stored K/V element is, and what it costs in bytes.

A format is (dtype, granularity, symmetric, scale dtype, group size), and K and V
may each have their own dtype, symmetry and group size ("K8V4": K int8 per-token,
V int4 per-token asym). `fmt.k` / `fmt.v` are the two sides, each a format with
one dtype; the element-level properties (qmax, storage_dtype, ...) belong to a
side, and a format whose sides differ refuses them. The scale convention
is TensorRT-LLM's: the stored scale *dequantizes*, x ~= q * s (+ zero for
asymmetric integers), with s = amax / qmax.

The reference math that quantizes and dequantizes these formats is
runtime/kv_quant.py.

Storage layout of the paged pool (see kv_cache.py): values
`[num_blocks, kv_heads, block_size, head_dim_stored]`, per-token metadata
`[num_blocks, kv_heads, block_size]`. Heads-major pages keep one KV head's
tokens contiguous, so a decode kernel reads each page of a head as one block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import ModelConfig, ceil_div
from .errors import UnsupportedError

# fp32 is an unquantized reference format (parity tests, calibration baselines);
# fp16/bf16 are the serving baselines.
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
# per_channel (K only): one scale and zero per channel over a block of PER_CHANNEL_TOKENS positions (KIVI),
# computed when the block's last token is written; the block before that lives in fp16 (runtime/channel_keys.py)
GRANULARITIES = ("per_tensor", "per_head", "per_token", "per_channel")
# positions one per-channel scale covers: one paged block, so the engine's block_size must equal it
PER_CHANNEL_TOKENS = 64
# e8m0: a power of two stored as its biased exponent (MX-style), symmetric formats only.
SCALE_DTYPES = ("float16", "bfloat16", "float32", "e8m0")
# channels per scale within a head; 0 = one scale per token-head
GROUP_SIZES = (0, 16, 32, 64, 128)

_TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_SCALE_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "e8m0": torch.float8_e8m0fnu}
_SCALE_SHORT = {"float16": "", "bfloat16": "-sbf16", "float32": "-sfp32", "e8m0": "-se8m0"}
_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "int4": 4}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


@dataclass(frozen=True)
class KVFormat:
    """How one layer's K and V are stored. dtype / granularity / symmetric / group_size are K's, and V's unless
    the v_ fields give V its own (None: same as K); scale_dtype is shared. V has its own granularity only
    beside per-channel keys (k.int4-per_channel-asym+v.int4-per_token-asym)."""

    dtype: str = "fp16"
    granularity: str = "per_tensor"
    symmetric: bool = True
    scale_dtype: str = "float16"  # storage of per_token scales/zeros; static scales are fp32
    group_size: int = 0  # per_token only: one scale (and zero) per group of channels; 0 = per token-head
    v_dtype: str | None = None
    v_symmetric: bool | None = None
    v_group_size: int | None = None
    v_granularity: str | None = None

    def __post_init__(self) -> None:
        if self.split:
            for side, name in ((self.k, "kv.k"), (self.v, "kv.v")):
                if not (side.quantized and (side.dynamic or (name == "kv.k" and side.per_channel_keys))):
                    raise UnsupportedError(
                        f"{name}: a format with different K and V formats needs both quantized with per_token "
                        f"granularity (dynamic scales; K may be int4-per_channel-asym), got {side.name}; use one "
                        "dtype for both otherwise."
                    )
            v = self.v  # V's fields spelled out: one spelling of each format
            for extra, value in (("v_dtype", v.dtype), ("v_symmetric", v.symmetric), ("v_group_size", v.group_size),
                                 ("v_granularity", v.granularity if v.granularity != self.granularity else None)):
                object.__setattr__(self, extra, value)
            return
        for extra in _V_FIELDS:  # V as K's: one spelling of each format
            object.__setattr__(self, extra, None)
        self._check_side()
        if self.granularity == "per_channel":
            raise UnsupportedError(
                "kv.granularity per_channel is a K-side granularity (per-channel scales over a block of keys); "
                "write the format as k.int4-per_channel-asym+v.int4-per_token-asym."
            )

    @classmethod
    def _side_format(cls, dtype: str, granularity: str, symmetric: bool, scale_dtype: str, group_size: int) -> KVFormat:
        """One side (K or V) of a format, checked as a side: a per-channel K exists only as a side."""
        f = object.__new__(cls)
        for name, value in zip(_FIELDS, (dtype, granularity, symmetric, scale_dtype, group_size)):
            object.__setattr__(f, name, value)
        for name in _V_FIELDS:
            object.__setattr__(f, name, None)
        f._check_side()
        return f

    def _check_side(self) -> None:
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
        if self.granularity == "per_channel" and (self.dtype, self.symmetric, self.group_size, self.scale_dtype) != (
                "int4", False, 0, "float16"):
            raise UnsupportedError(
                "per_channel keys are int4, asymmetric, with fp16 scales and zeros and no group size "
                "(k.int4-per_channel-asym); use that spelling."
            )
        if not self.symmetric and not (self.is_int and self.granularity in ("per_token", "per_channel")):
            raise UnsupportedError(
                "asymmetric KV quantization needs an integer dtype (int8/int4) with per_token "
                "granularity (a zero point per token and head); use symmetric: true otherwise."
            )
        if self.group_size not in GROUP_SIZES:
            raise UnsupportedError(
                f"kv.group_size {self.group_size} is not supported; choose one of "
                f"{', '.join(map(str, GROUP_SIZES))} (0: one scale per token-head)."
            )
        if self.group_size and not (self.quantized and self.granularity == "per_token"):
            raise UnsupportedError(
                "kv.group_size: group scales are per-token scales (computed when a token is written); "
                "use granularity: per_token with a quantized dtype, or group_size: 0."
            )
        if self.scale_dtype == "e8m0" and self.dynamic and not self.symmetric:
            raise UnsupportedError(
                "kv.scale_dtype: e8m0 scales are powers of two and cannot hold an asymmetric zero point; "
                "use symmetric: true, or scale_dtype float16 / bfloat16 / float32."
            )

    # ------------------------------------------------------------- K and V
    @property
    def k(self) -> KVFormat:
        """K's format (one dtype)."""
        if self._uniform:
            return self
        return KVFormat._side_format(self.dtype, self.granularity, self.symmetric, self.scale_dtype, self.group_size)

    @property
    def v(self) -> KVFormat:
        """V's format (one dtype)."""
        if self._uniform:
            return self
        return KVFormat._side_format(
            self.dtype if self.v_dtype is None else self.v_dtype,
            self.granularity if self.v_granularity is None else self.v_granularity,
            self.symmetric if self.v_symmetric is None else self.v_symmetric,
            self.scale_dtype,
            self.group_size if self.v_group_size is None else self.v_group_size,
        )

    @property
    def _uniform(self) -> bool:
        return all(getattr(self, f) is None for f in _V_FIELDS)

    @property
    def split(self) -> bool:
        """K and V stored differently."""
        return self.k != self.v

    def side(self, which: str) -> KVFormat:
        """"k" or "v" -> that tensor's format."""
        return self.k if which == "k" else self.v

    def _one(self) -> KVFormat:
        if self.split:
            raise UnsupportedError(
                f"{self.name} stores K and V differently; ask fmt.k or fmt.v for element properties."
            )
        return self

    # ------------------------------------------------------------ properties
    @property
    def quantized(self) -> bool:
        return self.dtype not in ("fp32", "fp16", "bf16")  # a split format's sides are both quantized

    @property
    def is_int(self) -> bool:
        return self._one().dtype in ("int8", "int4")

    @property
    def is_fp8(self) -> bool:
        return self._one().dtype in FP8_MAX

    @property
    def dynamic(self) -> bool:
        """Scales computed when a token is written (no calibration)."""
        return self.quantized and self.granularity == "per_token"

    @property
    def static(self) -> bool:
        """Scales calibrated offline and handed to the engine."""
        return self.quantized and self.granularity in ("per_tensor", "per_head")

    @property
    def per_channel_keys(self) -> bool:
        """K stored with per-channel scales over each block (KIVI), the block being written kept in fp16."""
        return self.granularity == "per_channel"  # K's granularity; only K may be per_channel

    @property
    def bits(self) -> int:
        return _BITS[self._one().dtype]

    @property
    def qmax(self) -> float:
        """Largest representable |q| (symmetric) or top of the range (asymmetric)."""
        self._one()
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
        self._one()
        if self.dtype in _TORCH_DTYPES:
            return _TORCH_DTYPES[self.dtype]
        if self.dtype == "int8" and self.symmetric:
            return torch.int8
        return torch.uint8  # asymmetric int8, and packed int4

    @property
    def scale_torch_dtype(self) -> torch.dtype:
        return _SCALE_TORCH[self.scale_dtype]

    def stored_head_dim(self, head_dim: int) -> int:
        if self._one().dtype == "int4":
            if head_dim % 2:
                raise UnsupportedError(f"int4 KV packs two values per byte and needs an even head_dim, got {head_dim}.")
            return head_dim // 2
        return head_dim

    def groups(self, head_dim: int) -> int:
        """Scales per token-head (1 without group scales)."""
        g = self._one().group_size
        if not g:
            return 1
        if head_dim % g:
            raise UnsupportedError(f"kv.group_size {g} does not divide head_dim {head_dim}; use a divisor of it.")
        return head_dim // g

    def meta_shape(self, num_blocks: int, kv_heads: int, block_size: int, head_dim: int) -> tuple[int, ...]:
        """Shape of a dynamic format's per-token scales (and zero points) in the pool."""
        g = self.groups(head_dim)
        return (num_blocks, kv_heads, block_size) + ((g,) if self.group_size else ())

    def metadata_bytes_per_token_head(self, head_dim: int) -> float:
        """Per-token scale (+ zero point) bytes of one tensor (K or V), 0 for static formats; per-channel keys:
        a block's fp16 scale and zero per channel, over the block's positions."""
        if self.per_channel_keys:
            return 2 * 2 * head_dim / PER_CHANNEL_TOKENS
        if not self.dynamic:
            return 0
        per = torch.tensor([], dtype=self.scale_torch_dtype).element_size()
        return per * (1 if self.symmetric else 2) * self.groups(head_dim)

    def bytes_per_token_head(self, head_dim: int) -> float:
        """K and V bytes of one token-head, metadata included, over 2 (the mean of the two tensors)."""
        if self.split:
            return (self.k.bytes_per_token_head(head_dim) + self.v.bytes_per_token_head(head_dim)) / 2
        return head_dim * self.bits / 8 + self.metadata_bytes_per_token_head(head_dim)

    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per K/V element, metadata included (16 for fp16 KV)."""
        return self.bytes_per_token_head(head_dim) * 8 / head_dim

    @property
    def name(self) -> str:
        if self.split:
            return f"k.{self.k.name}+v.{self.v.name}"
        if not self.quantized:
            return self.dtype
        s = f"{self.dtype}-{self.granularity}"
        s = s if self.symmetric else s + "-asym"
        if self.group_size:
            s += f"-g{self.group_size}"
        return s + (_SCALE_SHORT[self.scale_dtype] if self.dynamic else "")


_FIELDS = ("dtype", "granularity", "symmetric", "scale_dtype", "group_size")
_V_FIELDS = ("v_dtype", "v_symmetric", "v_group_size", "v_granularity")


def format_fields(fmt: KVFormat) -> dict:
    """The fields an engine directory's kv_format.json holds (V's own fields only where they differ)."""
    return {k: v for k, v in dataclasses.asdict(fmt).items() if v is not None}


def format_from_name(name: str) -> KVFormat:
    """The inverse of KVFormat.name: "fp16", "int8-per_head", "int4-per_token-asym-g32-sfp32",
    "k.int8-per_token+v.int4-per_token-asym". Raises UnsupportedError naming the expected form."""
    if "+" in name:
        k_name, _, v_name = name.partition("+")
        if not (k_name.startswith("k.") and v_name.startswith("v.")):
            raise UnsupportedError(f"KV format name {name!r}: a split format is written k.<K format>+v.<V format>.")
        k, v = _side_from_name(k_name[2:]), _side_from_name(v_name[2:])
        if k.scale_dtype != v.scale_dtype or (k.granularity != v.granularity and not k.per_channel_keys):
            raise UnsupportedError(f"KV format name {name!r}: K and V share granularity (K may be per_channel) and "
                                   "scale dtype.")
        return KVFormat(k.dtype, k.granularity, k.symmetric, k.scale_dtype, k.group_size, v.dtype, v.symmetric,
                        v.group_size, v.granularity if v.granularity != k.granularity else None)
    return KVFormat(*_side_fields(name))


def _side_from_name(name: str) -> KVFormat:
    """One side's name ("int4-per_channel-asym", "int4-per_token-asym") -> that side's format."""
    return KVFormat._side_format(*_side_fields(name))


def _side_fields(name: str) -> tuple[str, str, bool, str, int]:
    """(dtype, granularity, symmetric, scale dtype, group size) of a one-sided format name."""
    parts = name.split("-")
    scale = {short[2:]: long for long, short in _SCALE_SHORT.items() if short}.get(parts[-1][1:] if
                                                                                 parts[-1][:1] == "s" else "")
    parts = parts[:-1] if scale else parts
    group = int(parts[-1][1:]) if parts[-1][:1] == "g" and parts[-1][1:].isdigit() else 0
    parts = parts[:-1] if group else parts
    asym = parts[-1] == "asym"
    parts = parts[:-1] if asym else parts
    if len(parts) not in (1, 2):
        raise UnsupportedError(f"KV format name {name!r} is not of the form dtype[-granularity][-asym][-g<group>]"
                               "[-s<scale dtype>], e.g. int8-per_token or int4-per_token-asym-g32.")
    return parts[0], parts[1] if len(parts) == 2 else "per_tensor", not asym, scale or "float16", group


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
    return _most_loaded_stage([2 * heads * f.bytes_per_token_head(cfg.head_dim) for f in formats], pp)


def residual_slots(max_num_seqs: int) -> int:
    """fp16 blocks a per-channel-key layer keeps for blocks still being written: one per sequence (a block opened
    by a chunk that also completes its sequence's previous block waits for that one's slot: kv_cache.ResidualSlots)."""
    return max_num_seqs


def residual_bytes(cfg: ModelConfig, fmt: KVFormat | Sequence[KVFormat], max_num_seqs: int, tp: int = 1,
                   pp: int = 1) -> int:
    """Bytes of the fp16 residual blocks of per-channel-key layers on the most loaded rank (0 for other formats):
    residual_slots(max_num_seqs) x kv_heads x PER_CHANNEL_TOKENS x head_dim x 2 per such layer. The planner and
    the pool (runtime/kv_cache.py) both call this."""
    formats = (fmt,) * cfg.num_layers if isinstance(fmt, KVFormat) else tuple(fmt)
    block = residual_slots(max_num_seqs) * ceil_div(cfg.num_kv_heads, tp) * PER_CHANNEL_TOKENS * cfg.head_dim * 2
    return int(_most_loaded_stage([block if f.per_channel_keys else 0 for f in formats], pp))


def resident_seqs(pool: float, seq_bytes: float, residual_seq: float, max_num_seqs: int) -> int:
    """Sequences of `seq_bytes` pool bytes each that `pool` holds at once, where (per-channel keys) each resident
    sequence, up to max_num_seqs of them, also takes `residual_seq` bytes of fp16 residual blocks: the largest n
    with n * seq_bytes + min(n, max_num_seqs) * residual_seq <= pool. Beyond max_num_seqs the residual is fixed,
    so tokens alone limit n (the planner counts full-length requests past the batch size too)."""
    n = int(max(0.0, pool) // (seq_bytes + residual_seq))
    if n < max_num_seqs:
        return n
    return int(max(0.0, pool - max_num_seqs * residual_seq) // seq_bytes)


def _most_loaded_stage(per_layer: list[float], pp: int) -> float:
    """The largest sum over a pipeline stage's layers: consecutive layers, the first `layers % pp` stages one more."""
    base, extra = divmod(len(per_layer), pp)
    stages, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        stages.append(sum(per_layer[start:start + size]))
        start += size
    return max(stages)


# ---------------------------------------------------------------- rounding
