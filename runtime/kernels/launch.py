"""The kernels' public ops (runtime/attention.py's signatures, plus `plan=`): validate the arguments, make the
default plan where none is given (`plan.py`), launch. A plan's values go to the kernels as they are; what depends
on the tensors themselves (strides, the split's partial buffers, int32 offsets where the cache allows) is derived
here.
"""

from __future__ import annotations

import torch
import triton

from ..kv_cache import LayerCache
from . import codes, decode_channel_keys, decode_gluon, launch_mixed, write_channel_keys
from .decode_tiles import _decode_kernel
from .decode_warps import _decode_kernel_warps
from .formats import (
    Q_DTYPES,
    check_decode_inputs,
    check_device,
    check_q,
    check_write_inputs,
    kernel_format,
    kernel_formats,
    meta_strides,
    out_dtype,
    scale_tensors,
    served_by_mixed,
    write_fp8,
)
from .gluon_tiles import ring_descriptors
from .plan import (
    KERNELS,
    DecodePlan,
    PrefillPlan,
    WritePlan,
    bad_plan,
    check_fast_write,
    decode_plan,
    dot_mode,
    prefill_plan,
    rows_fit,
    split_tile,
    warp_page_fits,
    write_plan,
)
from .prefill_context import _prefill_context_kernel
from .split_k import merge_partials, split_plan, splits_write_partials
from .tuned_file import device_of
from .widen_ptx import widen_asm
from .write_kv import _write_kv_kernel

_LOG2E = 1.4426950408889634

def decode_plan_for(q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor) -> DecodePlan:
    """The default plan of a `decode_attention` call with these tensors."""
    _, kv_heads, bs, _ = cache.k.shape
    batch, heads, head_dim = q.shape
    return decode_plan(cache.fmt, batch, heads, kv_heads, block_tables.shape[1] * bs, device_of(q.device),
                       head_dim=head_dim, block_size=bs, q_dtype=q.dtype)


def decode_attention(q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float, plan: DecodePlan | None = None) -> torch.Tensor:
    """q [B, H, D] against the paged cache -> out [B, H, D] in q.dtype (seq_lens >= 1). block_tables: int32
    [B, max_blocks]; its width bounds the context (no device sync)."""
    if cache.fmt.per_channel_keys:
        plan = decode_plan_for(q, cache, block_tables) if plan is None else plan
        return decode_channel_keys.decode_attention(q, cache, block_tables, seq_lens, sm_scale, plan)
    if served_by_mixed(cache.fmt):
        return _decode_mixed_format(q, cache, block_tables, seq_lens, sm_scale, plan)
    kf = kernel_format(cache)
    check_decode_inputs(q, cache, kf, block_tables, seq_lens)
    _, kv_heads, bs, stored = cache.k.shape
    batch, num_heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=out_dtype(q.dtype), device=q.device)
    if batch == 0:
        return out.to(q.dtype)
    plan = decode_plan_for(q, cache, block_tables) if plan is None else plan
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    group = num_heads // kv_heads
    max_tokens = block_tables.shape[1] * bs  # an upper bound that needs no device sync
    qk_scale = sm_scale * _LOG2E
    if plan.kernel == "gluon":
        _check_gluon_plan(plan, kf, q, bs, group)  # before the split buffers: no partial output
        splits = split_plan(out, max_tokens, plan.splits, split_tile(plan), cache, plan.split_tokens)
        _launch_gluon(q, cache, kf, block_tables, seq_lens, qk_scale, out, splits, plan)
        return out
    if plan.kernel not in KERNELS:
        raise bad_plan(plan, "kernel", f"choose {', '.join(KERNELS)}")
    if (plan.kernel == "tiles") != (kf.scale_mode == codes.NO_SCALE):
        raise bad_plan(plan, "kernel", f"the {cache.fmt.name} format runs on "
                       f"{'tiles' if kf.scale_mode == codes.NO_SCALE else 'warps or gluon'}")
    if plan.kernel == "warps" and (plan.block_n < 16 or plan.block_n % plan.num_warps
                                   or plan.block_n // plan.num_warps < 16):
        raise bad_plan(plan, "block_n", "the per-warp kernel needs >= 16 tokens a warp (block_n / num_warps)")
    if plan.kernel == "warps" and plan.warp_page and not warp_page_fits(plan.block_n, plan.num_warps, bs):
        raise bad_plan(plan, "warp_page", f"a warp's {plan.block_n // plan.num_warps} tokens do not divide pages "
                       f"of {bs}")
    cuda = q.device.type == "cuda"
    dot = dot_mode(q.dtype, device_of(q.device))
    if plan.dot_fp16 and dot != codes.DOT_NATIVE:
        raise bad_plan(plan, "dot_fp16", "fp16 dots need fp16 / bf16 q on the GPU's tensor cores")
    asm = ("", "")
    if plan.widen_ptx:
        if not (cuda and dot == codes.DOT_NATIVE and kf.kind != codes.FLOAT):
            raise bad_plan(plan, "widen_ptx", "the PTX widening serves int8 / int4 pages on the GPU")
        asm = widen_asm(4 if kf.kind == codes.INT4 else 8, torch.float16 if plan.dot_fp16 else q.dtype, not kf.asym)
    splits = split_plan(out, max_tokens, plan.splits, split_tile(plan), cache, plan.split_tokens)
    tokens_per_split, num_splits, (pm, pl, pacc) = splits
    split = splits_write_partials(splits, bool(plan.split_tokens))
    block_d = max(16, triton.next_power_of_2(stored))
    args = (q, cache.k, cache.v, *scale_tensors(cache, cache.k), block_tables, seq_lens, out, pm, pl, pacc,
            qk_scale, tokens_per_split, num_splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            cache.k.stride(0), cache.k.stride(1), cache.k.stride(2), *meta_strides(kf, cache))
    common = dict(NUM_HEADS=num_heads, BLOCK_SIZE=bs, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT=split,
                  DOT=dot, FULL_D=block_d == stored, num_warps=plan.num_warps, num_stages=plan.num_stages,
                  **({"maxnreg": plan.registers} if plan.registers and cuda else {}))
    if plan.kernel == "warps":
        _decode_kernel_warps[(batch, kv_heads, num_splits)](
            *args, BLOCK_H=max(4, triton.next_power_of_2(group)), W=plan.num_warps, NW=plan.block_n // plan.num_warps,
            HEADS_N=plan.heads_n, PAGES_AHEAD=plan.pages_ahead, WARP_PAGE=plan.warp_page, **common,
            KIND=kf.kind, SCALE_MODE=kf.scale_mode, ASYM=kf.asym, ASM_LO=asm[0], ASM_HI=asm[1],
            DOT_F16=plan.dot_fp16, P_SCALE=plan.p_scale)
    else:
        _decode_kernel[(batch, kv_heads, num_splits)](
            *args, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=plan.block_n, **common)
    merge_partials(splits, out, seq_lens, bool(plan.split_tokens))
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _decode_mixed_format(q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         sm_scale: float, plan: DecodePlan | None) -> torch.Tensor:
    """`decode_attention` for the formats of `formats.served_by_mixed`: on the Gluon kernel where the plan says so
    (`decode_gluon.serves_mixed`: K/V-split formats, group 64, int4 group 32), everything else on `launch_mixed`'s
    kernel."""
    kf_k, kf_v = kernel_formats(cache)
    check_decode_inputs(q, cache, kf_k, block_tables, seq_lens)
    _, kv_heads, bs, _ = cache.k.shape
    plan = decode_plan_for(q, cache, block_tables) if plan is None else plan
    if plan.kernel != "gluon":
        return launch_mixed.decode_attention(q, cache, block_tables, seq_lens, sm_scale, plan)
    batch, num_heads, _ = q.shape
    group = num_heads // kv_heads
    if plan.pairs or (plan.stages or plan.tma) and not (kf_k.groups > 1 and plan.tma and plan.stages):
        raise bad_plan(plan, "stages", "the mixed formats load their tiles into registers, int4 group scales also "
                       "through the TMA ring (stages > 0 with tma=True); use stages=0, pairs=False, tma=False")
    if not (decode_gluon.supported(kf_k, q, bs, group) and decode_gluon.serves_mixed(kf_k, kf_v, bs, group)):
        raise bad_plan(plan, "kernel", "the Gluon kernel serves K/V-split formats of per-token scales and integer "
                       f"formats of {decode_gluon.GROUPS_SERVED} group scales (no e8m0), on CUDA with fp16 / bf16 q, "
                       "head_dim 128, <= 8 query heads per KV head and pages of 16k tokens; choose mixed")
    _check_gluon_plan(plan, kf_k, q, bs, group)
    out = torch.empty(q.shape, dtype=out_dtype(q.dtype), device=q.device)
    if batch == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    splits = split_plan(out, block_tables.shape[1] * bs, plan.splits, decode_gluon.TILE, cache, plan.split_tokens)
    _launch_gluon(q, cache, kf_k, block_tables, seq_lens.contiguous(), sm_scale * _LOG2E, out, splits, plan,
                  kf_v if kf_v != kf_k else None)
    return out


def _check_gluon_plan(plan: DecodePlan, kf, q: torch.Tensor, block_size: int, group: int) -> None:
    if plan.stages and kf.kind != codes.INT4:
        raise bad_plan(plan, "stages", "the shared-memory ring serves int4 formats only; use 0")
    if plan.pairs and plan.stages < 4:
        raise bad_plan(plan, "pairs", "tiles two a step need a ring of >= 4 stages")
    if plan.tma and not plan.stages:
        raise bad_plan(plan, "tma", "the TMA unit fills the ring: it needs stages > 0")
    if plan.k_chains not in (1, 2):
        raise bad_plan(plan, "k_chains", "use 1 or 2")
    if not decode_gluon.supported(kf, q, block_size, group):
        raise bad_plan(plan, "kernel", "the Gluon kernel serves CUDA fp16 / bf16 q, head_dim 128, <= 8 query heads "
                       "per KV head, pages of 16k tokens and quantized formats; choose warps or tiles")


def _launch_gluon(q, cache: LayerCache, kf, block_tables, seq_lens, qk_scale: float, out: torch.Tensor,
                  splits: tuple, plan: DecodePlan, kf_v=None) -> None:
    """The Gluon kernel (and the split-K merge) into `out`; splits: `split_k.split_plan`'s (tokens per split, splits,
    partial buffers); kf_v: V's format where it differs from K's (`kf`)."""
    batch, num_heads, _ = q.shape
    _, kv_heads, bs, _ = cache.k.shape
    tokens_per_split, num_splits, (pm, pl, pacc) = splits
    split = splits_write_partials(splits, bool(plan.split_tokens))
    kw, vw = cache.k.view(torch.int32), cache.v.view(torch.int32)
    v_format = kf if kf_v is None else kf_v
    dequant = decode_gluon.dequantized(kf, v_format)
    scale_args = scale_tensors(cache, cache.k)
    pages = (kw, vw, *scale_args)
    if plan.tma:
        metas = scale_args if kf.scale_mode == codes.PER_TOKEN else ()
        # formats without zero points pass the scales' descriptors in their places (never read)
        metas = metas[:2] * 2 if metas and not kf.asym else metas
        described = ring_descriptors(kw, vw, metas, kf.groups)
        pages = described + pages[len(described):]
    decode_gluon._decode_kernel_gluon[(batch, kv_heads, num_splits)](
        q, *pages, block_tables, seq_lens, out, pm, pl, pacc,
        qk_scale, tokens_per_split, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kw.stride(0), kw.stride(1), kw.stride(2), *meta_strides(kf, cache), vw.stride(0), vw.stride(1), vw.stride(2),
        NUM_HEADS=num_heads, BLOCK_SIZE=bs, GROUP=num_heads // kv_heads, KIND=kf.kind,
        SCALE_MODE=kf.scale_mode, ASYM=kf.asym, **decode_gluon.widening(kf, kf_v), SPLIT=split,
        SKIP_RESCALE=plan.skip_rescale, STAGES=plan.stages,
        OFF32=plan.offsets32 and cache.k.numel() // 4 < 2**31, PAIRS=plan.pairs, K_CHAINS=plan.k_chains,
        TMA=plan.tma, **({"V_KIND": kf_v.kind, "V_ASYM": kf_v.asym} if kf_v is not None else {}),
        **({"GROUPS": kf.groups, "DEQUANT": True, "V_GROUPS": v_format.groups} if dequant else {}),
        num_warps=1, **({"maxnreg": plan.registers} if plan.registers else {}),
    )
    merge_partials(splits, out, seq_lens, bool(plan.split_tokens))


# The write kernels address a token's source row in 32 bits (a token index times its stride): a call over
# more elements than this goes in pieces. An engine's step writes far fewer; a benchmark filling a pool may not.
MAX_WRITE_ELEMENTS = 2**31


def write_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             plan: WritePlan | None = None) -> None:
    """Quantize k, v [T, kv_heads, head_dim] (after RoPE) into `cache` at `slot_mapping` [T] int64 (negative slots:
    padding, skipped); the bytes equal `kv_quant.quantize`'s."""
    if cache.fmt.per_channel_keys:  # one launch: a block's last key reads the write's other keys of the block
        return write_channel_keys.write_kv(cache, k, v, slot_mapping)
    if k.dim() == 3 and v.dim() == 3 and k.shape[0] > 1:
        span = max(k.stride(0), v.stride(0), k.shape[1] * k.shape[2], v.shape[1] * v.shape[2])  # one token's
        rows = max(1, MAX_WRITE_ELEMENTS // span)
        if k.shape[0] > rows:
            for a in range(0, k.shape[0], rows):
                write_kv(cache, k[a:a + rows], v[a:a + rows], slot_mapping[a:a + rows], plan)
            return
    if served_by_mixed(cache.fmt):
        return launch_mixed.write_kv(cache, k, v, slot_mapping, plan)
    kf = kernel_format(cache)
    _, heads, bs, stored = cache.k.shape
    check_write_inputs(cache, k, v, slot_mapping, kf.head_dim)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    plan = write_plan(cache.fmt, num_tokens, heads, device_of(k.device), head_dim=kf.head_dim,
                      k_dtype=k.dtype) if plan is None else plan
    _check_write_plan(plan, kf, k)
    if kf.scale_mode == codes.NO_SCALE and k.dtype != cache.k.dtype:
        k, v = k.to(cache.k.dtype), v.to(cache.k.dtype)  # a float->float cast is torch's job (the interpreter truncates)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    slot_mapping = slot_mapping.contiguous()
    # fp8 pages are written as bytes by the integer encoder, or on the GPU by the hardware conversion
    fp8_pages = kf.fp8 != codes.FP8_NONE
    kc, vc = (cache.k.view(torch.uint8), cache.v.view(torch.uint8)) if fp8_pages else (cache.k, cache.v)
    ks, vs, kz, vz = scale_tensors(cache, kc)
    _write_kv_kernel[(triton.cdiv(num_tokens, plan.block_t), heads)](
        k, v, kc, vc, ks, vs, kz, vz, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), heads * bs, bs,
        BLOCK_SIZE=bs, HEAD_DIM=kf.head_dim, BLOCK_D=triton.next_power_of_2(stored), BLOCK_T=plan.block_t,
        KIND=kf.kind, SCALE_MODE=kf.scale_mode, ASYM=kf.asym, FP8=write_fp8(kf.fp8, plan.fast), QMIN=kf.qmin,
        QMAX=kf.qmax,
        SCALE_DT=kf.scale_dtype, FULL_D=triton.next_power_of_2(stored) == stored, FAST=plan.fast, LANES=plan.lanes,
        PACKED=plan.packed, num_warps=plan.num_warps,
    )


def _check_write_plan(plan: WritePlan, kf, k: torch.Tensor) -> None:
    check_fast_write(plan, k.device)
    if plan.lanes not in (0, 2, 4, 8, 16) or (plan.lanes and not rows_fit(kf.head_dim, plan.lanes)):
        raise bad_plan(plan, "lanes", f"use 0, or 2 / 4 / 8 / 16 with >= 8 columns a lane of head_dim {kf.head_dim}")
    words = plan.fast and k.dtype == torch.bfloat16 and kf.scale_mode == codes.PER_TOKEN \
        and kf.scale_dtype == codes.SCALE_FP16
    if plan.packed and not (plan.lanes and words):
        raise bad_plan(plan, "packed", "packed rows need lanes, fast, bf16 k / v and fp16 per-token scales")
    if plan.lanes and kf.kind != codes.INT4 and not plan.packed:
        raise bad_plan(plan, "lanes", "int8 / fp8 rows are stored from words (packed=True)")


def prefill_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                              cache: LayerCache, block_tables: torch.Tensor, context_lens: torch.Tensor,
                              sm_scale: float, plan: PrefillPlan | None = None) -> torch.Tensor:
    """runtime/attention.py's prefill_context_attention, reading the context from the pages in place. Only shapes and
    dtypes are checked: values of cu_seqlens / context_lens stay on the device (no host sync; a mixed-format cache
    reads context_lens once to size its pages read back, `launch_mixed.context_pages`); a context longer than the
    block table's width is cut to it, as in decode."""
    check_device(q, k, v, cu_seqlens, context_lens, cache.k, block_tables)
    if served_by_mixed(cache.fmt):
        kernel_formats(cache)  # the stored formats are ones the mixed kernels serve
        cache, block_tables = launch_mixed.context_pages(cache, block_tables, context_lens, q.dtype)
        plan = None  # the caller's plan was for the stored format
    kf = kernel_format(cache)
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
    plan = prefill_plan(cache.fmt, device_of(q.device), q_dtype=q.dtype) if plan is None else plan
    for name in ("block_m", "block_n"):
        val = getattr(plan, name)
        if val < 16 or val & (val - 1):
            raise bad_plan(plan, name, "use a power of two >= 16 (a tensor-core tile)")
    if plan.p_scale and not (kf.scale_mode == codes.PER_TOKEN and not kf.asym and q.dtype == torch.bfloat16):
        raise bad_plan(plan, "p_scale", "V's scales on p serve symmetric per-token formats with bf16 q")
    group = num_heads // kv_heads
    rows = max(plan.block_m, triton.next_power_of_2(group))
    tile_m = rows // group
    out = torch.empty(q.shape, dtype=out_dtype(q.dtype), device=q.device)
    if chunks == 0 or tokens == 0:
        return out.to(q.dtype)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    block_d = max(16, triton.next_power_of_2(stored))
    grid = (triton.cdiv(tokens, tile_m) + chunks, kv_heads)  # >= the chunks' tiles: each adds <= 1 partial tile
    _prefill_context_kernel[grid](
        q, k, v, cache.k, cache.v, *scale_tensors(cache, cache.k), block_tables, cu_seqlens.contiguous(),
        context_lens.contiguous(), out, sm_scale * _LOG2E, block_tables.shape[1] * bs, chunks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), cache.k.stride(0), cache.k.stride(1), cache.k.stride(2), *meta_strides(kf, cache),
        GROUP=group, ROWS=rows, TILE_M=tile_m, BLOCK_C=max(16, triton.next_power_of_2(chunks)), BLOCK_SIZE=bs,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=plan.block_n,
        KIND=kf.kind, SCALE_MODE=kf.scale_mode, ASYM=kf.asym, DOT=dot_mode(q.dtype, device_of(q.device)),
        FULL_D=block_d == stored, ALIGN=16 if stored % 16 == 0 else 1, P_SCALE=plan.p_scale,
        META_I64=kf.scale_mode == codes.PER_TOKEN and cache.k_scale.numel() >= 2**31,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    return out if out.dtype == q.dtype else out.to(q.dtype)

