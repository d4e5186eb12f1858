"""Decode attention for the mixed formats (`formats.served_by_mixed`): K and V with their own dtype, group
scales, e8m0 scales.

A program takes one (sequence, KV head, split) and walks its tokens in tiles of BLOCK_N, the GQA group's query
heads padded to BLOCK_H rows of the tensor-core tile. Each side is read with its own compile-time format, in its
stored columns (an int4 byte holds columns 2j and 2j + 1: the low and the high nibbles are two tiles, as in the
other decode kernels, so nothing is interleaved in registers):

* K enters the dots as its raw stored values (int8, int4 nibbles, fp8: exact in fp16 / bf16) against q's
  matching columns (even and odd for int4), and its scales act on the scores: per group g of GS channels,
  s += k_scale[n, g] * (q_g . k_n,g) (+ k_zero[n, g] * sum(q_g) for asymmetric K), one dot a group and nibble
  half, so the dots stay exact;
* V is dequantized in fp32 (raw * scale + zero, each column with its group's scale) before the p . V dots (two
  for int4: the even and the odd output columns).

An fp32 online softmax in exp2 units, and split-K partials in the layout `split_k.merge_splits` reads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import codes
from .dequant import _dot, _operand
from .group_io import _program_tokens, _softmax_step


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
def _group_of(s, KIND: tl.constexpr, GS: tl.constexpr):
    """The scale group of stored column s (an int4 byte's two columns share one: group sizes are even)."""
    if KIND == codes.INT4:
        g = (2 * s) // GS
    else:
        g = s // GS
    return g


@triton.jit
def _halves(C, base, nmask, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, KIND: tl.constexpr,
            ASYM: tl.constexpr):
    """A token tile's stored values as fp32 [BLOCK_N, BLOCK_S] (exact): int4 its low and high nibbles (the even
    and the odd columns), the other kinds the values twice."""
    s = tl.arange(0, BLOCK_S)
    if KIND == codes.INT4:
        raw = tl.load(C + base[:, None] + s[None, :], mask=nmask[:, None] & (s < HEAD_DIM // 2)[None, :], other=0)
        a = (raw & 0xF).to(tl.int32)
        b = (raw >> 4).to(tl.int32)
        if not ASYM:
            a -= 8
            b -= 8
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    else:
        a = tl.load(C + base[:, None] + s[None, :], mask=nmask[:, None] & (s < HEAD_DIM)[None, :],
                    other=0.0).to(tl.float32)
        b = a
    return a, b


@triton.jit
def _per_channel(P, meta, nmask, GROUPS: tl.constexpr, STORED: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_N: tl.constexpr, KIND: tl.constexpr, GS: tl.constexpr, SCALE_DT: tl.constexpr):
    """Each stored column's group value (scale or zero point) of the tile's tokens, [BLOCK_N, BLOCK_S] fp32."""
    if GROUPS == 1:
        out = tl.broadcast_to(_load_meta(P, meta, nmask, SCALE_DT)[:, None], (BLOCK_N, BLOCK_S))
    elif BLOCK_S == STORED and (GROUPS & (GROUPS - 1)) == 0:  # [N, G] loaded once, broadcast over each group
        g = tl.arange(0, GROUPS)
        vals = _load_meta(P, meta[:, None] * GROUPS + g[None, :], nmask[:, None], SCALE_DT)
        out = tl.reshape(tl.broadcast_to(vals[:, :, None], (BLOCK_N, GROUPS, STORED // GROUPS)), (BLOCK_N, BLOCK_S))
    else:  # head dims that are not powers of two: each column reads its group's value
        grp = tl.minimum(_group_of(tl.arange(0, BLOCK_S), KIND, GS), GROUPS - 1)
        out = _load_meta(P, meta[:, None] * GROUPS + grp[None, :], nmask[:, None], SCALE_DT)
    return out


@triton.jit
def _q_columns(Q, q_row, hmask, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, KIND: tl.constexpr):
    """q in K's stored columns as fp32 [BLOCK_H, BLOCK_S]: for int4 the even and the odd columns."""
    s = tl.arange(0, BLOCK_S)
    if KIND == codes.INT4:
        m = hmask[:, None] & (s < HEAD_DIM // 2)[None, :]
        qa = tl.load(Q + q_row[:, None] + 2 * s[None, :], mask=m, other=0.0).to(tl.float32)
        qb = tl.load(Q + q_row[:, None] + 2 * s[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    else:
        qa = tl.load(Q + q_row[:, None] + s[None, :], mask=hmask[:, None] & (s < HEAD_DIM)[None, :],
                     other=0.0).to(tl.float32)
        qb = qa
    return qa, qb


# ints that change step to step add no compiled variants while serving (runtime/warmup.py)
@triton.jit(do_not_specialize=["num_splits", "stride_btb"])
def _decode_mixed_kernel(
    Q, K, V, KS, VS, KZ, VZ, BT, SEQ, OUT, PM, PL, PACC,
    qk_scale, tokens_per_split, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_btb,
    stride_kcb, stride_kch, stride_kct, stride_vcb, stride_vch, stride_vct, stride_mb, stride_mh,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SK: tl.constexpr, BLOCK_SV: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT: tl.constexpr,
    K_KIND: tl.constexpr, K_ASYM: tl.constexpr, K_GROUPS: tl.constexpr,
    V_KIND: tl.constexpr, V_ASYM: tl.constexpr, V_GROUPS: tl.constexpr, SCALE_DT: tl.constexpr,
):
    b, kvh, sp, start, end = _program_tokens(SEQ, tokens_per_split)
    dt = Q.dtype.element_ty
    rows = tl.arange(0, BLOCK_H)
    hmask = rows < GROUP
    heads = kvh * GROUP + rows
    K_INT4: tl.constexpr = K_KIND == codes.INT4
    V_INT4: tl.constexpr = V_KIND == codes.INT4
    K_GS: tl.constexpr = HEAD_DIM // K_GROUPS
    V_GS: tl.constexpr = HEAD_DIM // V_GROUPS
    V_STORED: tl.constexpr = HEAD_DIM // 2 if V_INT4 else HEAD_DIM
    qa, qb = _q_columns(Q, b * stride_qb + heads * stride_qh, hmask, HEAD_DIM, BLOCK_SK, K_KIND)
    k_grp = _group_of(tl.arange(0, BLOCK_SK), K_KIND, K_GS)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)  # finite: a split with no tokens keeps p = 0, not NaN
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros([BLOCK_H, BLOCK_SV], tl.float32)
    acc_b = acc_a
    bt_row = BT + b * stride_btb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        meta = page * stride_mb + kvh * stride_mh + slot
        ka, kb = _halves(K, page * stride_kcb + kvh * stride_kch + slot * stride_kct, nmask, HEAD_DIM, BLOCK_SK,
                         K_KIND, K_ASYM)
        va, vb = _halves(V, page * stride_vcb + kvh * stride_vch + slot * stride_vct, nmask, HEAD_DIM, BLOCK_SV,
                         V_KIND, V_ASYM)
        kat = tl.trans(_operand(ka, dt, DOT))
        kbt = tl.trans(_operand(kb, dt, DOT))
        s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        for g in tl.static_range(K_GROUPS):
            if K_GROUPS == 1:
                qga = qa
                qgb = qb
            else:
                ing = (k_grp == g)[None, :]
                qga = tl.where(ing, qa, 0.0)
                qgb = tl.where(ing, qb, 0.0)
            dots = _dot(_operand(qga, dt, DOT), kat, DOT)
            qsum = tl.sum(qga, 1)
            if K_INT4:
                dots += _dot(_operand(qgb, dt, DOT), kbt, DOT)
                qsum += tl.sum(qgb, 1)
            s += dots * _load_meta(KS, meta * K_GROUPS + g, nmask, SCALE_DT)[None, :]
            if K_ASYM:
                s += qsum[:, None] * _load_meta(KZ, meta * K_GROUPS + g, nmask, SCALE_DT)[None, :]
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
        pd = _operand(p, dt, DOT)
        vs = _per_channel(VS, meta, nmask, V_GROUPS, V_STORED, BLOCK_SV, BLOCK_N, V_KIND, V_GS, SCALE_DT)
        if V_ASYM:
            vz = _per_channel(VZ, meta, nmask, V_GROUPS, V_STORED, BLOCK_SV, BLOCK_N, V_KIND, V_GS, SCALE_DT)
        else:
            vz = 0.0
        acc_a = acc_a * alpha[:, None] + _dot(pd, _operand(va * vs + vz, dt, DOT), DOT)
        if V_INT4:
            acc_b = acc_b * alpha[:, None] + _dot(pd, _operand(vb * vs + vz, dt, DOT), DOT)
    sv = tl.arange(0, BLOCK_SV)
    if V_INT4:
        cols_a = 2 * sv
    else:
        cols_a = sv
    omask = hmask[:, None] & (sv < V_STORED)[None, :]
    if SPLIT:
        row = (b * NUM_HEADS + heads) * num_splits + sp
        # an empty split (past the sequence's end) reports m = -inf: the merge gives it weight 0
        tl.store(PM + row, tl.where(l_i > 0, m_i, float("-inf")), mask=hmask)
        tl.store(PL + row, l_i, mask=hmask)
        dst = PACC + row[:, None] * HEAD_DIM + cols_a[None, :]
        if PACC.dtype.element_ty == tl.float32:
            wa = acc_a
            wb = acc_b
        else:  # normalized partials in the output's dtype (split_k.partial_dtype)
            inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)[:, None]
            wa = (acc_a * inv).to(PACC.dtype.element_ty)
            wb = (acc_b * inv).to(PACC.dtype.element_ty)
    else:
        dst = OUT + b * stride_ob + heads[:, None] * stride_oh + cols_a[None, :]
        wa = (acc_a / l_i[:, None]).to(OUT.dtype.element_ty)
        wb = (acc_b / l_i[:, None]).to(OUT.dtype.element_ty)
    tl.store(dst, wa, mask=omask)
    if V_INT4:
        tl.store(dst + 1, wb, mask=omask)
