"""What a decode program reads and writes for its query-head group, the same in both kernels, and the online
softmax step the chunked-prefill and mixed-format kernels take over a score tile.

A program of `decode_tiles._decode_kernel` or `decode_warps._decode_kernel_warps`
serves the GROUP query heads of one KV head: it loads their q rows, folds the static
K/V scales into the softmax scale and the output, and writes either the finished output
or a split-K partial (m, l, acc or o / l) for `split_k.merge_splits`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import codes
from .dequant import _operand


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax over one score tile [ROWS, BLOCK_N]: (new max, new sum, rescale of acc, p in fp32)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _program_tokens(SEQ, tokens_per_split):
    """The (sequence, KV head, split) this program serves and the split's token range [start, end)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(SEQ + b)
    start = sp * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    return b, kvh, sp, start, end


@triton.jit
def _tile_pages(bt_row, offs_n, end, BLOCK_SIZE: tl.constexpr):
    """Block-table entries of a token tile (any shape; 0 past the split's end).

    Both kernels load a tile's pages one iteration ahead of its K/V: when the K/V addresses
    come from a load in the same iteration, Triton 3.6's pipeliner gives K and V a single
    shared-memory buffer whatever num_stages says (one tile in flight per program); from a
    loop-carried value they get num_stages - 1 buffers (sm_90 TTGIR; docs/kernels.md).
    """
    return tl.load(bt_row + offs_n // BLOCK_SIZE, mask=offs_n < end, other=0)


@triton.jit
def _stored_columns(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr):
    """Stored columns of a page row and their mask, with the q / out columns each one pairs with:
    int4 pages hold head_dim / 2 bytes, so q splits into even (low nibble) and odd columns."""
    offs_d = tl.arange(0, BLOCK_D)
    if KIND == codes.INT4:
        dmask = offs_d < HEAD_DIM // 2
        cols_a = 2 * offs_d
        cols_b = 2 * offs_d + 1
    else:
        dmask = offs_d < HEAD_DIM
        cols_a = offs_d
        cols_b = offs_d
    return offs_d, dmask, cols_a, cols_b


@triton.jit
def _group_q(Q, b, kvh, stride_qb, stride_qh, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr, DOT_F16: tl.constexpr,
             dt: tl.constexpr, DOT: tl.constexpr):
    """q of the group as dot operands [BLOCK_H, BLOCK_D] (even/odd columns for int4), their row sums,
    and the head/column indices and masks the output store needs.

    fp16 dots take q / 16 (exact: a power of two), so q may reach 16 x fp16's 65504; q_pre is
    that factor, which the caller divides back out of the softmax scale.
    """
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    q_row = b * stride_qb + heads * stride_qh
    offs_d, dmask, cols_a, cols_b = _stored_columns(HEAD_DIM, BLOCK_D, KIND)
    qmask = hmask[:, None] & dmask[None, :]
    q_pre = 0.0625 if DOT_F16 else 1.0
    q_a = tl.load(Q + q_row[:, None] + cols_a[None, :], mask=qmask, other=0.0).to(tl.float32)
    q_a = _operand(q_a * q_pre, dt, DOT)
    q_b = q_a
    if KIND == codes.INT4:
        q_b = tl.load(Q + q_row[:, None] + cols_b[None, :], mask=qmask, other=0.0).to(tl.float32)
        q_b = _operand(q_b * q_pre, dt, DOT)
    # sum(q) of the rounded q the dots see (for asymmetric K's zero points)
    qsum = tl.sum(q_a.to(tl.float32), 1)
    if KIND == codes.INT4:
        qsum += tl.sum(q_b.to(tl.float32), 1)
    return q_a, q_b, qsum, q_pre, heads, hmask, cols_a, cols_b, dmask


@triton.jit
def _static_folds(KS, VS, kvh, qk_scale, q_pre, SCALE_MODE: tl.constexpr):
    """(factor on q.k_raw, factor on the output): static K scales fold into the softmax scale and
    undo q_pre; static V scales multiply the output once (1.0 for other scale modes)."""
    k_fold = qk_scale / q_pre
    v_fold = 1.0
    if SCALE_MODE == codes.PER_TENSOR:
        k_fold = k_fold * tl.load(KS)
        v_fold = tl.load(VS)
    elif SCALE_MODE == codes.PER_HEAD:
        k_fold = k_fold * tl.load(KS + kvh)
        v_fold = tl.load(VS + kvh)
    return k_fold, v_fold


@triton.jit
def _store_group(OUT, PM, PL, PACC, o_a, o_b, m, l, b, sp, heads, hmask, cols_a, cols_b, dmask,
                 num_splits, stride_ob, stride_oh, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 KIND: tl.constexpr, SPLIT: tl.constexpr):
    """Unnormalized o [BLOCK_H, BLOCK_D] (both int4 halves), running max m and sum l: with SPLIT the partial
    for the merge (o as is into fp32 PACC, else o / l, 0 for an empty split: `split_k.partial_dtype`), else
    o / l in OUT's dtype."""
    if SPLIT:
        prow = (b * NUM_HEADS + heads) * num_splits + sp
        tl.store(PM + prow, m, mask=hmask)
        tl.store(PL + prow, l, mask=hmask)
        out_a = PACC + prow[:, None] * HEAD_DIM + cols_a[None, :]
        out_b = PACC + prow[:, None] * HEAD_DIM + cols_b[None, :]
        wa = o_a
        wb = o_b
        if PACC.dtype.element_ty != tl.float32:
            inv = tl.where(l > 0, 1.0 / l, 0.0)[:, None]
            wa = (o_a * inv).to(PACC.dtype.element_ty)
            wb = (o_b * inv).to(PACC.dtype.element_ty)
    else:
        o_row = b * stride_ob + heads * stride_oh
        out_a = OUT + o_row[:, None] + cols_a[None, :]
        out_b = OUT + o_row[:, None] + cols_b[None, :]
        wa = (o_a / l[:, None]).to(OUT.dtype.element_ty)
        wb = (o_b / l[:, None]).to(OUT.dtype.element_ty)
    omask = hmask[:, None] & dmask[None, :]
    tl.store(out_a, wa, mask=omask)
    if KIND == codes.INT4:
        tl.store(out_b, wb, mask=omask)
