"""Decode attention for the mixed formats (`formats.served_by_mixed`): K and V with their own dtype, group
scales, e8m0 scales.

A program takes one (sequence, KV head, split) and walks its tokens in tiles of BLOCK_N, the GQA group's query
heads padded to BLOCK_H rows of the tensor-core tile. Each side is read with its own compile-time format:

* K enters the dots as its raw stored values (int8, int4 nibbles, fp8: exact in fp16 / bf16), and its scales
  act on the scores: per group g of GS channels, s += k_scale[n, g] * (q_g . k_n,g) (+ k_zero[n, g] * sum(q_g)
  for asymmetric K), one dot a group (one for per-token K), so the dots stay exact;
* V is dequantized in fp32 (raw * scale + zero, each column with its group's scale) before the p . V dot.

An fp32 online softmax in exp2 units, and split-K partials in the layout `split_k.merge_splits` reads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import codes
from .dequant import _dot, _operand
from .group_io import _program_tokens


@triton.jit
def _load_meta(P, off, mask, SCALE_DT: tl.constexpr):
    """Per-token scales or zero points as fp32 (e8m0: the exponent byte into fp32's exponent field)."""
    if SCALE_DT == codes.SCALE_E8M0:
        b = tl.load(P + off, mask=mask, other=0).to(tl.int32)
        out = (b << 23).to(tl.float32, bitcast=True)
    else:
        out = tl.load(P + off, mask=mask, other=0.0).to(tl.float32)
    return out


@triton.jit
def _per_channel(P, meta, nmask, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 SCALE_DT: tl.constexpr, x):
    """x [BLOCK_N, BLOCK_D] times (or, for zero points, plus) its tokens' group values P[meta, g] -- see
    the V dequantization; returns the values broadcast to x's shape."""
    BLOCK_N: tl.constexpr = x.shape[0]
    if GROUPS == 1:
        out = tl.broadcast_to(_load_meta(P, meta, nmask, SCALE_DT)[:, None], (BLOCK_N, BLOCK_D))
    elif BLOCK_D == HEAD_DIM and (GROUPS & (GROUPS - 1)) == 0:  # [N, G] loaded once, broadcast over the group
        g = tl.arange(0, GROUPS)
        vals = _load_meta(P, meta[:, None] * GROUPS + g[None, :], nmask[:, None], SCALE_DT)
        out = tl.reshape(tl.broadcast_to(vals[:, :, None], (BLOCK_N, GROUPS, HEAD_DIM // GROUPS)),
                         (BLOCK_N, BLOCK_D))
    else:  # head dims that are not powers of two: each column reads its group's value
        cols = tl.arange(0, BLOCK_D)
        grp = tl.minimum(cols // (HEAD_DIM // GROUPS), GROUPS - 1)
        out = _load_meta(P, meta[:, None] * GROUPS + grp[None, :], nmask[:, None], SCALE_DT)
    return out


@triton.jit
def _raw_tile(C, base, nmask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr,
              ASYM: tl.constexpr):
    """Stored values of a token tile as fp32 [BLOCK_N, BLOCK_D] (exact): int4 nibbles unpacked, even column low."""
    BLOCK_N: tl.constexpr = nmask.shape[0]
    if KIND == codes.INT4:
        half = tl.arange(0, BLOCK_D // 2)
        raw = tl.load(C + base[:, None] + half[None, :], mask=nmask[:, None] & (half < HEAD_DIM // 2)[None, :],
                      other=0)
        lo = (raw & 0xF).to(tl.int32)
        hi = (raw >> 4).to(tl.int32)
        if not ASYM:
            lo -= 8
            hi -= 8
        out = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_D)).to(tl.float32)
    else:
        cols = tl.arange(0, BLOCK_D)
        out = tl.load(C + base[:, None] + cols[None, :], mask=nmask[:, None] & (cols < HEAD_DIM)[None, :],
                      other=0.0).to(tl.float32)
    return out


@triton.jit
def _decode_mixed_kernel(
    Q, K, V, KS, VS, KZ, VZ, BT, SEQ, OUT, PM, PL, PACC,
    qk_scale, tokens_per_split, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_btb,
    stride_kcb, stride_kch, stride_kct, stride_vcb, stride_vch, stride_vct, stride_mb, stride_mh,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    K_KIND: tl.constexpr, K_ASYM: tl.constexpr, K_GROUPS: tl.constexpr,
    V_KIND: tl.constexpr, V_ASYM: tl.constexpr, V_GROUPS: tl.constexpr, SCALE_DT: tl.constexpr,
):
    b, kvh, sp, start, end = _program_tokens(SEQ, tokens_per_split)
    dt = Q.dtype.element_ty
    rows = tl.arange(0, BLOCK_H)
    hmask = rows < GROUP
    heads = kvh * GROUP + rows
    cols = tl.arange(0, BLOCK_D)
    dmask = cols < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + cols[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    qf = q.to(tl.float32)
    K_GS: tl.constexpr = HEAD_DIM // K_GROUPS
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)  # finite: a split with no tokens keeps p = 0, not NaN
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    bt_row = BT + b * stride_btb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        meta = page * stride_mb + kvh * stride_mh + slot
        kraw = _raw_tile(K, page * stride_kcb + kvh * stride_kch + slot * stride_kct, nmask, HEAD_DIM, BLOCK_D,
                         K_KIND, K_ASYM)
        vraw = _raw_tile(V, page * stride_vcb + kvh * stride_vch + slot * stride_vct, nmask, HEAD_DIM, BLOCK_D,
                         V_KIND, V_ASYM)
        kt = tl.trans(_operand(kraw, dt, DOT))
        s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        for g in tl.static_range(K_GROUPS):
            if K_GROUPS == 1:
                qg = q
                qsum = tl.sum(qf, 1)
            else:
                ing = ((cols // K_GS) == g)[None, :]
                qg = tl.where(ing, q, 0.0)
                qsum = tl.sum(tl.where(ing, qf, 0.0), 1)
            ks = _load_meta(KS, meta * K_GROUPS + g, nmask, SCALE_DT)
            s += _dot(_operand(qg, dt, DOT), kt, DOT) * ks[None, :]
            if K_ASYM:
                s += qsum[:, None] * _load_meta(KZ, meta * K_GROUPS + g, nmask, SCALE_DT)[None, :]
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        v = vraw * _per_channel(VS, meta, nmask, V_GROUPS, HEAD_DIM, BLOCK_D, SCALE_DT, vraw)
        if V_ASYM:
            v += _per_channel(VZ, meta, nmask, V_GROUPS, HEAD_DIM, BLOCK_D, SCALE_DT, vraw)
        acc = acc * alpha[:, None] + _dot(_operand(p, dt, DOT), _operand(v, dt, DOT), DOT)
    omask = hmask[:, None] & dmask[None, :]
    if SPLIT:
        row = (b * NUM_HEADS + heads) * num_splits + sp
        # an empty split (past the sequence's end) reports m = -inf: the merge gives it weight 0
        tl.store(PM + row, tl.where(l_i > 0, m_i, float("-inf")), mask=hmask)
        tl.store(PL + row, l_i, mask=hmask)
        if PACC.dtype.element_ty == tl.float32:
            part = acc
        else:  # normalized partials in the output's dtype (split_k.partial_dtype)
            part = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(PACC + row[:, None] * HEAD_DIM + cols[None, :], part.to(PACC.dtype.element_ty), mask=omask)
    else:
        out = acc / l_i[:, None]
        tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + cols[None, :], out.to(OUT.dtype.element_ty),
                 mask=omask)
