"""Decode attention over per-channel keys (KIVI: k.int4-per_channel-asym+v.int4-per_token-asym), split-K.

The position rule of runtime/channel_keys.py: the query at position L - 1 reads its own block's keys in fp16
(the residual block the write keeps until the block's 64th key) and every earlier block's keys quantized. One
program serves one (sequence, KV head, split); a split covers whole blocks, so every tile of BLOCK keys is one
paged block with one scale and zero per channel:

    q . k_t = sum_c q_c (code_tc s_c + z_c) = (q * s) . code_t + q . z

so the block's scales fold into q (a [heads, head_dim] multiply a block) and its zeros into one bias per head,
and the codes enter the score dot as they are (exact in fp16 / bf16). int4 codes are two a byte along the
channels, so q splits into its even (low nibble) and odd columns, as for every int4 format here. V is int4
per-token asym: its scale folds into p and its zero into sum(p z) (`_values`). The split that holds the
sequence's own block reads it from the residual slot `SLOT[block]` (a device map the write keeps:
kv_cache.ResidualSlots), so a launch needs no host-side lookup. On CUDA at head_dim 128 `decode_attention` runs
the Gluon kernel of the same rule (decode_channel_keys_gluon.py) instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_cache import LayerCache
from ..kv_format import PER_CHANNEL_TOKENS
from . import codes, decode_channel_keys_gluon
from .dequant import _dot, _operand, _unpack
from .group_io import _program_tokens, _softmax_step, _store_group
from .plan import CHANNEL_KEYS, CHANNEL_KEYS_GLUON, DecodePlan, dot_mode
from .split_k import merge_partials, split_plan, splits_write_partials
from .tuned_file import device_of
from .widen_ptx import widen_asm

BLOCK = PER_CHANNEL_TOKENS
_LOG2E = 1.4426950408889634


@triton.jit
def _codes(raw, HALF: tl.constexpr, ASM_LO: tl.constexpr, ASM_HI: tl.constexpr, dt: tl.constexpr,
           DOT: tl.constexpr):
    """One nibble of each stored byte (HALF 0: low) as exact 0..15 dot operands."""
    return _operand(_unpack(raw, HALF, codes.INT4, True, ASM_LO, ASM_HI, dt), dt, DOT)


@triton.jit
def _page_rows(X, rows, offs_c, cmask, FULL_D: tl.constexpr):
    """A block's stored rows [BLOCK, HALF_D]; no column mask at a power-of-two head_dim (a mask along the row
    would split the vector loads)."""
    if FULL_D:
        raw = tl.load(X + rows[:, None] + offs_c[None, :])
    else:
        raw = tl.load(X + rows[:, None] + offs_c[None, :], mask=cmask[None, :], other=0)
    return raw


@triton.jit
def _values(s, m_i, l_i, acc_a, acc_b, V, VS, VZ, rows, meta, cmask, offs_c, dt: tl.constexpr,
            DOT: tl.constexpr, ASM_LO: tl.constexpr, ASM_HI: tl.constexpr, FULL_D: tl.constexpr):
    """One online-softmax step over score tile s [BLOCK_H, BLOCK] and its int4 per-token asym values: p carries
    V's per-token scale, sum(p z) its zero point (added to both halves of head_dim)."""
    m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
    vraw = _page_rows(V, rows, offs_c, cmask, FULL_D)
    vs = tl.load(VS + meta).to(tl.float32)
    vz = tl.load(VZ + meta).to(tl.float32)
    pv = _operand(p * vs[None, :], dt, DOT)
    zsum = tl.sum(p * vz[None, :], 1)[:, None]
    acc_a = acc_a * alpha[:, None] + _dot(pv, _codes(vraw, 0, ASM_LO, ASM_HI, dt, DOT), DOT) + zsum
    acc_b = acc_b * alpha[:, None] + _dot(pv, _codes(vraw, 1, ASM_LO, ASM_HI, dt, DOT), DOT) + zsum
    return m_i, l_i, acc_a, acc_b


# ints that change step to step add no compiled variants while serving (runtime/warmup.py)
@triton.jit(do_not_specialize=["num_splits", "tokens_per_split", "stride_btb"])
def _decode_channel_keys_kernel(
    Q, K, V, KS, KZ, VS, VZ, RES, SLOT, BT, SEQ, OUT, PM, PL, PACC,
    qk_scale, tokens_per_split, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_btb,
    stride_pb, stride_ph, stride_pt, stride_sb, stride_sh, stride_mb, stride_mh, stride_rs, stride_rh, stride_rt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF_D: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr, DOT_F16: tl.constexpr,
    ASM_LO: tl.constexpr, ASM_HI: tl.constexpr, FULL_D: tl.constexpr,
):
    b, kvh, sp, start, end = _program_tokens(SEQ, tokens_per_split)
    seq_len = tl.load(SEQ + b)
    own = (seq_len - 1) // BLOCK * BLOCK  # the query's own block: fp16 keys from the residual
    if DOT_F16:  # fp16 operands (q / 16: q * s stays within fp16's range), else q's dtype
        dt = tl.float16
        pre = 0.0625
    else:
        dt = Q.dtype.element_ty
        pre = 1.0
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    offs_c = tl.arange(0, HALF_D)
    cmask = offs_c < HEAD_DIM // 2
    cols_a = 2 * offs_c  # low nibbles: even channels
    cols_b = 2 * offs_c + 1
    q_row = b * stride_qb + heads * stride_qh
    qm = hmask[:, None] & cmask[None, :]
    q_a = tl.load(Q + q_row[:, None] + cols_a[None, :], mask=qm, other=0.0).to(tl.float32)
    q_b = tl.load(Q + q_row[:, None] + cols_b[None, :], mask=qm, other=0.0).to(tl.float32)
    offs_t = tl.arange(0, BLOCK)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros([BLOCK_H, HALF_D], tl.float32)
    acc_b = tl.zeros([BLOCK_H, HALF_D], tl.float32)
    bt_row = BT + b * stride_btb
    stop = tl.minimum(end, own)
    # a block's page is loaded an iteration ahead: Triton's pipeliner buffers K and V loads only when their
    # addresses come from a loop-carried value (group_io._tile_pages)
    page_next = tl.load(bt_row + start // BLOCK, mask=start < stop, other=0)
    for n0 in range(start, stop, BLOCK):  # complete blocks: quantized keys
        page = page_next.to(tl.int64)
        page_next = tl.load(bt_row + n0 // BLOCK + 1, mask=n0 + BLOCK < stop, other=0)
        chan = page * stride_sb + kvh * stride_sh
        s_a = tl.load(KS + chan + cols_a, mask=cmask, other=0.0).to(tl.float32)
        s_b = tl.load(KS + chan + cols_b, mask=cmask, other=0.0).to(tl.float32)
        z_a = tl.load(KZ + chan + cols_a, mask=cmask, other=0.0).to(tl.float32)
        z_b = tl.load(KZ + chan + cols_b, mask=cmask, other=0.0).to(tl.float32)
        rows = page * stride_pb + kvh * stride_ph + offs_t * stride_pt
        if FULL_D:  # rows of a power-of-two number of bytes start 16-byte aligned: vector loads
            rows = tl.multiple_of(rows, 16)
        kraw = _page_rows(K, rows, offs_c, cmask, FULL_D)
        s = _dot(_operand(q_a * (s_a * pre)[None, :], dt, DOT), tl.trans(_codes(kraw, 0, ASM_LO, ASM_HI, dt, DOT)), DOT)
        s += _dot(_operand(q_b * (s_b * pre)[None, :], dt, DOT), tl.trans(_codes(kraw, 1, ASM_LO, ASM_HI, dt, DOT)), DOT)
        bias = tl.sum(q_a * z_a[None, :], 1) + tl.sum(q_b * z_b[None, :], 1)
        s = (s / pre + bias[:, None]) * qk_scale
        meta = page * stride_mb + kvh * stride_mh + offs_t
        m_i, l_i, acc_a, acc_b = _values(s, m_i, l_i, acc_a, acc_b, V, VS, VZ, rows, meta, cmask, offs_c, dt, DOT,
                                          ASM_LO, ASM_HI, FULL_D)
    if (start <= own) & (own < end):  # this split holds the own block
        page = tl.load(bt_row + own // BLOCK).to(tl.int64)
        slot = tl.maximum(tl.load(SLOT + page), 0).to(tl.int64)  # -1: a CUDA graph's padding row (output dropped)
        nmask = own + offs_t < seq_len
        res = slot * stride_rs + kvh * stride_rh + offs_t * stride_rt
        rm = nmask[:, None] & cmask[None, :]
        k_a = tl.load(RES + res[:, None] + cols_a[None, :], mask=rm, other=0.0)
        k_b = tl.load(RES + res[:, None] + cols_b[None, :], mask=rm, other=0.0)
        s = _dot(_operand(q_a * pre, dt, DOT), tl.trans(_operand(k_a, dt, DOT)), DOT)
        s += _dot(_operand(q_b * pre, dt, DOT), tl.trans(_operand(k_b, dt, DOT)), DOT)
        s = tl.where(nmask[None, :], s * (qk_scale / pre), float("-inf"))
        rows = page * stride_pb + kvh * stride_ph + offs_t * stride_pt
        meta = page * stride_mb + kvh * stride_mh + offs_t
        m_i, l_i, acc_a, acc_b = _values(s, m_i, l_i, acc_a, acc_b, V, VS, VZ, rows, meta, cmask, offs_c, dt, DOT,
                                          ASM_LO, ASM_HI, FULL_D)
    _store_group(OUT, PM, PL, PACC, acc_a, acc_b, m_i, l_i, b, sp, heads, hmask, cols_a, cols_b, cmask, num_splits,
                 stride_ob, stride_oh, NUM_HEADS, HEAD_DIM, codes.INT4, SPLIT)


def decode_attention(q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float, plan: DecodePlan) -> torch.Tensor:
    """q [B, H, D] at positions seq_lens - 1 (their keys already written) -> out [B, H, D] in q.dtype.
    block_tables: int32 [B, max_blocks] of blocks of BLOCK positions; its width bounds the context (no sync).
    plan: plan.decode_plan's for the format: kernel "channel_keys" (this module's Triton kernel; its splits,
    num_warps, num_stages) or "channel_keys_gluon" (decode_channel_keys_gluon.py; its splits, registers, k_chains)."""
    if plan.kernel not in (CHANNEL_KEYS, CHANNEL_KEYS_GLUON) or plan.split_tokens:
        raise ValueError(f"DecodePlan.kernel={plan.kernel!r}, split_tokens={plan.split_tokens}: per-channel keys run "
                         f"the {CHANNEL_KEYS!r} or {CHANNEL_KEYS_GLUON!r} kernel with `splits`; make the plan with "
                         "runtime.kernels.decode_plan")
    batch, num_heads, head_dim = q.shape
    _, kv_heads, bs, _ = cache.k.shape
    if bs != BLOCK or cache.residual is None or cache.v.shape != cache.k.shape:
        raise ValueError(f"per-channel keys need K and V pages of {BLOCK} positions and residual blocks "
                         "(kv_cache.allocate_layer)")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    max_tokens = block_tables.shape[1] * bs
    splits = split_plan(out, max_tokens, plan.splits, BLOCK, cache)
    tokens_per_split, launch_splits, (pm, pl, pacc) = splits
    group = num_heads // kv_heads
    if plan.kernel == CHANNEL_KEYS_GLUON:
        if not decode_channel_keys_gluon.serves(device_of(q.device), q.dtype, group, head_dim):
            raise ValueError(f"DecodePlan.kernel={CHANNEL_KEYS_GLUON!r} needs fp16 / bf16 q on CUDA, head_dim 128 and "
                             f"<= 8 query heads per KV head (got {q.dtype}, head_dim {head_dim}, group {group}); make "
                             "the plan with runtime.kernels.decode_plan")
        decode_channel_keys_gluon.launch(q, cache, block_tables, seq_lens, sm_scale * _LOG2E, out, splits,
                                         splits_write_partials(splits, False), plan)
        merge_partials(splits, out, seq_lens, False)
        return out
    res = cache.k_residual
    dot = dot_mode(q.dtype, device_of(q.device))
    if (plan.dot_fp16 or plan.widen_ptx) and not (q.is_cuda and dot == codes.DOT_NATIVE):
        raise ValueError("DecodePlan.dot_fp16 / widen_ptx: fp16 dots and the PTX widening need fp16 / bf16 q on the "
                         "GPU's tensor cores; make the plan with runtime.kernels.decode_plan")
    half_d = max(16, triton.next_power_of_2(head_dim // 2))  # the int4 pages' bytes a row, as a power of two
    asm = widen_asm(4, torch.float16 if plan.dot_fp16 else q.dtype, False) if plan.widen_ptx else ("", "")
    _decode_channel_keys_kernel[(batch, kv_heads, launch_splits)](
        q, cache.k, cache.v, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero, res,
        cache.residual.slot_of, block_tables, seq_lens, out, pm, pl, pacc,
        sm_scale * _LOG2E, tokens_per_split, launch_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2), cache.k_scale.stride(0), cache.k_scale.stride(1),
        cache.v_scale.stride(0), cache.v_scale.stride(1), res.stride(0), res.stride(1), res.stride(2),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HALF_D=half_d, BLOCK=BLOCK,
        SPLIT=splits_write_partials(splits, False), DOT=dot, DOT_F16=plan.dot_fp16, ASM_LO=asm[0], ASM_HI=asm[1],
        FULL_D=half_d == head_dim // 2,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    merge_partials(splits, out, seq_lens, False)
    return out
