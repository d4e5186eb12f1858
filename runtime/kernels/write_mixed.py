"""Quantize-on-write for the mixed formats (`formats.served_by_mixed`): K and V with their own dtype, group scales,
e8m0 scales.

One program quantizes BLOCK_T tokens of one KV head of one side (program_id 2: 0 = K, 1 = V), each side with its
own compile-time format, so a K8V4 cache is written by one launch. The rounding decisions are
`runtime/kv_quant.py`'s, so the bytes equal `kv_quant.quantize_dynamic`'s:

* scales per token and group of GS channels (GS = head_dim without group scales): s = amax / qmax (asymmetric:
  (max - zero) / qmax, zero = min rounded down) with IEEE division, clamped to the scale dtype's range, rounded up
  to it; e8m0 scales round up to the next power of two (the exponent field, + 0x7FFFFF masked), stored as the
  exponent byte;
* values: (x - zero) / s with IEEE division, NaN -> 0, clamped, rounded half to even (integers) or encoded by the
  integer fp8 encoder (`exact_round._fp8_byte`). On the GPU (FAST, `WritePlan.fast`) the division goes through each
  group's correctly rounded reciprocal and fma corrections (`exact_round._quotient`), integers round with one
  `cvt.rni` and fp8 takes the hardware's conversion: the same bytes, without the ~11 instructions of a `div.rn` per
  value that make the write compute-bound.

Where both sides store fp16 per-token scales from bf16 rows on the GPU (`plan.mixed_row_lanes`), each side keeps
whole rows over a few lanes as the single formats' write does (`write_rows.py`), a group of GS channels over GS / 8
lanes: its min / max in-thread then log2(GS / 8) shuffles, no layout conversion (70-91% of copy on the H200 against
43-58% on the tile; benchmarks/results/write_mixed_rows.md). Elsewhere groups are an axis of the [tokens, head_dim]
tile where head_dim is a power of two (one reduction a row of groups), else a mask over the columns looped over at
compile time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import codes
from .exact_round import _clamp_round, _fp8_byte, _quotient, _reciprocal
from .write_kv import _to_int
from .write_rows import _rows_store_fp8_words, _rows_store_words, _rows_words

E8M0_TINY = tl.constexpr(1.1754943508222875e-38)  # 2**-126: e8m0 scales are kept normal in fp32 (kv_quant.dynamic_scales)
E8M0_BIG = tl.constexpr(1.7014118346046923e38)  # 2**127 (globals in jit code must be constexpr)


@triton.jit
def _round_scale(s, SCALE_DT: tl.constexpr):
    """A per-token scale clamped and rounded up to its storage dtype, as fp32."""
    if SCALE_DT == codes.SCALE_E8M0:
        s = tl.minimum(tl.maximum(s, E8M0_TINY), E8M0_BIG)
        out = ((s.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    else:
        out = _clamp_round(s, SCALE_DT, True)
    return out


@triton.jit
def _store_scale(ptr, off, s, mask, SCALE_DT: tl.constexpr):
    """Store a rounded scale (or zero point): e8m0 as its exponent byte, else in the tensor's dtype."""
    if SCALE_DT == codes.SCALE_E8M0:
        tl.store(ptr + off, (s.to(tl.int32, bitcast=True) >> 23).to(tl.uint8), mask=mask)
    else:
        tl.store(ptr + off, s.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scales_of(x, real, AX: tl.constexpr, ASYM: tl.constexpr, QMAX: tl.constexpr, SCALE_DT: tl.constexpr):
    """Scales (and zero points) of x's rows along axis AX over the entries `real`, rounded to the scale dtype."""
    if ASYM:
        lo = tl.min(tl.where(real, x, float("inf")), AX)
        hi = tl.max(tl.where(real, x, -float("inf")), AX)
        z = _clamp_round(lo, SCALE_DT, False)
        s = _round_scale(tl.math.div_rn(hi - z, tl.full(z.shape, QMAX, tl.float32)), SCALE_DT)
    else:
        amax = tl.max(tl.where(real, tl.abs(x), 0.0), AX)
        s = _round_scale(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), SCALE_DT)
        z = tl.zeros(s.shape, tl.float32)
    return s, z


@triton.jit
def _per_channel(t, BLOCK_T: tl.constexpr, GROUPS: tl.constexpr, GS: tl.constexpr):
    """[BLOCK_T, GROUPS] -> [BLOCK_T, GROUPS * GS]: each group's value on each of its channels."""
    return tl.reshape(tl.broadcast_to(t[:, :, None], (BLOCK_T, GROUPS, GS)), (BLOCK_T, GROUPS * GS))


@triton.jit
def _group_scales(x, real, S, Z, meta, mask_t, BLOCK_T: tl.constexpr, ASYM: tl.constexpr, QMAX: tl.constexpr,
                  SCALE_DT: tl.constexpr, GROUPS: tl.constexpr, GS: tl.constexpr):
    """Scales and zero points of [BLOCK_T, HEAD_DIM] rows (a power of two) as [BLOCK_T, GROUPS, GS] groups, stored,
    and broadcast back to every channel with the scales' reciprocals: (s', 1 / s', k, zero) of each channel."""
    s, z = _scales_of(tl.reshape(x, (BLOCK_T, GROUPS, GS)), tl.reshape(real, (BLOCK_T, GROUPS, GS)), 2, ASYM, QMAX,
                      SCALE_DT)
    off = meta[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :]
    _store_scale(S, off, s, mask_t[:, None], SCALE_DT)
    if ASYM:
        _store_scale(Z, off, z, mask_t[:, None], SCALE_DT)
    s, y, k = _reciprocal(s, True)  # a tensor k whatever the scale dtype (per group: cheap)
    return (_per_channel(s, BLOCK_T, GROUPS, GS), _per_channel(y, BLOCK_T, GROUPS, GS),
            _per_channel(k, BLOCK_T, GROUPS, GS), _per_channel(z, BLOCK_T, GROUPS, GS))


@triton.jit
def _masked_scales(x, real, S, Z, meta, mask_t, cols, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                   ASYM: tl.constexpr, QMAX: tl.constexpr, SCALE_DT: tl.constexpr, GROUPS: tl.constexpr,
                   GS: tl.constexpr):
    """`_group_scales` for any head_dim (one scale a row without group scales): each group a column mask,
    looped over at compile time, so head dims that are not powers of two need no padding of the group axis."""
    grp = cols // GS
    s_el = tl.full([BLOCK_T, BLOCK_D], 1.0, tl.float32)
    y_el = tl.full([BLOCK_T, BLOCK_D], 1.0, tl.float32)
    k_el = tl.full([BLOCK_T, BLOCK_D], 1.0, tl.float32)
    z_el = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for g in tl.static_range(GROUPS):
        s, z = _scales_of(x, real & (grp == g)[None, :], 1, ASYM, QMAX, SCALE_DT)
        _store_scale(S, meta * GROUPS + g, s, mask_t, SCALE_DT)
        mine = (grp == g)[None, :]
        s, y, k = _reciprocal(s, True)  # a tensor k whatever the scale dtype (per group: cheap)
        s_el = tl.where(mine, s[:, None], s_el)
        y_el = tl.where(mine, y[:, None], y_el)
        k_el = tl.where(mine, k[:, None], k_el)
        if ASYM:
            _store_scale(Z, meta * GROUPS + g, z, mask_t, SCALE_DT)
            z_el = tl.where(mine, z[:, None], z_el)
    return s_el, y_el, k_el, z_el


@triton.jit
def _token_slots(SLOTS, t, num_tokens, BLOCK_SIZE: tl.constexpr):
    """Tokens t's (mask, block, offset) from the slot mapping: negative slots (padding) and t past the write are
    masked off."""
    slot = tl.load(SLOTS + t, mask=t < num_tokens, other=-1)
    mask_t = slot >= 0
    slot = tl.where(mask_t, slot, 0)
    return mask_t, slot // BLOCK_SIZE, slot % BLOCK_SIZE


@triton.jit
def _side_write(
    X, C, S, Z, t, mask_t, head, stride_xt, stride_xh, dst, meta,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr, ASYM: tl.constexpr, FP8: tl.constexpr,
    QMIN: tl.constexpr, QMAX: tl.constexpr, SCALE_DT: tl.constexpr, GROUPS: tl.constexpr, GS: tl.constexpr,
    FAST: tl.constexpr, LANES: tl.constexpr,
):
    """Quantize rows t of one side (K or V) and store values, scales and zero points: on the [tokens, head_dim]
    tile, or with LANES (bf16 rows, fp16 scales, FAST) as whole rows over LANES lanes (`write_rows.py`), where a
    group of GS = 8 LANES channels is one c of the row tile, so its min / max is in-thread then log2(LANES)
    shuffles, as a row's is."""
    if LANES:
        w = _rows_words(X, t, mask_t, head, stride_xt, stride_xh, HEAD_DIM // (8 * LANES), LANES)
        if KIND == codes.FLOAT:
            _rows_store_fp8_words(w, C, S, mask_t, dst, meta, FP8, QMIN, QMAX, GROUPS > 1)
        else:
            _rows_store_words(w, C, S, Z, mask_t, dst, meta, ASYM, QMAX, KIND, GROUPS > 1)
    else:
        _tile_write(X, C, S, Z, t, mask_t, head, stride_xt, stride_xh, dst, meta, HEAD_DIM, BLOCK_D, KIND, ASYM,
                    FP8, QMIN, QMAX, SCALE_DT, GROUPS, GS, FAST)


@triton.jit
def _tile_write(
    X, C, S, Z, t, mask_t, head, stride_xt, stride_xh, dst, meta,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr, ASYM: tl.constexpr, FP8: tl.constexpr,
    QMIN: tl.constexpr, QMAX: tl.constexpr, SCALE_DT: tl.constexpr, GROUPS: tl.constexpr, GS: tl.constexpr,
    FAST: tl.constexpr,
):
    """`_side_write` on the [tokens, head_dim] tile."""
    BLOCK_T: tl.constexpr = t.shape[0]
    cols = tl.arange(0, BLOCK_D)
    m2 = mask_t[:, None] & (cols < HEAD_DIM)[None, :]
    x = tl.load(X + t[:, None] * stride_xt + head * stride_xh + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    real = m2 & (x == x)  # NaNs stay out of the reductions (kv_quant.dynamic_scales)
    if BLOCK_D == HEAD_DIM and GROUPS > 1:  # the groups as an axis: one reduction over each group's channels
        s_el, y_el, k_el, z_el = _group_scales(x, real, S, Z, meta, mask_t, BLOCK_T, ASYM, QMAX, SCALE_DT, GROUPS,
                                               GS)
    else:
        s_el, y_el, k_el, z_el = _masked_scales(x, real, S, Z, meta, mask_t, cols, BLOCK_T, BLOCK_D, ASYM, QMAX,
                                                SCALE_DT, GROUPS, GS)
    q = _quotient(x - z_el, s_el, y_el, k_el, FAST)
    if KIND == codes.FLOAT:
        tl.store(C + dst[:, None] + cols[None, :], _fp8_byte(q, FP8, QMIN, QMAX), mask=m2)
    elif KIND == codes.INT8:
        n = _to_int(q, QMIN, QMAX, FAST)
        if ASYM:
            tl.store(C + dst[:, None] + cols[None, :], n.to(tl.uint8), mask=m2)
        else:
            tl.store(C + dst[:, None] + cols[None, :], n.to(tl.int8), mask=m2)
    else:
        n = _to_int(q, QMIN, QMAX, FAST)
        if not ASYM:
            n += 8
        lo, hi = tl.split(tl.reshape(n, (BLOCK_T, BLOCK_D // 2, 2)))  # even column in the low nibble
        half = tl.arange(0, BLOCK_D // 2)
        tl.store(C + dst[:, None] + half[None, :], (lo | (hi << 4)).to(tl.uint8),
                 mask=mask_t[:, None] & (half < HEAD_DIM // 2)[None, :])


# ints that change step to step add no compiled variants while serving (runtime/warmup.py)
@triton.jit(do_not_specialize=["num_tokens"])
def _write_mixed_kernel(
    K, V, KC, VC, KS, VS, KZ, VZ, SLOTS, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kch, stride_kct, stride_vcb, stride_vch, stride_vct, stride_mb, stride_mh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    K_KIND: tl.constexpr, K_ASYM: tl.constexpr, K_FP8: tl.constexpr, K_QMIN: tl.constexpr, K_QMAX: tl.constexpr,
    K_GROUPS: tl.constexpr, V_KIND: tl.constexpr, V_ASYM: tl.constexpr, V_FP8: tl.constexpr,
    V_QMIN: tl.constexpr, V_QMAX: tl.constexpr, V_GROUPS: tl.constexpr, SCALE_DT: tl.constexpr, FAST: tl.constexpr,
    K_LANES: tl.constexpr, V_LANES: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    mask_t, blk, off = _token_slots(SLOTS, t, num_tokens, BLOCK_SIZE)
    meta = blk * stride_mb + head * stride_mh + off
    if tl.program_id(2) == 0:
        _side_write(K, KC, KS, KZ, t, mask_t, head, stride_kt, stride_kh,
                    blk * stride_kcb + head * stride_kch + off * stride_kct, meta, HEAD_DIM, BLOCK_D,
                    K_KIND, K_ASYM, K_FP8, K_QMIN, K_QMAX, SCALE_DT, K_GROUPS, HEAD_DIM // K_GROUPS, FAST, K_LANES)
    else:
        _side_write(V, VC, VS, VZ, t, mask_t, head, stride_vt, stride_vh,
                    blk * stride_vcb + head * stride_vch + off * stride_vct, meta, HEAD_DIM, BLOCK_D,
                    V_KIND, V_ASYM, V_FP8, V_QMIN, V_QMAX, SCALE_DT, V_GROUPS, HEAD_DIM // V_GROUPS, FAST, V_LANES)
