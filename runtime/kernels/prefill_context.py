"""Chunked-prefill attention over the paged, quantized KV cache, as one Triton kernel.

Chunk i of a packed batch (rows cu_seqlens[i]:cu_seqlens[i+1] of q/k/v) continues a
sequence whose first context_lens[i] tokens are already in the cache. The reference
(runtime/attention.py) gathers and dequantizes that whole context per chunk and layer --
gigabytes at 128k tokens -- before SDPA; here the pages are read in place:

* A program's rows are TILE_M chunk tokens x the GROUP query heads of one KV head, so
  every page is read and dequantized once for the whole GQA group, and the group fills
  the tensor cores' M dimension that one token's few heads could not.
* Loop 1 walks the context through the block table like decode (pages in any order,
  any page size) with the decode kernels' algebra (dequant.py, group_io.py): raw stored
  values in the dots, K scales on the scores, static V scales once on the context's
  accumulator (the chunk's own V has none), symmetric per-token V scales on p with bf16 q
  (P_SCALE), else per-token V dequantized in fp32.
* Loop 2 walks the chunk's own full-precision K/V up to the tile's last token under the
  causal mask j <= t (chunk token t sits at position context + t: bottom-right).
* One fp32 online softmax (base 2) spans both loops.

No split-K: a 512-token chunk of Llama-3-8B is already 16 x 8 programs, and each
is compute-bound (its ROWS rows reuse every K/V tile it loads).

Its plan (`plan.PrefillPlan`: tiles per q dtype from tuned/*.json, P_SCALE) is untimed beyond
benchmarks/prefill_context.py's tile sweep (docs/kernels.md). The launcher reads nothing back from the device: the grid is sized from q's row count
and the chunk count, and each program finds its chunk from cu_seqlens itself, so a
launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import codes
from .dequant import _dequant_v, _dot, _operand, _unpack
from .group_io import _softmax_step, _static_folds, _stored_columns, _tile_pages


# ints that change step to step add no compiled variants while serving (runtime/warmup.py)
@triton.jit(do_not_specialize=["max_ctx", "num_chunks", "stride_btb"])
def _prefill_context_kernel(
    Q, KN, VN, K, V, KS, VS, KZ, VZ, BT, CU, CTX, OUT,
    qk_scale, max_ctx, num_chunks,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh, stride_btb,
    stride_cb, stride_ch, stride_ct, stride_mb, stride_mh,
    GROUP: tl.constexpr, ROWS: tl.constexpr, TILE_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, ASYM: tl.constexpr, DOT: tl.constexpr,
    FULL_D: tl.constexpr, ALIGN: tl.constexpr, P_SCALE: tl.constexpr, META_I64: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    dt = Q.dtype.element_ty
    # Program pid takes the pid-th tile of the chunks' tiles laid end to end: its chunk is the number
    # of chunks whose tiles all come before it. The grid's bound (tokens / TILE_M + chunks) needs no
    # host sync; programs past the last tile load and store nothing.
    offs_c = tl.arange(0, BLOCK_C)
    cmask = offs_c < num_chunks
    lens = tl.load(CU + offs_c + 1, mask=cmask, other=0) - tl.load(CU + offs_c, mask=cmask, other=0)
    ntiles = (lens + TILE_M - 1) // TILE_M
    chunk = tl.sum((tl.cumsum(ntiles, 0) <= pid).to(tl.int32), 0)
    t0 = (pid - tl.sum(tl.where(offs_c < chunk, ntiles, 0), 0)) * TILE_M
    live = chunk < num_chunks
    chunk = tl.minimum(chunk, num_chunks - 1)
    c0 = tl.load(CU + chunk)
    n_chunk = tl.where(live, tl.load(CU + chunk + 1) - c0, 0)
    # a context longer than the block table holds is cut to it (as decode's splits do)
    ctx = tl.where(live, tl.minimum(tl.load(CTX + chunk), max_ctx), 0)
    hi = tl.minimum(t0 + TILE_M, n_chunk)  # chunk keys this tile's last token sees

    # row r = (chunk token t0 + r // GROUP, query head r % GROUP of this KV head)
    r = tl.arange(0, ROWS)
    tok = t0 + r // GROUP
    heads = kvh * GROUP + r % GROUP
    rmask = (r < TILE_M * GROUP) & (tok < n_chunk)
    offs_d, dmask, cols_a, cols_b = _stored_columns(HEAD_DIM, BLOCK_D, KIND)
    q_row = (c0 + tok).to(tl.int64) * stride_qt + heads * stride_qh
    qm = rmask[:, None] & dmask[None, :]
    q_a = _operand(tl.load(Q + q_row[:, None] + cols_a[None, :], mask=qm, other=0.0), dt, DOT)
    q_b = q_a
    if KIND == codes.INT4:
        q_b = _operand(tl.load(Q + q_row[:, None] + cols_b[None, :], mask=qm, other=0.0), dt, DOT)
    # sum(q) of the q the dots see, for asymmetric K's zero points
    qsum = tl.sum(q_a.to(tl.float32), 1)
    if KIND == codes.INT4:
        qsum += tl.sum(q_b.to(tl.float32), 1)
    k_fold, v_fold = _static_folds(KS, VS, kvh, qk_scale, 1.0, SCALE_MODE)

    # a finite start: a row's first tile always has a visible key, so the start never leaks into p
    m_i = tl.full([ROWS], -1e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc_a = tl.zeros([ROWS, BLOCK_D], tl.float32)
    acc_b = tl.zeros([ROWS, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    # P_SCALE (symmetric per-token formats): V scales multiply p, and V is widened raw like a static format's
    V_SCALE: tl.constexpr = 0 if P_SCALE else SCALE_MODE

    # ---- loop 1: the cached context, every key visible
    bt_row = BT + chunk.to(tl.int64) * stride_btb
    page_next = _tile_pages(bt_row, offs_n, ctx, BLOCK_SIZE)  # a tile ahead (group_io._tile_pages)
    for n0 in range(0, ctx, BLOCK_N):
        pos = n0 + offs_n
        nmask = pos < ctx
        page32 = page_next
        page = page_next.to(tl.int64)
        page_next = _tile_pages(bt_row, pos + BLOCK_N, ctx, BLOCK_SIZE)
        slot = pos % BLOCK_SIZE
        base = page * stride_cb + kvh * stride_ch + slot * stride_ct
        if ALIGN > 1:  # rows start ALIGN-element aligned, which lets the loads vectorize
            base = tl.multiple_of(base, ALIGN)
        if FULL_D:  # no column mask: a mask that varies along head_dim would split the loads
            m2 = nmask[:, None]
        else:
            m2 = nmask[:, None] & dmask[None, :]
        kraw = tl.load(K + base[:, None] + offs_d[None, :], mask=m2, other=0.0)
        vraw = tl.load(V + base[:, None] + offs_d[None, :], mask=m2, other=0.0)
        # per-token scales' offsets in 32 bits where the tensors allow (the launcher's META_I64): these
        # loads are 16 per thread and tensor in the scores' layout, and 64-bit address arithmetic for
        # them was 8-14% of the loop's instructions (the counts above DEFAULTS)
        if META_I64:
            meta = page * stride_mb + kvh * stride_mh + slot
        else:
            meta = page32 * stride_mb + kvh * stride_mh + slot
        s = _dot(q_a, tl.trans(_operand(_unpack(kraw, 0, KIND, ASYM, "", "", dt), dt, DOT)), DOT)
        if KIND == codes.INT4:
            s += _dot(q_b, tl.trans(_operand(_unpack(kraw, 1, KIND, ASYM, "", "", dt), dt, DOT)), DOT)
        if SCALE_MODE == codes.PER_TOKEN:
            s = s * tl.load(KS + meta, mask=nmask, other=0.0).to(tl.float32)[None, :]
            if ASYM:
                s += qsum[:, None] * tl.load(KZ + meta, mask=nmask, other=0.0).to(tl.float32)[None, :]
        s = tl.where(nmask[None, :], s * k_fold, float("-inf"))
        m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
        pv = p
        if P_SCALE:
            # sum_n p_n s_n v_n = sum_n (p_n s_n) v_n: the dot runs on the raw stored v_n (exact in 16 bits)
            # instead of v_n dequantized in fp32 in every query tile. p s rounds to bf16 with p's relative
            # error: bf16's exponent range is fp32's, so no max(s) is divided out (decode's _p_operand
            # does, for fp16 dots)
            pv = p * tl.load(VS + meta, mask=nmask, other=0.0).to(tl.float32)[None, :]
        pv = _operand(pv, dt, DOT)
        acc_a = acc_a * alpha[:, None] + _dot(pv, _dequant_v(vraw, 0, VS, VZ, meta, nmask, KIND, V_SCALE, ASYM,
                                                             dt, DOT, "", ""), DOT)
        if KIND == codes.INT4:
            acc_b = acc_b * alpha[:, None] + _dot(pv, _dequant_v(vraw, 1, VS, VZ, meta, nmask, KIND, V_SCALE, ASYM,
                                                                 dt, DOT, "", ""), DOT)
    # V's static scales (1.0 for per-token formats): once, before the chunk's own values join the sums
    acc_a = acc_a * v_fold
    acc_b = acc_b * v_fold

    # ---- loop 2: the chunk's own K/V, causal
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + offs_n
        nmask = pos < hi
        m2 = nmask[:, None] & dmask[None, :]
        k_row = (c0 + pos).to(tl.int64) * stride_knt + kvh * stride_knh
        v_row = (c0 + pos).to(tl.int64) * stride_vnt + kvh * stride_vnh
        k_a = _operand(tl.load(KN + k_row[:, None] + cols_a[None, :], mask=m2, other=0.0), dt, DOT)
        s = _dot(q_a, tl.trans(k_a), DOT)
        if KIND == codes.INT4:
            k_b = _operand(tl.load(KN + k_row[:, None] + cols_b[None, :], mask=m2, other=0.0), dt, DOT)
            s += _dot(q_b, tl.trans(k_b), DOT)
        s = tl.where(nmask[None, :] & (pos[None, :] <= tok[:, None]), s * qk_scale, float("-inf"))
        m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
        pv = _operand(p, dt, DOT)
        v_a = _operand(tl.load(VN + v_row[:, None] + cols_a[None, :], mask=m2, other=0.0), dt, DOT)
        acc_a = acc_a * alpha[:, None] + _dot(pv, v_a, DOT)
        if KIND == codes.INT4:
            v_b = _operand(tl.load(VN + v_row[:, None] + cols_b[None, :], mask=m2, other=0.0), dt, DOT)
            acc_b = acc_b * alpha[:, None] + _dot(pv, v_b, DOT)

    l_i = tl.where(rmask, l_i, 1.0)  # rows that are not stored may have seen no key: no 0/0
    o_row = (c0 + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(OUT + o_row[:, None] + cols_a[None, :], (acc_a / l_i[:, None]).to(OUT.dtype.element_ty), mask=qm)
    if KIND == codes.INT4:
        tl.store(OUT + o_row[:, None] + cols_b[None, :], (acc_b / l_i[:, None]).to(OUT.dtype.element_ty), mask=qm)
