"""Split-K over the context: how many splits, and the kernel that merges them.

Decode attention of few sequences over long contexts has too few (sequence,
KV head) programs to fill the GPU, so decode_attention cuts each context into
`num_splits` ranges; each writes a partial (running max m and sum l, and its
unnormalized acc in fp32) and `_merge_kernel` combines them:
out = sum_i w_i acc_i / sum_i w_i l_i, w_i = 2**(m_i - max m).

Where the partials' traffic counts (`partial_dtype`), a split stores its own output o_i = acc_i / l_i
in the output's dtype instead (bf16 / fp16, as vLLM's paged_attention_v2 does: a weighted mean of V
values has the output's range), and the merge weighs it by w_i l_i. At a GQA group of 8 a split's
fp32 partial is 4 KB against 34 KB of int4 KV read over 272 tokens (Llama-3-70B, TP 8, 16 x
32768): its write and the merge's read were a fifth of the launch's traffic, and bf16 partials
took int4 0.031 -> 0.027 ms, fp8 0.043 -> 0.040. Their rounding adds about
one rounding of the output (relative error against fp32 1.7e-3 -> 2.4e-3 with bf16 q).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


# ints that change step to step add no compiled variants while serving (runtime/warmup.py)
@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    PM, PL, PACC, OUT, num_splits, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """PACC: fp32 acc_i, or o_i = acc_i / l_i in a 16-bit dtype (`partial_dtype`)."""
    NORMALIZED: tl.constexpr = PACC.dtype.element_ty != tl.float32
    b = tl.program_id(0)
    h = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < num_splits
    row = (b * NUM_HEADS + h) * num_splits + offs_s
    m = tl.load(PM + row, mask=smask, other=float("-inf"))
    l_part = tl.load(PL + row, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    # splits past the sequence's end did no work (m = -inf): weight 0
    w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_max))
    denom = tl.sum(w * l_part, 0)
    if NORMALIZED:
        w = w * l_part
    offs_d = d0 + tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    o = tl.load(PACC + row[:, None] * HEAD_DIM + offs_d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    out = tl.sum(w[:, None] * o.to(tl.float32), 0) / denom
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=dmask)


# partials in the output's dtype where fp32 ones would be at least this share of the KV bytes a split reads.
# why: Llama-3-70B TP8 splits are at 2.3-12.5% (2.5-14% faster), Llama-3-8B's at most 1.6% (0-1.5% slower: fp32 keeps
# the output's precision); measured: benchmarks/results/kernel_variants.jsonl (rule=partial_dtype)
PARTIAL_ROUNDING_SHARE = 1 / 48
# a merge program's share of the partials: splits x head_dim columns of about this many values (2 for each of its
# 128 threads), in head_dim slices of 32 to 128 (`merge_splits`).
# why: whole rows left the GPU idle for one long sequence, slices of 32 made too many small programs at 128 x 4096;
# measured: benchmarks/results/kernel_variants.jsonl (rule=MERGE_VALUES)
MERGE_VALUES = 256
MERGE_MIN_BLOCK_D = 32
MIN_TOKENS_PER_SPLIT = 512  # shorter splits cost more in partial write-backs and merging than they gain


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: any small number exercises the same code


def wave_cost(pairs: int, splits: int, slots: int) -> float:
    """Decode time in units of one unsplit program, when `slots` programs run at once.

    `pairs * splits` programs of 1/splits the context each run in waves of `slots`; a
    partial last wave costs a whole one (the kernels are latency-bound, so a program takes
    about as long whatever else shares its SM).
    """
    return math.ceil(pairs * splits / slots) / splits


def choose_num_splits(batch: int, kv_heads: int, max_tokens: int, block_n: int, sm_count: int,
                      resident_per_sm: int, min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT, max_splits: int = 64,
                      tolerance: float = 0.10, refine_tolerance: float | None = None) -> int:
    """The fewest splits whose `wave_cost` is within `tolerance` of the best possible.

    Too few programs leave SMs idle (one long sequence); a last wave that is mostly
    empty wastes up to half the time (measured: 9 splits instead of 8 at 16 x 32k cost
    int4 per-token asym 0.555 vs 0.479 ms; 1 split instead of 2 at 93 x 8k cost fp8
    0.653 vs 0.575 ms). More splits cost partial write-backs and a merge, so among
    near-equal counts the smallest wins; splits stay >= min_tokens_per_split long.
    resident_per_sm: programs of this kernel an SM holds at once (registers and shared
    memory of the compiled kernel; the tuned data). refine_tolerance: where `tolerance` already
    splits, the fewest splits within this (smaller) one instead: splitting at all must win
    `tolerance`, one more split per program costs little once there is a merge.
    """
    pairs = batch * kv_heads
    slots = max(1, resident_per_sm * sm_count)
    cap = max(1, min(max_splits, math.ceil(max_tokens / max(min_tokens_per_split, block_n))))
    costs = [wave_cost(pairs, s, slots) for s in range(1, cap + 1)]
    best = min(costs)
    splits = next(s for s, cost in enumerate(costs, start=1) if cost <= best * (1 + tolerance))
    if splits > 1 and refine_tolerance is not None:
        splits = next(s for s, cost in enumerate(costs, start=1) if cost <= best * (1 + refine_tolerance))
    return splits


def split_tokens(max_tokens: int, num_splits: int, tile: int) -> int:
    """Tokens per split: a multiple of `tile`, num_splits of them covering max_tokens."""
    return triton.cdiv(triton.cdiv(max_tokens, num_splits), tile) * tile


def partial_dtype(out: torch.Tensor, kv_heads: int, tokens_per_split: int, kv_bytes_per_token_head: float) -> torch.dtype:
    """The dtype of the splits' partials: the output's (normalized partials) where fp32 ones would cost at least
    PARTIAL_ROUNDING_SHARE of the KV bytes a split reads, else fp32 (unnormalized: no division in the kernel's
    epilogue, which measured 0.7% on Llama-3-8B int4 at 16 x 32768, a one-wave launch)."""
    _, num_heads, head_dim = out.shape
    fp32_bytes = num_heads // kv_heads * head_dim * 4  # a split's partial for one KV head's query heads
    low = fp32_bytes >= PARTIAL_ROUNDING_SHARE * tokens_per_split * kv_bytes_per_token_head
    return out.dtype if low else torch.float32


def fixed_split_count(max_tokens: int, fixed_tokens: int) -> int:
    """Splits of `fixed_tokens` keys a launch over a table of `max_tokens` runs (the batch-invariant mode's)."""
    return max(1, triton.cdiv(max_tokens, fixed_tokens))


def split_plan(out: torch.Tensor, max_tokens: int, num_splits: int, tile: int, cache,
               fixed_tokens: int = 0) -> tuple[int, int, tuple]:
    """(tokens per split, a multiple of `tile`; the split count that leaves none empty; the partial
    buffers (m, l: fp32; acc or o: `partial_dtype`) for a split launch over `cache` (a LayerCache), else `out` three
    times: SPLIT=False compiles their stores away). fixed_tokens (a multiple of `tile`): splits of that many tokens
    however wide the table, and partials even for one split (`merge_in_order`: the batch-invariant mode)."""
    if fixed_tokens:
        tokens_per_split, num_splits = fixed_tokens, fixed_split_count(max_tokens, fixed_tokens)
    else:
        tokens_per_split = split_tokens(max_tokens, num_splits, tile)
        num_splits = max(1, triton.cdiv(max_tokens, tokens_per_split))
        if num_splits == 1:
            return tokens_per_split, 1, (out, out, out)
    batch, num_heads, head_dim = out.shape
    pm = torch.empty(batch * num_heads * num_splits, device=out.device, dtype=torch.float32)
    kv_heads = cache.k.shape[1]
    dtype = partial_dtype(out, kv_heads, tokens_per_split, 2 * cache.fmt.bytes_per_token_head(head_dim))
    pacc = torch.empty(batch * num_heads * num_splits * head_dim, device=out.device, dtype=dtype)
    return tokens_per_split, num_splits, (pm, torch.empty_like(pm), pacc)


def merge_splits(pm: torch.Tensor, pl: torch.Tensor, pacc: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """Combine partials [B*H*S] (m, l) and [B*H*S*D] (acc, or o in a 16-bit dtype) into out [B, H, D]."""
    batch, num_heads, head_dim = out.shape
    block_s = max(2, triton.next_power_of_2(num_splits))
    # head_dim in slices of MERGE_VALUES / block_s columns, 32 to 128: one sequence at Llama-3-70B TP8 has 8
    # (sequence, head) rows of up to 256 splits, which whole left the GPU idle (0.0344 -> 0.0338 ms in slices
    # of 32), while 4096 rows of 2 splits (Llama-3-8B, 128 x 4096) in slices of 32 made 16384 programs of 64
    # values (int4 0.1386 -> 0.1453 ms against whole rows)
    block_d = min(triton.next_power_of_2(head_dim), max(MERGE_MIN_BLOCK_D, MERGE_VALUES // block_s))
    _merge_kernel[(batch, num_heads, triton.cdiv(head_dim, block_d))](
        pm, pl, pacc, out, num_splits, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s, num_warps=4,
    )


# ints that change step to step add no compiled variants while serving (runtime/warmup.py)
@triton.jit(do_not_specialize=["num_splits", "tokens_per_split"])
def _merge_in_order_kernel(
    PM, PL, PACC, OUT, SEQ, num_splits, tokens_per_split, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """`_merge_kernel`'s sums over a row's own splits only (ceil(len / tokens_per_split) of them), added one at a
    time from the first: no reduction tree whose shape follows the launch's split count."""
    NORMALIZED: tl.constexpr = PACC.dtype.element_ty != tl.float32
    b = tl.program_id(0)
    h = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    n = tl.cdiv(tl.load(SEQ + b), tokens_per_split)
    base = (b * NUM_HEADS + h) * num_splits
    m_max = tl.load(PM + base)
    for j in range(1, n):
        m_max = tl.maximum(m_max, tl.load(PM + base + j))
    offs_d = d0 + tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    denom = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in range(n):
        w = tl.math.exp2(tl.load(PM + base + j) - m_max)
        wl = w * tl.load(PL + base + j)
        denom += wl
        o = tl.load(PACC + (base + j) * HEAD_DIM + offs_d, mask=dmask, other=0.0).to(tl.float32)
        acc += (wl if NORMALIZED else w) * o
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, (acc / denom).to(OUT.dtype.element_ty), mask=dmask)


def merge_in_order(pm: torch.Tensor, pl: torch.Tensor, pacc: torch.Tensor, out: torch.Tensor, num_splits: int,
                   seq_lens: torch.Tensor, tokens_per_split: int) -> None:
    """`merge_splits` for fixed-size splits (`split_plan`'s fixed_tokens): each row [B] merges its own
    ceil(seq_lens / tokens_per_split) splits in order, so its output does not depend on the launch's split count
    (the widest table of the batch)."""
    batch, num_heads, head_dim = out.shape
    block_d = min(triton.next_power_of_2(head_dim), 64)
    _merge_in_order_kernel[(batch, num_heads, triton.cdiv(head_dim, block_d))](
        pm, pl, pacc, out, seq_lens, num_splits, tokens_per_split, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=2,
    )


def splits_write_partials(splits: tuple, fixed: bool) -> bool:
    """Whether a launch with `split_plan`'s `splits` writes partials (the kernels' SPLIT): more than one split, or
    fixed-size splits (one split too, so that a row's bits do not depend on how many the launch has)."""
    return splits[1] > 1 or fixed


def merge_partials(splits: tuple, out: torch.Tensor, seq_lens: torch.Tensor, fixed: bool) -> None:
    """Combine a launch's partials into `out` (splits: `split_plan`'s): each row's own splits in order for
    fixed-size splits (`merge_in_order`), else `merge_splits` where the launch split."""
    tokens_per_split, num_splits, (pm, pl, pacc) = splits
    if fixed:
        merge_in_order(pm, pl, pacc, out, num_splits, seq_lens, tokens_per_split)
    elif num_splits > 1:
        merge_splits(pm, pl, pacc, out, num_splits)
