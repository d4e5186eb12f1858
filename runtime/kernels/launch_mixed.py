"""The public ops for the mixed formats (`formats.served_by_mixed`: K and V stored differently, group scales, e8m0
scales): `launch.py` hands such caches here (decode: unless the plan runs the Gluon kernel,
`plan.mixed_gluon_serves`). Same signatures and checks; the kernels are `write_mixed.py` and `decode_mixed.py`.
Chunked prefill reads the chunks' context pages back unquantized (`context_pages`) for the prefill-context kernel,
which reads one stored format per cache."""

from __future__ import annotations

import itertools

import torch
import triton

from .. import attention as reference
from ..kv_cache import LayerCache
from ..kv_format import KVFormat
from .decode_mixed import _decode_mixed_kernel
from .formats import (
    KernelFormat,
    check_decode_inputs,
    check_write_inputs,
    kernel_formats,
    out_dtype,
    write_fp8,
)
from .plan import (
    MIXED,
    DecodePlan,
    WritePlan,
    bad_plan,
    check_fast_write,
    decode_plan,
    dot_mode,
    mixed_row_lanes,
    write_plan,
)
from .split_k import merge_partials, split_plan, splits_write_partials
from .tuned_file import device_of
from .write_mixed import _write_mixed_kernel

_LOG2E = 1.4426950408889634



def _meta(cache: LayerCache) -> tuple[torch.Tensor, ...]:
    """(k_scale, v_scale, k_zero, v_zero) as the kernels read them: e8m0 as bytes, absent ones replaced by a
    tensor the compile-time branches never touch."""
    def view(t):
        if t is None:
            return cache.k
        return t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t
    return tuple(view(t) for t in (cache.k_scale, cache.v_scale, cache.k_zero, cache.v_zero))


def _pages(cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages as the write addresses them: fp8 as bytes (its integer encoder stores bytes)."""
    def view(t):
        return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
    return view(cache.k), view(cache.v)


def _side(kf: KernelFormat, prefix: str) -> dict:
    return {f"{prefix}_KIND": kf.kind, f"{prefix}_ASYM": kf.asym, f"{prefix}_GROUPS": kf.groups}


def write_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             plan: WritePlan | None = None) -> None:
    """`launch.write_kv` for a mixed-format cache; the bytes equal `kv_quant.quantize_dynamic`'s."""
    kf_k, kf_v = kernel_formats(cache)
    _, heads, bs, _ = cache.k.shape
    head_dim = kf_k.head_dim
    check_write_inputs(cache, k, v, slot_mapping, head_dim)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    plan = write_plan(cache.fmt, num_tokens, heads, device_of(k.device), head_dim=head_dim,
                      k_dtype=k.dtype) if plan is None else plan
    check_fast_write(plan, k.device)
    lanes = (0, 0)
    if plan.lanes or plan.packed:
        rows = mixed_row_lanes(cache.fmt, head_dim, plan.lanes, plan.fast, k.dtype if k.dtype == v.dtype else None)
        if not (plan.packed and rows):
            raise bad_plan(plan, "lanes", "the mixed write's rows need packed=True, fast, bf16 k / v, fp16 per-token "
                           f"scales and >= 2 lanes of >= 8 columns a side in head_dim {head_dim}; or lanes=0, "
                           "packed=False (the tile)")
        lanes = rows
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    kc, vc = _pages(cache)
    _write_mixed_kernel[(triton.cdiv(num_tokens, plan.block_t), heads, 2)](
        k, v, kc, vc, *_meta(cache), slot_mapping.contiguous(), num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *kc.stride()[:3], *vc.stride()[:3], heads * bs, bs,
        BLOCK_SIZE=bs, HEAD_DIM=head_dim, BLOCK_D=max(2, triton.next_power_of_2(head_dim)), BLOCK_T=plan.block_t,
        K_KIND=kf_k.kind, K_ASYM=kf_k.asym, K_FP8=write_fp8(kf_k.fp8, plan.fast), K_QMIN=kf_k.qmin, K_QMAX=kf_k.qmax,
        K_GROUPS=kf_k.groups, V_KIND=kf_v.kind, V_ASYM=kf_v.asym, V_FP8=write_fp8(kf_v.fp8, plan.fast),
        V_QMIN=kf_v.qmin, V_QMAX=kf_v.qmax, V_GROUPS=kf_v.groups,
        SCALE_DT=kf_k.scale_dtype, FAST=plan.fast, K_LANES=lanes[0], V_LANES=lanes[1], num_warps=plan.num_warps,
    )


def decode_attention(q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float, plan: DecodePlan | None = None) -> torch.Tensor:
    """`launch.decode_attention` for a mixed-format cache."""
    kf_k, kf_v = kernel_formats(cache)
    check_decode_inputs(q, cache, kf_k, block_tables, seq_lens)
    _, kv_heads, bs, _ = cache.k.shape
    batch, num_heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=out_dtype(q.dtype), device=q.device)
    if batch == 0:
        return out.to(q.dtype)
    max_tokens = block_tables.shape[1] * bs  # an upper bound that needs no device sync
    if plan is None:
        plan = decode_plan(cache.fmt, batch, num_heads, kv_heads, max_tokens, device_of(q.device),
                           head_dim=head_dim, block_size=bs, q_dtype=q.dtype)
    if plan.kernel != MIXED:
        raise ValueError(f"DecodePlan.kernel={plan.kernel!r}: {cache.fmt.name} runs on the {MIXED!r} kernel; make "
                         "the plan with runtime.kernels.decode_plan")
    if plan.block_n < 16 or plan.block_n & (plan.block_n - 1):
        raise ValueError(f"DecodePlan.block_n={plan.block_n}: use a power of two >= 16 (a tensor-core tile)")
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    splits = split_plan(out, max_tokens, plan.splits, plan.block_n, cache, plan.split_tokens)
    tokens_per_split, num_splits, (pm, pl, pacc) = splits
    seq_lens = seq_lens.contiguous()
    group = num_heads // kv_heads
    kc, vc = cache.k, cache.v  # fp8 pages as fp8: the kernel widens them exactly
    cuda = q.device.type == "cuda"
    _decode_mixed_kernel[(batch, kv_heads, num_splits)](
        q, kc, vc, *_meta(cache), block_tables, seq_lens, out, pm, pl, pacc,
        sm_scale * _LOG2E, tokens_per_split, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *kc.stride()[:3], *vc.stride()[:3], kv_heads * bs, bs,
        NUM_HEADS=num_heads, BLOCK_SIZE=bs, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SK=max(16, triton.next_power_of_2(kc.shape[-1])),
        BLOCK_SV=max(16, triton.next_power_of_2(vc.shape[-1])), BLOCK_N=plan.block_n,
        SPLIT=splits_write_partials(splits, bool(plan.split_tokens)), DOT=dot_mode(q.dtype, device_of(q.device)), **_side(kf_k, "K"), **_side(kf_v, "V"),
        SCALE_DT=kf_k.scale_dtype, num_warps=plan.num_warps, num_stages=plan.num_stages,
        **({"maxnreg": plan.registers} if plan.registers and cuda else {}),
    )
    merge_partials(splits, out, seq_lens, bool(plan.split_tokens))
    return out if out.dtype == q.dtype else out.to(q.dtype)


_DENSE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def context_pages(cache: LayerCache, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  dtype: torch.dtype) -> tuple[LayerCache, torch.Tensor]:
    """The pages chunked prefill reads, as a transient unquantized cache and its block tables, for the prefill-context
    kernel (which reads one stored format per cache). Each chunk's context pages are read back with
    `attention.read_kv` -- the values decode reads, dequantized in fp32 and rounded to `dtype` as the reference op
    rounds them -- in one gather for the whole step, not one per chunk. One host read of context_lens sizes it."""
    bs, width = cache.block_size, block_tables.shape[1]
    pages = [-(-c // bs) for c in context_lens.tolist()]
    flat = [i * width + j for i, n in enumerate(pages) for j in range(n)]
    starts = itertools.accumulate(pages, initial=0)
    width_out = max(max(pages, default=0), 1)  # a row even where no chunk has a context
    table = [[s + j for j in range(n)] + [0] * (width_out - n) for s, n in zip(starts, pages)]
    dev = block_tables.device
    used = block_tables.flatten()[torch.tensor(flat, dtype=torch.long, device=dev)].long()
    slots = (used[:, None] * bs + torch.arange(bs, device=dev)).flatten()
    k, v = reference.read_kv(cache, slots, dtype)  # [pages * bs, kv_heads, head_dim]
    paged = [x.view(len(flat), bs, *x.shape[1:]).transpose(1, 2).contiguous() for x in (k, v)]
    if not flat:  # no chunk has a context: one page the kernel never reads
        paged = [torch.zeros(1, cache.kv_heads, bs, k.shape[-1], dtype=dtype, device=dev) for _ in range(2)]
    tables = torch.tensor(table, dtype=torch.int32, device=dev).view(len(pages), width_out)
    return LayerCache(KVFormat(_DENSE[dtype]), *paged), tables
