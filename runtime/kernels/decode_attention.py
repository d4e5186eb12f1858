"""Paged decode attention over a (quantized) KV cache, split-K over the context.

One program handles one (sequence, KV head, split): all GROUP query heads that
share the KV head are a [BLOCK_H, head_dim] tile, so every KV page is read
once per group (GQA), and scores come from one `tl.dot` per tile of BLOCK_N
tokens. Tokens are gathered through the block table one row at a time
(`page * stride + offset`), so pages may sit anywhere in the pool and the page
size need not be a power of two.

Dequantization stays in registers and is arranged so that the dot products
see exact operands:

* K: the raw stored values (int8, uint8, int4 nibbles minus 8, fp8) are exact
  in fp16/bf16, so q . k_q is computed on them and the per-token scale is
  applied to the scores afterwards: s_n * (q . k_q) + z_n * sum(q). Static
  (per-tensor/per-head) K scales fold into the softmax scale.
* V: per-token formats are dequantized in fp32 (v_q * s + z) and then cast to
  the dot dtype, like the reference path; static V scales multiply the output
  once at the end (exact and free).
* softmax: online (running max and sum), fp32, base 2.

`decode_warps.py` holds the other kernel the launcher can pick (per format,
`tuning.TUNED`): the same math with one softmax state per warp, which the
8-bit and per-token formats run faster on. On the GPU, `decode_gluon.py`
(the same algebra with hand-placed register layouts) serves the quantized
formats it supports where `tuning.TUNED` says it is faster.

Long contexts with few (sequence, KV head) pairs would leave most SMs idle,
so the context is split into `num_splits` ranges that write partial (max,
sum, acc); a second kernel merges them. With one split the first kernel
writes the output directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_cache import LayerCache
from . import decode_gluon
from .decode_warps import _decode_kernel_warps
from .dequant import DOT_IEEE, DOT_NATIVE, DOT_UPCAST, _dot, _operand, _unpack
from .formats import (
    KIND_INT4,
    KIND_INT8,
    SCALE_TOKEN,
    check_device,
    check_q,
    kernel_format,
    meta_strides,
    out_dtype,
    scale_tensors,
)
from .group_io import _group_q, _program_tokens, _static_folds, _store_group, _tile_pages
from .split_k import choose_num_splits, merge_splits, sm_count, split_plan
from .tuning import (
    ONE_WARP_MAX_SPLITS,
    gluon_k_chains_for,
    gluon_offsets32,
    gluon_plan,
    gluon_tma_for,
    skip_rescale_for,
    tuned_for,
)
from .widen_ptx import widen_asm

_LOG2E = 1.4426950408889634


@triton.jit
def _dequant_v(vraw, HALF: tl.constexpr, VS, VZ, meta, nmask, KIND: tl.constexpr, SCALE_MODE: tl.constexpr,
               ASYM: tl.constexpr, dt: tl.constexpr, DOT: tl.constexpr, V_T: tl.constexpr,
               CVT_EARLY: tl.constexpr, ASM_LO: tl.constexpr, ASM_HI: tl.constexpr):
    """V tile [BLOCK_N, D] in the dot dtype: per-token formats dequantized in fp32 first, others exact raw values.

    With V_T the tile was loaded as [D, BLOCK_N] and is transposed here, after the cast.
    """
    v = _unpack(vraw, HALF, KIND, ASYM, ASM_LO, ASM_HI, dt)
    if SCALE_MODE == 3:
        if V_T:
            v = v.to(tl.float32) * tl.load(VS + meta, mask=nmask, other=0.0).to(tl.float32)[None, :]
            if ASYM:
                v += tl.load(VZ + meta, mask=nmask, other=0.0).to(tl.float32)[None, :]
        else:
            v = v.to(tl.float32) * tl.load(VS + meta, mask=nmask, other=0.0).to(tl.float32)[:, None]
            if ASYM:
                v += tl.load(VZ + meta, mask=nmask, other=0.0).to(tl.float32)[:, None]
    v = _operand(v, dt, DOT, CVT_EARLY)
    if V_T:
        v = tl.trans(v)
    return v


@triton.jit
def _p_operand(p, VS, meta, nmask, TOKEN_AXIS: tl.constexpr, P_SCALE: tl.constexpr, dt: tl.constexpr,
               DOT: tl.constexpr):
    """p as the p.V operand, and the factor its product with raw V takes.

    With P_SCALE the per-token V scales s_n are applied to p (exact algebra: sum_n p_n s_n v_n),
    so V stays raw integers like a static format; p * s / max(s) keeps the fp16/bf16 operand in
    [0, 1] and max(s) multiplies the product instead.
    """
    if P_SCALE:
        vs = tl.load(VS + meta, mask=nmask, other=0.0).to(tl.float32)
        vs_max = tl.max(vs, 0) + 1e-30
        if TOKEN_AXIS == 0:
            pw = p * (vs / vs_max)[:, None]
        else:
            pw = p * (vs / vs_max)[None, :]
        return _operand(pw, dt, DOT, False), vs_max
    else:
        return _operand(p, dt, DOT, False), 1.0


@triton.jit
def _decode_kernel(
    Q, K, V, KS, VS, KZ, VZ, BT, SEQ, OUT, PM, PL, PACC,
    qk_scale, tokens_per_split, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_btb,
    stride_cb, stride_ch, stride_ct, stride_mb, stride_mh,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, ASYM: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    FULL_D: tl.constexpr, V_T: tl.constexpr, CVT_EARLY: tl.constexpr, ASM_LO: tl.constexpr, ASM_HI: tl.constexpr,
    DOT_F16: tl.constexpr, P_SCALE: tl.constexpr, SWAP: tl.constexpr,
):
    b, kvh, sp, start, end = _program_tokens(SEQ, tokens_per_split)
    if DOT_F16:
        dt = tl.float16
    else:
        dt = Q.dtype.element_ty
    # with P_SCALE the per-token V scale goes into p, so V is widened like a static format's
    V_SCALE: tl.constexpr = 0 if P_SCALE else SCALE_MODE

    q_a, q_b, qsum, q_pre, heads, hmask, cols_a, cols_b, dmask = _group_q(
        Q, b, kvh, stride_qb, stride_qh, GROUP, BLOCK_H, HEAD_DIM, BLOCK_D, KIND, DOT_F16, dt, DOT)
    offs_d = tl.arange(0, BLOCK_D)
    k_fold, v_fold = _static_folds(KS, VS, kvh, qk_scale, q_pre, SCALE_MODE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if SWAP:
        acc_a = tl.zeros([BLOCK_D, BLOCK_H], tl.float32)
        acc_b = tl.zeros([BLOCK_D, BLOCK_H], tl.float32)
    else:
        acc_a = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        acc_b = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
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
        kraw = tl.load(K + base[:, None] + offs_d[None, :], mask=m2, other=0.0)
        if V_T:
            if FULL_D:
                m2t = nmask[None, :]
            else:
                m2t = nmask[None, :] & dmask[:, None]
            vraw = tl.load(V + base[None, :] + offs_d[:, None], mask=m2t, other=0.0)
        else:
            vraw = tl.load(V + base[:, None] + offs_d[None, :], mask=m2, other=0.0)
        meta = page * stride_mb + kvh * stride_mh + slot
        if SWAP:
            # transposed products: tokens are the M dimension (64/128 rows, wgmma-sized) and the
            # padded query-head group the N dimension; acc holds out^T [D, H]
            sT = _dot(_operand(_unpack(kraw, 0, KIND, ASYM, ASM_LO, ASM_HI, dt), dt, DOT, CVT_EARLY), tl.trans(q_a), DOT)
            if KIND == 2:
                sT += _dot(_operand(_unpack(kraw, 1, KIND, ASYM, ASM_LO, ASM_HI, dt), dt, DOT, CVT_EARLY), tl.trans(q_b), DOT)
            if SCALE_MODE == 3:
                sT = sT * tl.load(KS + meta, mask=nmask, other=0.0).to(tl.float32)[:, None]
                if ASYM:
                    sT += qsum[None, :] * tl.load(KZ + meta, mask=nmask, other=0.0).to(tl.float32)[:, None]
            sT = tl.where(nmask[:, None], sT * k_fold, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sT, 0))
            alpha = tl.math.exp2(m_i - m_new)
            pT = tl.math.exp2(sT - m_new[None, :])
            l_i = l_i * alpha + tl.sum(pT, 0)
            m_i = m_new
            pd, vs_max = _p_operand(pT, VS, meta, nmask, 0, P_SCALE, dt, DOT)
            vA = tl.trans(_dequant_v(vraw, 0, VS, VZ, meta, nmask, KIND, V_SCALE, ASYM, dt, DOT, V_T, CVT_EARLY, ASM_LO, ASM_HI))
            acc_a = acc_a * alpha[None, :] + vs_max * _dot(vA, pd, DOT)
            if KIND == 2:
                vB = tl.trans(_dequant_v(vraw, 1, VS, VZ, meta, nmask, KIND, V_SCALE, ASYM, dt, DOT, V_T, CVT_EARLY, ASM_LO, ASM_HI))
                acc_b = acc_b * alpha[None, :] + vs_max * _dot(vB, pd, DOT)
            if P_SCALE and ASYM:  # + sum_n p_n z_n, the same for every column
                pz = tl.sum(pT * tl.load(VZ + meta, mask=nmask, other=0.0).to(tl.float32)[:, None], 0)
                acc_a += pz[None, :]
                if KIND == 2:
                    acc_b += pz[None, :]
        else:
            s = _dot(q_a, tl.trans(_operand(_unpack(kraw, 0, KIND, ASYM, ASM_LO, ASM_HI, dt), dt, DOT, CVT_EARLY)), DOT)
            if KIND == 2:
                s += _dot(q_b, tl.trans(_operand(_unpack(kraw, 1, KIND, ASYM, ASM_LO, ASM_HI, dt), dt, DOT, CVT_EARLY)), DOT)
            if SCALE_MODE == 3:
                s = s * tl.load(KS + meta, mask=nmask, other=0.0).to(tl.float32)[None, :]
                if ASYM:
                    s += qsum[:, None] * tl.load(KZ + meta, mask=nmask, other=0.0).to(tl.float32)[None, :]
            s = tl.where(nmask[None, :], s * k_fold, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

            pd, vs_max = _p_operand(p, VS, meta, nmask, 1, P_SCALE, dt, DOT)
            acc_a = acc_a * alpha[:, None] + vs_max * _dot(pd, _dequant_v(vraw, 0, VS, VZ, meta, nmask, KIND, V_SCALE, ASYM, dt, DOT, V_T, CVT_EARLY, ASM_LO, ASM_HI), DOT)
            if KIND == 2:
                acc_b = acc_b * alpha[:, None] + vs_max * _dot(pd, _dequant_v(vraw, 1, VS, VZ, meta, nmask, KIND, V_SCALE, ASYM, dt, DOT, V_T, CVT_EARLY, ASM_LO, ASM_HI), DOT)
            if P_SCALE and ASYM:  # + sum_n p_n z_n, the same for every column
                pz = tl.sum(p * tl.load(VZ + meta, mask=nmask, other=0.0).to(tl.float32)[None, :], 1)
                acc_a += pz[:, None]
                if KIND == 2:
                    acc_b += pz[:, None]

    if SWAP:
        acc_a = tl.trans(acc_a)
        acc_b = tl.trans(acc_b)
    _store_group(OUT, PM, PL, PACC, acc_a * v_fold, acc_b * v_fold, m_i, l_i, b, sp, heads, hmask, cols_a, cols_b,
                 dmask, num_splits, stride_ob, stride_oh, NUM_HEADS, HEAD_DIM, KIND, SPLIT)


def _dot_mode(dtype: torch.dtype) -> int:
    from triton import knobs

    if dtype == torch.float32:
        return DOT_IEEE
    if dtype == torch.bfloat16 and knobs.runtime.interpret:
        return DOT_UPCAST
    return DOT_NATIVE


def decode_attention_launch(
    q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
    num_splits: int | None = None, block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
    v_transposed: bool = False, cvt_early: bool | None = None, dot_fp16: bool | None = None,
    p_scale: bool | None = None, swap: bool | None = None, maxnreg: int | None = None,
    warps: bool | None = None, heads_n: bool | None = None, int8_asm: bool | None = None,
    pages_ahead: bool | None = None, warp_page: bool | None = None, resident_per_sm: int | None = None,
    gluon: bool | None = None, gluon_skip_rescale: bool | None = None,
    gluon_stages: int | None = None, gluon_pairs: bool | None = None, gluon_k_chains: int | None = None,
    gluon_tma: int | None = None,
) -> torch.Tensor:
    """Validate shapes, pick the split count, launch the attention (and merge) kernels.

    Options left at None take the format's measured best (`tuning.TUNED`). v_transposed: load V
    tiles as [D, tokens]. cvt_early: widen 8-/4-bit tiles before the shared-memory staging
    (`_operand`). dot_fp16: dots in fp16 whatever q's dtype (exact for raw 8-/4-bit values,
    finer than bf16 for q and p). p_scale: per-token V scales multiply p, V stays raw.
    swap: transposed products, tokens as the tensor-core M dimension. maxnreg: cap registers
    per thread (more resident programs per SM; GPU only; 0 = no cap). warps: the one-softmax-state-per-warp
    kernel (`decode_warps.py`; block_n tokens per tile, block_n / num_warps per warp, >= 16);
    heads_n: there, query heads on the mma N dimension. int8_asm: widen int8 with the PTX of
    `widen_ptx.widen_asm` (with fp16 dots only). pages_ahead: there, block-table entries loaded a
    tile ahead (`group_io._tile_pages`; the heads x tokens kernel always does). warp_page: there,
    one block-table read per warp where a warp's tokens share a page. resident_per_sm: programs
    an SM holds at once, for the split rule (with a tile option that changes it). swap, v_transposed and cvt_early
    belong to the other kernel and are ignored by it. gluon: the Gluon kernel (`decode_gluon.py`) where it
    supports the launch (CUDA, head_dim 128, <= 8 heads per KV head, pages of 16k tokens, quantized
    formats); of the other options it takes num_splits, maxnreg and resident_per_sm. gluon_skip_rescale:
    there, skip the softmax rescale of tiles that raise no max (`tuning.skip_rescale_for`).
    gluon_stages: there, int4 tiles through a shared-memory ring of this many stages (0: loaded
    into registers; `tuning.gluon_stages_for`). gluon_pairs: there, the ring's tiles two a step (one softmax
    max, rescale test and V scale bound per 32 tokens; `tuning.gluon_pairs_for`). gluon_k_chains: there, the
    scores as 1, 2 or 4 independent chains of mma over blocks of k (`tuning.gluon_k_chains_for`). gluon_tma:
    there, the ring's K and V words (1), and per-token scales (2), copied by the TMA unit instead of cp.async (0;
    `tuning.gluon_tma_for`; ignored without a ring).
    """
    kf = kernel_format(cache)
    check_device(q, cache.k, block_tables, seq_lens)
    nb, kv_heads, bs, stored = cache.k.shape
    check_q(q, kf, kv_heads, "batch")
    batch, num_heads, head_dim = q.shape
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [{batch}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    out = torch.empty(q.shape, dtype=out_dtype(q.dtype), device=q.device)
    if batch == 0:
        return out.to(q.dtype)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    group = num_heads // kv_heads
    max_tokens = block_tables.shape[1] * bs  # an upper bound that needs no device sync
    tuned = tuned_for(kf, batch * kv_heads, max_tokens)
    if (tuned.gluon if gluon is None else gluon) and decode_gluon.supported(kf, q, bs, group):
        tma = gluon_tma_for(kf, torch.cuda.get_device_capability(q.device)[0]) if gluon_tma is None else gluon_tma
        cap, num_splits, stages, pairs = gluon_plan(kf, batch, kv_heads, max_tokens, sm_count(q.device), maxnreg,
                                                    gluon_stages, num_splits, resident_per_sm, gluon_pairs, group,
                                                    tma)
        plan = split_plan(out, max_tokens, num_splits, decode_gluon.TILE * (2 if pairs else 1), cache)
        decode_gluon.launch(q, cache, kf, block_tables, seq_lens, sm_scale * _LOG2E, out, plan,
                            scale_tensors(cache, cache.k), meta_strides(kf, cache), cap,
                            skip_rescale_for(kf) if gluon_skip_rescale is None else gluon_skip_rescale,
                            stages, gluon_offsets32(kf, cache.k.numel() // 4), pairs,
                            gluon_k_chains_for(kf) if gluon_k_chains is None else gluon_k_chains,
                            tma if stages else 0)
        return out
    block_n = tuned.block_n if block_n is None else block_n
    num_stages = tuned.num_stages if num_stages is None else num_stages
    dot_mode = _dot_mode(q.dtype)
    warps = tuned.warps if warps is None else warps
    # The fast widening paths (early cast, int4 PTX) are validated on the GPU for tiles of >= 64
    # tokens x >= 64 stored columns only: with 16-token tiles, or head_dim 16 with 128-token
    # tiles, the first kernel gave wrong int8/int4 results on the H200 (a miscompile; cause not
    # established). The per-warp kernel's warps always hold 16-token tiles, whatever block_n.
    block_d = max(16, triton.next_power_of_2(stored))
    fast_tile = (block_n >= 64 or warps) and block_d >= 64
    narrow = cache.v.element_size() == 1  # 8-bit and packed 4-bit pages
    cvt_early = (tuned.cvt_early if cvt_early is None else cvt_early) and narrow and fast_tile
    # fp16 dots need native tensor-core dots (not the interpreter's upcast or fp32 parity runs)
    dot_fp16 = (tuned.dot_fp16 if dot_fp16 is None else dot_fp16) and dot_mode == DOT_NATIVE
    p_scale = (tuned.p_scale if p_scale is None else p_scale) and kf.scale_mode == SCALE_TOKEN
    swap = tuned.swap if swap is None else swap
    maxnreg = tuned.maxnreg if maxnreg is None else maxnreg
    heads_n = tuned.heads_n if heads_n is None else heads_n
    pages_ahead = tuned.pages_ahead if pages_ahead is None else pages_ahead
    warp_page = tuned.warp_page if warp_page is None else warp_page
    if warps:  # every warp needs >= 16 tokens (the K dimension of its p . V product)
        if block_n < 16:
            raise ValueError(f"the per-warp kernel needs block_n >= 16 tokens, got {block_n}")
        num_warps = min(num_warps, block_n // 16)
    int8_asm = tuned.int8_asm if int8_asm is None else int8_asm
    asm = ("", "")
    if dot_mode == DOT_NATIVE and q.device.type == "cuda" and fast_tile:
        if kf.kind == KIND_INT4:
            asm = widen_asm(4, torch.float16 if dot_fp16 else q.dtype, not kf.asym)
        elif kf.kind == KIND_INT8 and int8_asm and dot_fp16:
            asm = widen_asm(8, torch.float16, not kf.asym)
    if num_splits is None:
        one_warp = {"max_splits": ONE_WARP_MAX_SPLITS} if warps and num_warps == 1 else {}
        num_splits = choose_num_splits(batch, kv_heads, max_tokens, block_n, sm_count(q.device),
                                       resident_per_sm or tuned.resident_per_sm, **one_warp)
    tokens_per_split, num_splits, (pm, pl, pacc) = split_plan(out, max_tokens, num_splits, block_n, cache)
    split = num_splits > 1
    args = (q, cache.k, cache.v, *scale_tensors(cache, cache.k), block_tables, seq_lens, out, pm, pl, pacc,
            sm_scale * _LOG2E, tokens_per_split, num_splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            cache.k.stride(0), cache.k.stride(1), cache.k.stride(2), *meta_strides(kf, cache))
    common = dict(NUM_HEADS=num_heads, BLOCK_SIZE=bs, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
                  KIND=kf.kind, SCALE_MODE=kf.scale_mode, ASYM=kf.asym, SPLIT=split, DOT=dot_mode,
                  FULL_D=block_d == stored, ASM_LO=asm[0], ASM_HI=asm[1], DOT_F16=dot_fp16, P_SCALE=p_scale,
                  num_warps=num_warps, num_stages=num_stages,
                  **({"maxnreg": maxnreg} if maxnreg and q.device.type == "cuda" else {}))
    if warps:
        _decode_kernel_warps[(batch, kv_heads, num_splits)](
            *args, BLOCK_H=max(4, triton.next_power_of_2(group)), W=num_warps, NW=block_n // num_warps,
            HEADS_N=heads_n, PAGES_AHEAD=pages_ahead,
            WARP_PAGE=warp_page and block_n % num_warps == 0 and bs % (block_n // num_warps) == 0, **common)
    else:
        _decode_kernel[(batch, kv_heads, num_splits)](
            *args, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
            V_T=v_transposed, CVT_EARLY=cvt_early, SWAP=swap, **common)
    if split:
        merge_splits(pm, pl, pacc, out, num_splits)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def decode_attention(
    q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """q [B, H, D] against the paged cache -> out [B, H, D] in q.dtype (seq_lens >= 1)."""
    return decode_attention_launch(q, cache, block_tables, seq_lens, sm_scale)
