"""Split-K over the context: how many splits, and the kernel that merges them.

Decode attention of few sequences over long contexts has too few (sequence,
KV head) programs to fill the GPU, so decode_attention cuts each context into
`num_splits` ranges; each writes a partial (running max m, sum l, unnormalized
acc) and `_merge_kernel` combines them: out = sum_i w_i acc_i / sum_i w_i l_i,
w_i = 2**(m_i - max m).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    PM, PL, PACC, OUT, num_splits, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < num_splits
    row = (b * NUM_HEADS + h) * num_splits + offs_s
    m = tl.load(PM + row, mask=smask, other=float("-inf"))
    l_part = tl.load(PL + row, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    # splits past the sequence's end did no work (m = -inf): weight 0
    w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_max))
    denom = tl.sum(w * l_part, 0)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    acc = tl.load(PACC + row[:, None] * HEAD_DIM + offs_d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / denom
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=dmask)


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: any small number exercises the same code


def choose_num_splits(batch: int, kv_heads: int, max_tokens: int, block_n: int, sm_count: int,
                      min_tokens_per_split: int = 512, max_splits: int = 64, programs_per_sm: int = 2) -> int:
    """About `programs_per_sm` (sequence, head, split) programs per SM, but splits of >= min tokens.

    Fewer programs than SMs leaves bandwidth unused; tiny splits spend more on
    the partial write-back and the merge than they save. Kernels that fit 4
    programs on an SM do best with ~2 waves of them (8 per SM).
    """
    pairs = batch * kv_heads
    target = programs_per_sm * sm_count
    if programs_per_sm <= 2:  # within one wave of resident programs: round up, every SM gets work
        want = math.ceil(target / pairs)
    else:  # several waves: round down, a partial extra wave costs more than it adds (measured 9
        # splits vs 8 at 16 x 32k, 4 programs/SM: 0.555 vs 0.479 ms for int4 per-token asym)
        want = target // pairs
    cap = max(1, math.ceil(max_tokens / max(min_tokens_per_split, block_n)))
    return max(1, min(want, cap, max_splits))


def merge_splits(pm: torch.Tensor, pl: torch.Tensor, pacc: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """Combine partials [B*H*S] (m, l) and [B*H*S*D] (acc) into out [B, H, D]."""
    batch, num_heads, head_dim = out.shape
    _merge_kernel[(batch, num_heads)](
        pm, pl, pacc, out, num_splits, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), num_warps=4,
    )
