"""The quantized formats' decode kernel where the Gluon one does not serve (the interpreter, head_dim != 128, fp32 q)
and for static 8-bit formats with few programs: one softmax state per warp (flash-decoding inside a program).

`decode_tiles._decode_kernel` gives the tensor cores a [query heads, tokens]
tile per program: the GQA group (4 heads for Llama-3) is padded to mma's 16 rows,
so Triton spreads the program's warps over the tokens and every row max, row sum
and p crosses warps through shared memory -- 8-10 barriers per tile (SASS,
docs/kernels.md), and the H200 profile is latency-bound.

Here the token tile is [W, NW]: warp w takes NW consecutive tokens of it and keeps
its own running max, sum and accumulator. The products are batched dots over the
leading W axis, which Triton maps one batch per warp, so the softmax reductions are
warp shuffles and the warps meet only at the shared-memory pipeline of the K/V
loads and once at the end, where the W partial states merge exactly like split-K
partials (out = sum_w 2^(m_w - m) acc_w / sum_w 2^(m_w - m) l_w).

With W = 1 (16-token tiles, the default for most formats) a program is one warp:
its state needs no merge and its pipeline barriers span one warp, and 12 programs
share an SM (168 registers), so the split-K rule gives it ~4x the splits.

HEADS_N puts the query heads on the mma N dimension (acc^T = V^T p^T), which pads
a group of 4 to 8 columns instead of 16 rows and halves the accumulator registers
(int4 per-token asym uses it to fit 128 registers); its price: V becomes the
transposed A operand, which Triton 3.6 loads into registers instead of through its
cp.async pipeline, and uses in the same iteration. With heads on M (the static
8-bit default) K and V both go through cp.async, but V, the B operand with its
token axis not contiguous, is read from shared memory one byte per instruction
(widening it before the staging is miscompiled by Triton 3.6:
benchmarks/triton_repro_join_dot3d.py; docs/kernels.md).

Dequantization follows `_decode_kernel` (same helpers, same exact-operand algebra):
raw stored values in the dots, K scales on the scores, static V scales on the
output, per-token V scales on p (P_SCALE) or on V in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import codes
from .dequant import _dot, _operand, _unpack
from .group_io import _group_q, _program_tokens, _static_folds, _store_group, _tile_pages


@triton.jit
def _k_operand(kraw, HALF: tl.constexpr, KIND: tl.constexpr, ASYM: tl.constexpr, ASM_LO: tl.constexpr,
               ASM_HI: tl.constexpr, dt: tl.constexpr, DOT: tl.constexpr):
    return _operand(_unpack(kraw, HALF, KIND, ASYM, ASM_LO, ASM_HI, dt), dt, DOT)


@triton.jit
def _v_operand(vraw, HALF: tl.constexpr, vs, vz, V_TOKEN: tl.constexpr, KIND: tl.constexpr, ASYM: tl.constexpr,
               ASM_LO: tl.constexpr, ASM_HI: tl.constexpr, dt: tl.constexpr, DOT: tl.constexpr):
    """V tile [W, NW, D] as a dot operand; V_TOKEN: per-token scales (and zero points) applied in fp32."""
    v = _unpack(vraw, HALF, KIND, ASYM, ASM_LO, ASM_HI, dt)
    if V_TOKEN:
        v = v.to(tl.float32) * vs[:, :, None]
        if ASYM:
            v += vz[:, :, None]
    return _operand(v, dt, DOT)


@triton.jit
def _tile_ptrs(page, offs_n, end, kvh, stride_cb, stride_ch, stride_ct, offs_d, dmask,
               BLOCK_SIZE: tl.constexpr, FULL_D: tl.constexpr):
    """Offsets and mask of the stored rows of a [W, NW] token tile whose pages are known: [W, NW, BLOCK_D]."""
    nmask = offs_n < end
    slot = offs_n % BLOCK_SIZE
    # rows start 16-byte aligned (strides are multiples of 16 elements), which lets loads vectorize
    base = tl.multiple_of(page.to(tl.int64) * stride_cb + kvh * stride_ch + slot * stride_ct, (16, 16))
    ptr = base[:, :, None] + offs_d[None, None, :]
    if FULL_D:  # no column mask: a mask that varies along head_dim would split the loads
        m3 = nmask[:, :, None]
    else:
        m3 = nmask[:, :, None] & dmask[None, None, :]
    return ptr, m3, slot, nmask


@triton.jit
def _scores(k, qk, HEADS_N: tl.constexpr, DOT: tl.constexpr):
    """Scores of one K half against q: [W, NW, H] with HEADS_N, else [W, H, NW]."""
    if HEADS_N:
        s = _dot(k, qk, DOT)
    else:
        s = _dot(qk, tl.permute(k, (0, 2, 1)), DOT)
    return s


@triton.jit
def _pv(p, v, HEADS_N: tl.constexpr, DOT: tl.constexpr):
    """p . V per warp: [W, D, H] with HEADS_N (p is [W, NW, H]), else [W, H, D]."""
    if HEADS_N:
        o = _dot(tl.permute(v, (0, 2, 1)), p, DOT)
    else:
        o = _dot(p, v, DOT)
    return o


# ints that change step to step add no compiled variants while serving (runtime/warmup.py)
@triton.jit(do_not_specialize=["num_splits", "stride_btb"])
def _decode_kernel_warps(
    Q, K, V, KS, VS, KZ, VZ, BT, SEQ, OUT, PM, PL, PACC,
    qk_scale, tokens_per_split, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_btb,
    stride_cb, stride_ch, stride_ct, stride_mb, stride_mh,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, W: tl.constexpr, NW: tl.constexpr,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, ASYM: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    FULL_D: tl.constexpr, ASM_LO: tl.constexpr, ASM_HI: tl.constexpr,
    DOT_F16: tl.constexpr, P_SCALE: tl.constexpr, HEADS_N: tl.constexpr,
    PAGES_AHEAD: tl.constexpr, WARP_PAGE: tl.constexpr,
):
    b, kvh, sp, start, end = _program_tokens(SEQ, tokens_per_split)
    if DOT_F16:
        dt = tl.float16
    else:
        dt = Q.dtype.element_ty
    V_TOKEN: tl.constexpr = SCALE_MODE == codes.PER_TOKEN and not P_SCALE

    q_a, q_b, qsum, q_pre, heads, hmask, cols_a, cols_b, dmask = _group_q(
        Q, b, kvh, stride_qb, stride_qh, GROUP, BLOCK_H, HEAD_DIM, BLOCK_D, KIND, DOT_F16, dt, DOT)
    offs_d = tl.arange(0, BLOCK_D)
    # every warp multiplies by the same q: [W, D, H] (heads on N) or [W, H, D]
    if HEADS_N:
        qk_a = tl.broadcast_to(tl.trans(q_a)[None, :, :], (W, BLOCK_D, BLOCK_H))
        qk_b = tl.broadcast_to(tl.trans(q_b)[None, :, :], (W, BLOCK_D, BLOCK_H))
    else:
        qk_a = tl.broadcast_to(q_a[None, :, :], (W, BLOCK_H, BLOCK_D))
        qk_b = tl.broadcast_to(q_b[None, :, :], (W, BLOCK_H, BLOCK_D))

    k_fold, v_fold = _static_folds(KS, VS, kvh, qk_scale, q_pre, SCALE_MODE)

    # token axis of the score tile: 1 with heads on N ([W, NW, H]), else 2 ([W, H, NW])
    TAX: tl.constexpr = 1 if HEADS_N else 2
    # a finite start: a warp whose tokens are all masked keeps alpha = 1 and p = 0, not NaN
    m_i = tl.full([W, BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([W, BLOCK_H], tl.float32)
    if HEADS_N:
        acc_a = tl.zeros([W, BLOCK_D, BLOCK_H], tl.float32)
    else:
        acc_a = tl.zeros([W, BLOCK_H, BLOCK_D], tl.float32)
    acc_b = acc_a
    bt_row = BT + b * stride_btb
    tok = tl.arange(0, W)[:, None] * NW + tl.arange(0, NW)[None, :]
    # WARP_PAGE (NW divides the page; tiles start at multiples of W * NW): a warp's tokens share one
    # page, so the block table is read and multiplied out once per warp ([W, 1]), not per token
    if WARP_PAGE:
        ptok = tl.arange(0, W)[:, None] * NW
    else:
        ptok = tok
    if PAGES_AHEAD:  # so the pipeline really buffers num_stages - 1 tiles (group_io._tile_pages)
        page_next = _tile_pages(bt_row, start + ptok, end, BLOCK_SIZE)
    for n0 in range(start, end, W * NW):
        offs_n = n0 + tok
        if PAGES_AHEAD:
            page = page_next
            page_next = _tile_pages(bt_row, n0 + W * NW + ptok, end, BLOCK_SIZE)
        else:
            page = _tile_pages(bt_row, n0 + ptok, end, BLOCK_SIZE)
        ptr, m3, slot, nmask = _tile_ptrs(page, offs_n, end, kvh, stride_cb, stride_ch, stride_ct, offs_d, dmask,
                                          BLOCK_SIZE, FULL_D)
        kraw = tl.load(K + ptr, mask=m3, other=0.0)
        vraw = tl.load(V + ptr, mask=m3, other=0.0)
        page = page.to(tl.int64)
        meta = page * stride_mb + kvh * stride_mh + slot
        vs = 1.0
        vz = 0.0
        if SCALE_MODE == codes.PER_TOKEN:
            vs = tl.load(VS + meta, mask=nmask, other=0.0).to(tl.float32)
            if ASYM:
                vz = tl.load(VZ + meta, mask=nmask, other=0.0).to(tl.float32)

        s = _scores(_k_operand(kraw, 0, KIND, ASYM, ASM_LO, ASM_HI, dt, DOT), qk_a, HEADS_N, DOT)
        if KIND == codes.INT4:
            s += _scores(_k_operand(kraw, 1, KIND, ASYM, ASM_LO, ASM_HI, dt, DOT), qk_b, HEADS_N, DOT)
        if HEADS_N:  # per-token terms broadcast along heads, the last axis
            tmask = nmask[:, :, None]
        else:
            tmask = nmask[:, None, :]
        if SCALE_MODE == codes.PER_TOKEN:
            ks = tl.load(KS + meta, mask=nmask, other=0.0).to(tl.float32)
            if HEADS_N:
                s = s * ks[:, :, None]
            else:
                s = s * ks[:, None, :]
            if ASYM:
                kz = tl.load(KZ + meta, mask=nmask, other=0.0).to(tl.float32)
                if HEADS_N:
                    s += qsum[None, None, :] * kz[:, :, None]
                else:
                    s += qsum[None, :, None] * kz[:, None, :]
        s = tl.where(tmask, s * k_fold, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, TAX))
        alpha = tl.math.exp2(m_i - m_new)
        if HEADS_N:
            p = tl.math.exp2(s - m_new[:, None, :])
        else:
            p = tl.math.exp2(s - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, TAX)
        m_i = m_new

        pw = p
        vs_max = 1.0
        if P_SCALE:  # sum_n p_n s_n v_n with p * s / max(s) in [0, 1] (see _p_operand)
            vs_max = tl.max(vs, 1) + 1e-30  # per warp
            if HEADS_N:
                pw = p * (vs / vs_max[:, None])[:, :, None]
            else:
                pw = p * (vs / vs_max[:, None])[:, None, :]
        pd = _operand(pw, dt, DOT)
        if HEADS_N:
            a_scale = alpha[:, None, :]
        else:
            a_scale = alpha[:, :, None]
        if P_SCALE:
            pv_scale = vs_max[:, None, None]
        else:
            pv_scale = 1.0
        acc_a = acc_a * a_scale + pv_scale * _pv(pd, _v_operand(vraw, 0, vs, vz, V_TOKEN, KIND, ASYM, ASM_LO, ASM_HI, dt, DOT), HEADS_N, DOT)
        if KIND == codes.INT4:
            acc_b = acc_b * a_scale + pv_scale * _pv(pd, _v_operand(vraw, 1, vs, vz, V_TOKEN, KIND, ASYM, ASM_LO, ASM_HI, dt, DOT), HEADS_N, DOT)
        if P_SCALE and ASYM:  # + sum_n p_n z_n, the same for every column
            if HEADS_N:
                pz = tl.sum(p * vz[:, :, None], 1)[:, None, :]
            else:
                pz = tl.sum(p * vz[:, None, :], 2)[:, :, None]
            acc_a += pz
            if KIND == codes.INT4:
                acc_b += pz

    # merge the W warp states (the split-K rule, within the program)
    m_w = tl.max(m_i, 0)
    wgt = tl.math.exp2(m_i - m_w[None, :])
    l_w = tl.sum(l_i * wgt, 0)
    if HEADS_N:
        o_a = tl.trans(tl.sum(acc_a * wgt[:, None, :], 0)) * v_fold
        o_b = tl.trans(tl.sum(acc_b * wgt[:, None, :], 0)) * v_fold
    else:
        o_a = tl.sum(acc_a * wgt[:, :, None], 0) * v_fold
        o_b = tl.sum(acc_b * wgt[:, :, None], 0) * v_fold
    # an empty split (past the sequence's end) reports m = -inf: the merge gives it weight 0
    _store_group(OUT, PM, PL, PACC, o_a, o_b, tl.where(l_w > 0, m_w, float("-inf")), l_w, b, sp, heads, hmask,
                 cols_a, cols_b, dmask, num_splits, stride_ob, stride_oh, NUM_HEADS, HEAD_DIM, KIND, SPLIT)
