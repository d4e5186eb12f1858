"""Quantize-on-write for per-channel keys (KIVI: k.int4-per_channel-asym+v.int4-per_token-asym), on the device.

runtime/channel_keys.py defines the write: a key goes in fp16 to its block's residual slot while the block is
open, and the write that holds a block's 64th key quantizes the whole block with one scale and zero per channel.
The host keeps the slots (channel_keys.plan_write, before the step: a decode step is then one CUDA graph); this
kernel does the rest from the write's slot_mapping and the device map `ResidualSlots.slot_of`:

* K, one program BLOCK_T tokens of a KV head: the fp16 keys into residual slot SLOT_OF[block] (none for a block
  written whole in this write, or a chunk's deferred block); at a block's last position, the block's 64 keys -- row j
  from this write's token t - 63 + j where that token holds position j of the block (a chunk writes a sequence's
  positions in order), else from the residual -- become codes, scales and zeros with kv_quant.quantize_per_channel's
  roundings (IEEE division, zero rounded down, scale up to fp16, half to even).
* V, the same program's other half (program_id 2): int4 per-token asym, write_mixed._tile_write's.

No program reads a residual row that this launch writes: rows of the completing block written here come from k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_cache import LayerCache
from ..kv_format import PER_CHANNEL_TOKENS
from . import codes
from .formats import SCALE_DTYPE_CODES, check_write_inputs
from .write_kv import _to_int
from .write_mixed import _scales_of, _store_scale, _tile_write, _token_slots

BLOCK = PER_CHANNEL_TOKENS
QMAX = tl.constexpr(15.0)  # jit code reads globals only as constexpr
BLOCK_T = 16  # tokens a program: V rows as write_mixed's; K rows to the residual, and the blocks they complete


@triton.jit
def _key_block(K, KC, KS, KZ, RES, SLOTS, t, head, slot, r, stride_kt, stride_kh, stride_cb, stride_ch, stride_ct,
               stride_sb, stride_sh, stride_rs, stride_rh, stride_rt, cols, cm,
               BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE_DT: tl.constexpr):
    """Quantize the block whose last position token t writes: codes [BLOCK, HEAD_DIM / 2], scale and zero
    [HEAD_DIM]."""
    blk = slot // BLOCK
    rows = tl.arange(0, BLOCK)
    src = t - (BLOCK - 1) + rows  # the token of this write that would hold row j
    src_slot = tl.load(SLOTS + src, mask=src >= 0, other=-1)
    here = src_slot == slot - (BLOCK - 1) + rows
    xk = tl.load(K + src[:, None] * stride_kt + head * stride_kh + cols[None, :], mask=here[:, None] & cm[None, :],
                 other=0.0).to(tl.float16)
    rr = tl.maximum(r, 0)  # no residual only where every row is here (channel_keys.plan_write checks)
    xr = tl.load(RES + rr * stride_rs + head * stride_rh + rows[:, None] * stride_rt + cols[None, :],
                 mask=(~here)[:, None] & cm[None, :], other=0.0)
    x = tl.where(here[:, None], xk, xr).to(tl.float32)
    real = cm[None, :] & (x == x)  # NaNs stay out of the min / max (kv_quant.per_channel_scales)
    s, z = _scales_of(x, real, 0, True, QMAX, SCALE_DT)
    meta = blk * stride_sb + head * stride_sh + cols
    _store_scale(KS, meta, s, cm, SCALE_DT)
    _store_scale(KZ, meta, z, cm, SCALE_DT)
    n = _to_int(tl.math.div_rn(x - z[None, :], s[None, :]), 0.0, QMAX, False)
    lo, hi = tl.split(tl.reshape(n, (BLOCK, BLOCK_D // 2, 2)))  # even channel in the low nibble
    half = tl.arange(0, BLOCK_D // 2)
    dst = blk * stride_cb + head * stride_ch + rows[:, None] * stride_ct + half[None, :]
    tl.store(KC + dst, (lo | (hi << 4)).to(tl.uint8), mask=(half < HEAD_DIM // 2)[None, :])


# ints that change step to step add no compiled variants while serving (runtime/warmup.py)
@triton.jit(do_not_specialize=["num_tokens"])
def _write_channel_keys_kernel(
    K, V, KC, VC, KS, KZ, VS, VZ, RES, SLOT_OF, SLOTS, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ch, stride_ct, stride_sb, stride_sh,
    stride_mb, stride_mh, stride_rs, stride_rh, stride_rt,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    SCALE_DT: tl.constexpr,
):
    t0 = tl.program_id(0) * BLOCK_T
    t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
    head = tl.program_id(1)
    mask_t, blk, off = _token_slots(SLOTS, t, num_tokens, BLOCK)
    if tl.program_id(2) == 0:
        cols = tl.arange(0, BLOCK_D)
        cm = cols < HEAD_DIM
        r = tl.load(SLOT_OF + blk, mask=mask_t, other=-1).to(tl.int64)
        m2 = (mask_t & (r >= 0))[:, None] & cm[None, :]  # keys of open blocks: into their residual slot
        k = tl.load(K + t[:, None] * stride_kt + head * stride_kh + cols[None, :], mask=m2, other=0.0)
        tl.store(RES + r[:, None] * stride_rs + head * stride_rh + off[:, None] * stride_rt + cols[None, :],
                 k.to(tl.float16), mask=m2)
        if tl.sum((mask_t & (off == BLOCK - 1)).to(tl.int32), 0) > 0:  # a block's last key: quantize the block
            for i in range(BLOCK_T):
                ti = (t0 + i).to(tl.int64)
                si = tl.load(SLOTS + ti, mask=ti < num_tokens, other=-1)
                if (si >= 0) & (si % BLOCK == BLOCK - 1):
                    ri = tl.load(SLOT_OF + si // BLOCK).to(tl.int64)
                    _key_block(K, KC, KS, KZ, RES, SLOTS, ti, head, si, ri, stride_kt, stride_kh, stride_cb,
                               stride_ch, stride_ct, stride_sb, stride_sh, stride_rs, stride_rh, stride_rt, cols, cm,
                               BLOCK, BLOCK_D, HEAD_DIM, SCALE_DT)
    else:
        _tile_write(V, VC, VS, VZ, t, mask_t, head, stride_vt, stride_vh,
                    blk * stride_cb + head * stride_ch + off * stride_ct, blk * stride_mb + head * stride_mh + off,
                    HEAD_DIM, BLOCK_D, codes.INT4, True, 0, 0.0, QMAX, SCALE_DT, 1, HEAD_DIM, False)


def write_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] (k after RoPE) into a per-channel-key cache at `slot_mapping` [T] int64
    (negative: padding). The host's part of the write (channel_keys.plan_write) must have run for these slots:
    the kernel finds a block's residual slot in `cache.residual.slot_of`."""
    head_dim = cache.k_residual.shape[-1]
    check_write_inputs(cache, k, v, slot_mapping, head_dim)
    if cache.k.shape[2] != BLOCK or cache.fmt.v.scale_torch_dtype != cache.fmt.k.scale_torch_dtype:
        raise ValueError(f"per-channel keys need pages of {BLOCK} positions and one scale dtype for K and V")
    num_tokens, heads = k.shape[0], k.shape[1]
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    res = cache.k_residual
    _write_channel_keys_kernel[(triton.cdiv(num_tokens, BLOCK_T), heads, 2)](
        k, v, cache.k, cache.v, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero, res,
        cache.residual.slot_of, slot_mapping.contiguous(), num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *cache.k.stride()[:3],
        cache.k_scale.stride(0), cache.k_scale.stride(1), cache.v_scale.stride(0), cache.v_scale.stride(1),
        *res.stride()[:3],
        BLOCK=BLOCK, HEAD_DIM=head_dim, BLOCK_D=max(2, triton.next_power_of_2(head_dim)), BLOCK_T=BLOCK_T,
        SCALE_DT=SCALE_DTYPE_CODES[cache.fmt.k.scale_torch_dtype], num_warps=4,
    )
