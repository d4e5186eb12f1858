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

The launcher reads nothing back from the device: the grid is sized from q's row count
and the chunk count, and each program finds its chunk from cu_seqlens itself, so a
launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_cache import LayerCache
from .decode_attention import _LOG2E, _dequant_v, _dot_mode
from .dequant import _dot, _operand, _unpack
from .formats import Q_DTYPES, SCALE_TOKEN, check_device, check_q, kernel_format, meta_strides, out_dtype, scale_tensors
from .group_io import _static_folds, _stored_columns, _tile_pages

# Launch options by q dtype. 16-bit: flash-attention's usual Hopper tile for head_dim 128; an
# offline sm_90 compile (Triton 3.6, Llama-3-8B shapes) gives 207-255 registers, K/V through
# cp.async, and no spills (int8 per-token asym spilled 16-32 bytes with 64-bit scale offsets). On the H200
# (benchmarks/prefill_context.py --tune 32768x512, results/prefill_context.md) five other tiles
# were within a few percent of it; with a 512-token chunk the kernel is 1.3-3.4x faster than the
# gather + dequantize + SDPA reference, with 2048 tokens 1.0-1.5x for 16-bit and static 8-bit
# formats but 0.6-0.8x for per-token ones (every 32-token query tile dequantizes the whole
# context again; measured with per-token V dequantized in fp32 and 64-bit scale offsets).
# fp32 q (parity runs, IEEE dots on CUDA cores) spills at any tile; smaller tiles spill least.
#
# Per-token formats, same compile, SASS instructions of loop 1 per 64-token tile (fp8 / int8 /
# int8 asym / int4 / int4 asym): V dequantized in fp32 1082 / 1087 / 1321 / 1232 / 1279 with
# 64-bit scale offsets, 985 / 996 / 1137 / 1139 / 1125 with 32-bit ones (the int8 asym spill
# gone); V's scales on p (P_SCALE) 1051 / 1052 / 1307 / 1247 / 1309. Scaling p saves no
# multiply here -- p's tile (128 rows x 64 tokens) is as large as V's (64 x 128) -- and the
# scales become 16 values per thread in the scores' layout instead of 2 on V's rows. Yet on the
# H200 (benchmarks/prefill_context.py --p-scale both, results/prefill_context.md) int8 per-token
# ran 4-7% faster with P_SCALE at every context and chunk; int4 per-token asym was a tie and its
# error grew with the context (see the launcher), so P_SCALE is the default for symmetric formats.
DEFAULTS = {
    "16bit": dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
    "fp32": dict(block_m=32, block_n=16, num_warps=4, num_stages=2),
}


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax over one score tile [ROWS, BLOCK_N]: (new max, new sum, rescale of acc, p in fp32)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
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
    q_a = _operand(tl.load(Q + q_row[:, None] + cols_a[None, :], mask=qm, other=0.0), dt, DOT, False)
    q_b = q_a
    if KIND == 2:
        q_b = _operand(tl.load(Q + q_row[:, None] + cols_b[None, :], mask=qm, other=0.0), dt, DOT, False)
    # sum(q) of the q the dots see, for asymmetric K's zero points
    qsum = tl.sum(q_a.to(tl.float32), 1)
    if KIND == 2:
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
        s = _dot(q_a, tl.trans(_operand(_unpack(kraw, 0, KIND, ASYM, "", "", dt), dt, DOT, False)), DOT)
        if KIND == 2:
            s += _dot(q_b, tl.trans(_operand(_unpack(kraw, 1, KIND, ASYM, "", "", dt), dt, DOT, False)), DOT)
        if SCALE_MODE == 3:
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
        pv = _operand(pv, dt, DOT, False)
        acc_a = acc_a * alpha[:, None] + _dot(pv, _dequant_v(vraw, 0, VS, VZ, meta, nmask, KIND, V_SCALE, ASYM,
                                                             dt, DOT, False, False, "", ""), DOT)
        if KIND == 2:
            acc_b = acc_b * alpha[:, None] + _dot(pv, _dequant_v(vraw, 1, VS, VZ, meta, nmask, KIND, V_SCALE, ASYM,
                                                                 dt, DOT, False, False, "", ""), DOT)
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
        k_a = _operand(tl.load(KN + k_row[:, None] + cols_a[None, :], mask=m2, other=0.0), dt, DOT, False)
        s = _dot(q_a, tl.trans(k_a), DOT)
        if KIND == 2:
            k_b = _operand(tl.load(KN + k_row[:, None] + cols_b[None, :], mask=m2, other=0.0), dt, DOT, False)
            s += _dot(q_b, tl.trans(k_b), DOT)
        s = tl.where(nmask[None, :] & (pos[None, :] <= tok[:, None]), s * qk_scale, float("-inf"))
        m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
        pv = _operand(p, dt, DOT, False)
        v_a = _operand(tl.load(VN + v_row[:, None] + cols_a[None, :], mask=m2, other=0.0), dt, DOT, False)
        acc_a = acc_a * alpha[:, None] + _dot(pv, v_a, DOT)
        if KIND == 2:
            v_b = _operand(tl.load(VN + v_row[:, None] + cols_b[None, :], mask=m2, other=0.0), dt, DOT, False)
            acc_b = acc_b * alpha[:, None] + _dot(pv, v_b, DOT)

    l_i = tl.where(rmask, l_i, 1.0)  # rows that are not stored may have seen no key: no 0/0
    o_row = (c0 + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(OUT + o_row[:, None] + cols_a[None, :], (acc_a / l_i[:, None]).to(OUT.dtype.element_ty), mask=qm)
    if KIND == 2:
        tl.store(OUT + o_row[:, None] + cols_b[None, :], (acc_b / l_i[:, None]).to(OUT.dtype.element_ty), mask=qm)


def prefill_context_attention_launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, cache: LayerCache,
    block_tables: torch.Tensor, context_lens: torch.Tensor, sm_scale: float,
    block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, p_scale: bool = True,
) -> torch.Tensor:
    """Validate shapes and launch; options left at None take `DEFAULTS` for q's dtype.

    block_m: rows per program, chunk tokens x the GQA group (a power of two >= 16, raised to the
    group's if smaller): block_m // group chunk tokens per program. block_n: tokens per K/V tile
    (a power of two >= 16). p_scale: symmetric per-token formats with bf16 q multiply p by V's scales
    so the p.V dot runs on V's raw stored values (H200, int8 per-token: 4-7% faster at every context
    and chunk of benchmarks/prefill_context.py); False dequantizes V in fp32 in every tile. Never for
    asymmetric formats: sum p s x and sum p z are two large terms that cancel, and with p s rounded
    to bf16 int4 per-token asym's error grew to 0.26 at a 128k context (0.015 on the fp32 path);
    never for fp16 q (p s can leave fp16's exponent range) or fp32 q (parity runs).
    Only shapes and dtypes are checked: values of cu_seqlens / context_lens stay on the device
    (no host sync); a context longer than the block table's width is cut to it, as in decode.
    """
    kf = kernel_format(cache)
    check_device(q, k, v, cu_seqlens, context_lens, cache.k, block_tables)
    _, kv_heads, bs, stored = cache.k.shape
    check_q(q, kf, kv_heads, "tokens")
    tokens, num_heads, head_dim = q.shape
    want = (tokens, kv_heads, head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want or k.dtype not in Q_DTYPES or v.dtype not in Q_DTYPES:
        raise ValueError(f"k and v must both be fp16/bf16/fp32 {list(want)}, got {k.dtype} {tuple(k.shape)} "
                         f"and {v.dtype} {tuple(v.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32 [chunks + 1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    chunks = cu_seqlens.numel() - 1
    if context_lens.shape != (chunks,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be int32 [{chunks}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != chunks or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [{chunks}, max_blocks] (a row per chunk), "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    group = num_heads // kv_heads
    dflt = DEFAULTS["fp32" if q.dtype == torch.float32 else "16bit"]
    block_m = dflt["block_m"] if block_m is None else block_m
    block_n = dflt["block_n"] if block_n is None else block_n
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (a tensor-core tile), got {val}")
    rows = max(block_m, triton.next_power_of_2(group))
    tile_m = rows // group

    out = torch.empty(q.shape, dtype=out_dtype(q.dtype), device=q.device)
    if chunks == 0 or tokens == 0:
        return out.to(q.dtype)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    block_d = max(16, triton.next_power_of_2(stored))
    grid = (triton.cdiv(tokens, tile_m) + chunks, kv_heads)  # >= the chunks' tiles: each adds <= 1 partial tile
    _prefill_context_kernel[grid](
        q, k, v, cache.k, cache.v, *scale_tensors(cache, cache.k), block_tables, cu_seqlens.contiguous(), context_lens.contiguous(),
        out, sm_scale * _LOG2E, block_tables.shape[1] * bs, chunks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), cache.k.stride(0), cache.k.stride(1), cache.k.stride(2), *meta_strides(kf, cache),
        GROUP=group, ROWS=rows, TILE_M=tile_m, BLOCK_C=max(16, triton.next_power_of_2(chunks)), BLOCK_SIZE=bs,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        KIND=kf.kind, SCALE_MODE=kf.scale_mode, ASYM=kf.asym, DOT=_dot_mode(q.dtype), FULL_D=block_d == stored,
        ALIGN=16 if stored % 16 == 0 else 1,
        P_SCALE=p_scale and kf.scale_mode == SCALE_TOKEN and not kf.asym and q.dtype == torch.bfloat16,
        META_I64=kf.scale_mode == SCALE_TOKEN and cache.k_scale.numel() >= 2**31,
        num_warps=dflt["num_warps"] if num_warps is None else num_warps,
        num_stages=dflt["num_stages"] if num_stages is None else num_stages,
    )
    return out if out.dtype == q.dtype else out.to(q.dtype)


def prefill_context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, cache: LayerCache,
    block_tables: torch.Tensor, context_lens: torch.Tensor, sm_scale: float,
) -> torch.Tensor:
    """runtime/attention.py's prefill_context_attention, reading the context from the pages in place."""
    return prefill_context_attention_launch(q, k, v, cu_seqlens, cache, block_tables, context_lens, sm_scale)

