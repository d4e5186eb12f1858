"""The unquantized formats' decode kernel (fp32 / fp16 / bf16 pages; the quantized ones run `decode_gluon.py` on
the GPU and `decode_warps.py` elsewhere): paged, GQA-grouped attention in query heads x tokens tiles, split-K.

One program handles one (sequence, KV head, split): all GROUP query heads that share the KV head are a
[BLOCK_H, head_dim] tile, so every KV page is read once per group (GQA), and scores come from one `tl.dot` per
tile of BLOCK_N tokens. Tokens are gathered through the block table one row at a time
(`page * stride + offset`), so pages may sit anywhere in the pool and the page size need not be a power of
two. Softmax: online (running max and sum), fp32, base 2. With split-K each program writes a partial
(max, sum, acc) that `split_k.merge_splits` combines; with one split the program writes the output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import codes
from .dequant import _dot, _operand
from .group_io import _group_q, _program_tokens, _static_folds, _store_group, _tile_pages


# ints that change step to step add no compiled variants while serving (runtime/warmup.py)
@triton.jit(do_not_specialize=["num_splits", "stride_btb"])
def _decode_kernel(
    Q, K, V, KS, VS, KZ, VZ, BT, SEQ, OUT, PM, PL, PACC,
    qk_scale, tokens_per_split, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_btb,
    stride_cb, stride_ch, stride_ct, stride_mb, stride_mh,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    FULL_D: tl.constexpr,
):
    """KS, VS, KZ, VZ, stride_mb, stride_mh: the quantized kernels' scale arguments, unread here."""
    b, kvh, sp, start, end = _program_tokens(SEQ, tokens_per_split)
    dt = Q.dtype.element_ty
    q_a, q_b, qsum, q_pre, heads, hmask, cols_a, cols_b, dmask = _group_q(
        Q, b, kvh, stride_qb, stride_qh, GROUP, BLOCK_H, HEAD_DIM, BLOCK_D, codes.FLOAT, False, dt, DOT)
    offs_d = tl.arange(0, BLOCK_D)
    k_fold, v_fold = _static_folds(KS, VS, kvh, qk_scale, q_pre, codes.NO_SCALE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    bt_row = BT + b * stride_btb
    # pages a tile ahead, so the pipeline really buffers num_stages - 1 tiles (group_io._tile_pages)
    page_next = _tile_pages(bt_row, start + tl.arange(0, BLOCK_N), end, BLOCK_SIZE)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        page = page_next.to(tl.int64)
        page_next = _tile_pages(bt_row, offs_n + BLOCK_N, end, BLOCK_SIZE)
        slot = offs_n % BLOCK_SIZE
        # rows start 16-byte aligned (strides are multiples of 16 elements), which lets loads vectorize
        base = tl.multiple_of(page * stride_cb + kvh * stride_ch + slot * stride_ct, 16)
        if FULL_D:  # no column mask: a mask that varies along head_dim would split the loads
            m2 = nmask[:, None]
        else:
            m2 = nmask[:, None] & dmask[None, :]
        k = tl.load(K + base[:, None] + offs_d[None, :], mask=m2, other=0.0)
        v = tl.load(V + base[:, None] + offs_d[None, :], mask=m2, other=0.0)
        s = _dot(q_a, tl.trans(_operand(k, dt, DOT)), DOT)
        s = tl.where(nmask[None, :], s * k_fold, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        pd = _operand(p, dt, DOT)
        acc = acc * alpha[:, None] + _dot(pd, _operand(v, dt, DOT), DOT)

    _store_group(OUT, PM, PL, PACC, acc * v_fold, acc * v_fold, m_i, l_i, b, sp, heads, hmask, cols_a, cols_b,
                 dmask, num_splits, stride_ob, stride_oh, NUM_HEADS, HEAD_DIM, codes.FLOAT, SPLIT)

