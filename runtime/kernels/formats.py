"""What the kernels need to know about a KV format, as compile-time constants.

The kernels specialise on the format through `tl.constexpr` arguments (`codes.py`), so the
branches for other formats compile away. This module turns a `KVFormat` into those constants
(`format_codes`, what the plans are made from) and checks that a cache's tensors have the layout
`runtime/kv_cache.py` allocates (`kernel_format`, before every launch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import UnsupportedError
from ..kv_cache import LayerCache
from ..kv_format import KVFormat
from . import codes

# torch dtype of per-token scales -> its code (`codes.SCALE_FP16` ...)
SCALE_DTYPE_CODES = {torch.float16: codes.SCALE_FP16, torch.bfloat16: codes.SCALE_BF16, torch.float32: codes.SCALE_FP32,
                     torch.float8_e8m0fnu: codes.SCALE_E8M0}
# an fp8 encoding -> the same encoding through the GPU's saturating conversion instruction instead of the encoder
_FP8_HARDWARE = {codes.FP8_E4M3: codes.FP8_E4M3_HW, codes.FP8_E5M2: codes.FP8_E5M2_HW}


def write_fp8(fp8: int, fast: bool) -> int:
    """The write kernels' FP8 code for a format's fp8 encoding (`KernelFormat.fp8`): the hardware conversion under a
    fast plan (the same bytes), else the integer encoder; FP8_NONE stays."""
    return _FP8_HARDWARE.get(fp8, fp8) if fast else fp8


@dataclass(frozen=True)
class KernelFormat:
    kind: int
    scale_mode: int
    asym: bool
    fp8: int
    qmax: float
    qmin: float
    scale_dtype: int  # SCALE_DTYPE_CODES value, meaningful for codes.PER_TOKEN only
    head_dim: int  # logical head dim (stored dim x2 for int4)
    groups: int = 1  # per-token scales per token-head (group scales: head_dim / group_size)


def served_by_mixed(fmt: KVFormat) -> bool:
    """Formats the mixed-format kernels (`write_mixed.py`, `decode_mixed.py`) serve: K and V stored differently,
    group scales, or e8m0 scales (on the GPU the Gluon decode kernel takes those it is written for:
    `plan.mixed_gluon_serves`). The other formats keep their tuned kernels."""
    return fmt.split or (fmt.dynamic and (fmt.group_size > 0 or fmt.scale_dtype == "e8m0"))


def kernel_formats(cache: LayerCache) -> tuple[KernelFormat, KernelFormat]:
    """K's and V's compile-time descriptions (a mixed-format cache: `served_by_mixed`), after checking each
    side's pages and scales."""
    fmt = cache.fmt
    out = []
    for which in ("k", "v"):
        side, pages = fmt.side(which), getattr(cache, which)
        if pages.dim() != 4 or pages.dtype != side.storage_dtype or not pages.is_contiguous():
            raise ValueError(f"cache {which} must be contiguous {side.storage_dtype} pages [num_blocks, kv_heads, "
                             f"block_size, head_dim] (kv_cache.allocate_layer), got {pages.dtype} "
                             f"{tuple(pages.shape)}")
        head_dim = pages.shape[-1] * (2 if side.dtype == "int4" else 1)
        want = side.meta_shape(*pages.shape[:3], head_dim)
        names = [f"{which}_scale"] + ([f"{which}_zero"] if not side.symmetric else [])
        for name in names:
            t = getattr(cache, name)
            if t is None or tuple(t.shape) != want or t.dtype != side.scale_torch_dtype or t.device != pages.device \
                    or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {side.scale_torch_dtype} tensor of shape {want} on "
                                 f"{pages.device} (kv_cache.allocate_layer)")
        out.append(format_codes(side, head_dim))
    if out[0].head_dim != out[1].head_dim or cache.k.shape[:3] != cache.v.shape[:3] or cache.k.device != cache.v.device:
        raise ValueError(f"cache k {tuple(cache.k.shape)} and v {tuple(cache.v.shape)} must hold the same tokens "
                         "of one head_dim on one device")
    return out[0], out[1]


def kernel_format(cache: LayerCache) -> KernelFormat:
    """Compile-time description of `cache`, after checking its tensors."""
    fmt = cache.fmt
    if served_by_mixed(fmt):
        raise ValueError(f"{fmt.name} runs on the mixed-format kernels: use kernel_formats(cache)")
    k, v = cache.k, cache.v
    if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(f"cache k {tuple(k.shape)}/{k.dtype} and v {tuple(v.shape)}/{v.dtype} must match")
    if k.dim() != 4:
        raise ValueError(
            f"cache pages must be [num_blocks, kv_heads, block_size, head_dim], got shape {tuple(k.shape)}"
        )
    if k.dtype != fmt.storage_dtype:
        raise ValueError(f"cache holds {k.dtype} but format {fmt.name} stores {fmt.storage_dtype}")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("cache pages must be contiguous tensors (allocate them with kv_cache.allocate_layer)")
    kf = format_codes(fmt, k.shape[-1] * (2 if fmt.dtype == "int4" else 1))
    _check_scales(cache, kf.scale_mode)
    return kf


@functools.cache
def format_codes(fmt: KVFormat, head_dim: int) -> KernelFormat:
    """The kernels' constants for a KV format of one dtype (no cache needed: plans are made from the format alone);
    a format whose K and V differ has one for each side (`fmt.k`, `fmt.v`)."""
    kind = codes.INT4 if fmt.dtype == "int4" else codes.INT8 if fmt.dtype == "int8" else codes.FLOAT
    if not fmt.quantized:
        mode = codes.NO_SCALE
    elif fmt.dynamic:
        mode = codes.PER_TOKEN
    else:
        mode = codes.PER_TENSOR if fmt.granularity == "per_tensor" else codes.PER_HEAD
    fp8 = {"fp8_e4m3": codes.FP8_E4M3, "fp8_e5m2": codes.FP8_E5M2}.get(fmt.dtype, codes.FP8_NONE)
    return KernelFormat(
        kind=kind,
        scale_mode=mode,
        asym=not fmt.symmetric,
        fp8=fp8,
        qmax=fmt.qmax if fmt.quantized else 0.0,
        qmin=fmt.qmin if fmt.quantized else 0.0,
        scale_dtype=SCALE_DTYPE_CODES[fmt.scale_torch_dtype],
        head_dim=head_dim,
        groups=fmt.groups(head_dim) if fmt.dynamic else 1,
    )


def _check_scales(cache: LayerCache, mode: int) -> None:
    nb, heads, bs, _ = cache.k.shape
    want = {
        codes.NO_SCALE: None,
        codes.PER_TENSOR: (),
        codes.PER_HEAD: (heads,),
        codes.PER_TOKEN: (nb, heads, bs),
    }[mode]
    if want is None:
        return
    names = ["k_scale", "v_scale"] + (["k_zero", "v_zero"] if not cache.fmt.symmetric else [])
    dtype = cache.fmt.scale_torch_dtype if mode == codes.PER_TOKEN else torch.float32
    for name in names:
        t = getattr(cache, name)
        if t is None:
            raise ValueError(f"{cache.fmt.name} cache has no {name}; allocate it with kv_cache.allocate_layer")
        if tuple(t.shape) != want or t.dtype != dtype or t.device != cache.k.device or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {dtype} tensor of shape {want} on {cache.k.device}, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )


Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_q(q: torch.Tensor, kf: KernelFormat, kv_heads: int, rows: str) -> None:
    """q [rows, heads, head_dim] in a float dtype, heads a multiple of the cache's KV heads."""
    if q.dim() != 3 or q.shape[2] != kf.head_dim:
        raise ValueError(f"q must be [{rows}, heads, {kf.head_dim}], got {tuple(q.shape)}")
    if q.shape[1] % kv_heads:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of the cache's {kv_heads} KV heads")
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"q must be fp16/bf16/fp32, got {q.dtype}")


def check_decode_inputs(q: torch.Tensor, cache: LayerCache, kf: KernelFormat, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor) -> None:
    """Decode's q [batch, heads, head_dim] for `cache` (kf: its K side), block tables int32 [batch, max_blocks]
    and lengths int32 [batch], on one device the kernels run on, or an error naming them."""
    check_device(q, cache.k, block_tables, seq_lens)
    check_q(q, kf, cache.k.shape[1], "batch")
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [{batch}, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")


def check_write_inputs(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                       head_dim: int) -> None:
    """The write's k, v [tokens, kv_heads, head_dim] of one float dtype and slot_mapping int64 [tokens] for
    `cache`, on one device the kernels run on, or an error naming them."""
    check_device(cache.k, k, v, slot_mapping)
    heads = cache.k.shape[1]
    if k.dim() != 3 or k.shape != v.shape or k.shape[1] != heads or k.shape[2] != head_dim:
        raise ValueError(f"k and v must both be [tokens, {heads}, {head_dim}] for this cache, "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0] or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if k.dtype not in Q_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"k and v must share a float dtype (fp16/bf16/fp32), got {k.dtype} and {v.dtype}")


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA, or on CPU under the Triton interpreter (tests)."""
    import triton  # noqa: F401  (imported for knobs)
    from triton import knobs

    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {dev} and {t.device}")
    if dev.type != "cuda" and not knobs.runtime.interpret:
        raise UnsupportedError(
            f"the Triton KV kernels run on CUDA tensors, got {dev}; use runtime/attention.py's reference "
            "path on CPU, or set TRITON_INTERPRET=1 before importing runtime.kernels (tests)."
        )


def scale_tensors(cache: LayerCache, stand_in: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(k_scale, v_scale, k_zero, v_zero) for a launch; `stand_in` replaces the absent ones (the
    kernels' constexpr branches never touch them)."""
    return tuple(t if t is not None else stand_in for t in (cache.k_scale, cache.v_scale, cache.k_zero, cache.v_zero))


def meta_strides(kf: KernelFormat, cache: LayerCache) -> tuple[int, int]:
    """Block and KV-head strides of per-token scales / zero points [blocks, kv_heads, block_size]; (0, 0) otherwise."""
    _, kv_heads, bs, _ = cache.k.shape
    return (kv_heads * bs, bs) if kf.scale_mode == codes.PER_TOKEN else (0, 0)


def out_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype an attention kernel writes: q's, except that the interpreter truncates fp32 -> bf16
    casts, so there the kernel writes fp32 and torch rounds."""
    from triton import knobs

    return torch.float32 if (knobs.runtime.interpret and q_dtype == torch.bfloat16) else q_dtype
