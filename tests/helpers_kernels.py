"""Shared pieces of the kernel tests (tests/test_kernel_*.py): the formats and shapes they run, caches filled
through the write kernel, the fp64 oracle of shared/reference/style.md, and plans changed with
`dataclasses.replace` (the kernels' only tuning surface).

On a CPU machine the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before the kernels are
imported) at small, odd shapes; on a CUDA machine the same tests compile the kernels and add real shapes.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import replace

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from runtime.kv_cache import allocate_layer  # noqa: E402
from runtime.kv_format import KVFormat  # noqa: E402
from runtime.kv_quant import dequantize  # noqa: E402


def _load_kernels():
    """Import runtime.kernels, which must see TRITON_INTERPRET=1 on a CPU machine.

    @triton.jit decides at decoration (import) time whether it interprets, and
    re-importing the modules does not give working interpreted kernels, so an
    earlier uninterpreted import is an error here (tests/conftest.py should set
    TRITON_INTERPRET=1 when no GPU is present).
    """
    already = sys.modules.get("runtime.kernels.write_kv")
    if not CUDA and already is not None:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(already._write_kv_kernel, InterpretedFunction):
            raise RuntimeError("runtime.kernels was imported before TRITON_INTERPRET=1 was set; "
                               "set it in tests/conftest.py (no GPU) before anything imports the kernels.")
    return importlib.import_module("runtime.kernels")


K = _load_kernels()

DEV = "cuda" if CUDA else "cpu"

# Every dtype x granularity x symmetry the runtime supports.
FORMATS = [
    KVFormat("fp16"),
    KVFormat("bf16"),
    KVFormat("fp8_e4m3", "per_tensor"),
    KVFormat("fp8_e4m3", "per_head"),
    KVFormat("fp8_e4m3", "per_token"),
    KVFormat("fp8_e5m2", "per_tensor"),
    KVFormat("fp8_e5m2", "per_head"),
    KVFormat("fp8_e5m2", "per_token", scale_dtype="bfloat16"),
    KVFormat("int8", "per_tensor"),
    KVFormat("int8", "per_head"),
    KVFormat("int8", "per_token"),
    KVFormat("int8", "per_token", symmetric=False),
    KVFormat("int8", "per_token", symmetric=False, scale_dtype="bfloat16"),
    KVFormat("int4", "per_tensor"),
    KVFormat("int4", "per_head"),
    KVFormat("int4", "per_token", scale_dtype="float32"),
    KVFormat("int4", "per_token", symmetric=False),
]
FMT_IDS = [f"{f.name}-{f.scale_dtype}" if f.dynamic else f.name for f in FORMATS]

# (batch, q heads, kv heads, head_dim, block_size, seq_lens) -- odd on purpose:
# group 3 with 3 KV heads (SmolLM2), page size 5, lengths not multiples of the page.
SHAPES = {
    "gqa3-page5": (3, 9, 3, 16, 5, [17, 3, 29]),
    "mha1-page16": (2, 2, 2, 32, 16, [33, 1]),
    # pages of 16: each of the per-warp kernel's 16-token warps reads its own page (WARP_PAGE)
    "gqa2-page16": (2, 4, 2, 16, 16, [45, 70]),
}
if CUDA:  # real sizes on the GPU machine: Llama-3-8B attention, SmolLM2 heads
    SHAPES["llama8b"] = (8, 32, 8, 128, 16, [4000, 1, 17, 2048, 333, 1024, 4096, 77])
    SHAPES["smollm2"] = (4, 9, 3, 64, 16, [900, 64, 1, 2500])


def static_scales(fmt: KVFormat, amax: torch.Tensor) -> torch.Tensor:
    """Calibrated-style scales from amax; per_tensor takes the max over heads."""
    if fmt.granularity == "per_tensor":
        amax = amax.max()
    return (amax / fmt.qmax).to(torch.float32)


def make_cache(fmt, num_blocks, block_size, kv_heads, head_dim, k_amax=None, v_amax=None):
    ks = vs = None
    if fmt.static:
        ks, vs = static_scales(fmt, k_amax), static_scales(fmt, v_amax)
    cache = allocate_layer(fmt, num_blocks, block_size, kv_heads, head_dim, DEV, ks, vs)
    # poison: untouched slots must keep these bytes, and pages are never zeros
    for t in (cache.k, cache.v):
        t.view(torch.uint8).fill_(0x3C)
    return cache


def kv(tokens, kv_heads, head_dim, dtype, gen):
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen) * 2.0
    k[:, :, 1] += 4.0  # an outlier channel, as real keys have
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    return k.to(dtype).to(DEV), v.to(dtype).to(DEV)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)




def gather(cache, name, blocks, offs, dtype):
    """Dequantize one sequence's tokens [L, kv_heads, head_dim] with kv_format."""
    x = getattr(cache, name)[blocks, :, offs]
    fmt = cache.fmt.side(name)
    if fmt.dynamic:
        s = getattr(cache, f"{name}_scale")[blocks, :, offs]
        z = getattr(cache, f"{name}_zero")
        return dequantize(x, fmt, s, None if z is None else z[blocks, :, offs], dtype)
    return dequantize(x, fmt, getattr(cache, f"{name}_scale"), dtype=dtype)


def attention_ref(q, cache, block_tables, seq_lens, sm_scale, dtype):
    """Gather pages, dequantize, attend. fp64 = the truth; q's dtype = plain PyTorch at that precision."""
    batch, heads, _ = q.shape
    group = heads // cache.kv_heads
    out = torch.empty(q.shape, dtype=dtype)
    for b in range(batch):
        t = torch.arange(int(seq_lens[b]))
        blocks = block_tables[b, t // cache.block_size].long()
        offs = t % cache.block_size
        k = gather(cache, "k", blocks, offs, dtype).repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
        v = gather(cache, "v", blocks, offs, dtype).repeat_interleave(group, 1).transpose(0, 1)
        scores = (q[b].to(dtype)[:, None, :] @ k.transpose(1, 2))[:, 0] * sm_scale  # [H, L]
        p = torch.softmax(scores.to(torch.float64 if dtype == torch.float64 else torch.float32), -1).to(dtype)
        out[b] = (p[:, None, :] @ v)[:, 0]
    return out


def oracle(q, cache, block_tables, seq_lens, sm_scale, dtype):
    """(fp64 attention over the cache's stored bytes, relative error of PyTorch attention in `dtype`)."""
    cpu = lambda t: t.cpu() if t is not None else None  # noqa: E731
    host = replace(cache, k=cache.k.cpu(), v=cache.v.cpu(), k_scale=cpu(cache.k_scale), v_scale=cpu(cache.v_scale),
                   k_zero=cpu(cache.k_zero), v_zero=cpu(cache.v_zero))
    args = (q.cpu(), host, block_tables.cpu(), seq_lens.cpu(), sm_scale)
    truth = attention_ref(*args, torch.float64)
    return truth, relerr(attention_ref(*args, dtype), truth)


def relerr(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def assert_meets_oracle(out, q, cache, block_tables, seq_lens, dtype, nan_msg="kernel output has NaN/Inf"):
    """The relative oracle: finite, and within twice PyTorch's own error in `dtype` of the fp64 attention (sm_scale
    0.25, as every caller launches)."""
    truth, torch_err = oracle(q, cache, block_tables, seq_lens, 0.25, dtype)
    assert torch.isfinite(out).all(), nan_msg
    assert relerr(out.cpu(), truth) <= 2 * torch_err + 1e-5


def fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen):
    blocks_per_seq = [math.ceil(n / bs) for n in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 3  # a few pages nobody owns
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    slots, used = [], 0
    for b, nblk in enumerate(blocks_per_seq):
        block_tables[b, :nblk] = perm[used:used + nblk].to(torch.int32)
        used += nblk
        t = torch.arange(seq_lens[b])
        slots.append(block_tables[b, t // bs].long() * bs + t % bs)
    slots = torch.cat(slots)
    k, v = kv(len(slots), kv_heads, head_dim, torch.bfloat16, gen)
    cache = make_cache(fmt, num_blocks, bs, kv_heads, head_dim,
                        k.float().abs().amax((0, 2)).cpu(), v.float().abs().amax((0, 2)).cpu())
    K.write_kv(cache, k, v, slots.to(DEV))
    return cache, block_tables.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV)



def decode_with(q, cache, block_tables, seq_lens, sm_scale, kernel=None, tile=None, **changes):
    """decode_attention under the default plan (`kernel`: that family's, "gluon" or "triton") with `changes`;
    tile: tokens a Triton tile (the per-warp kernel: 16 a warp)."""
    from runtime.kernels.plan import warp_page_fits
    from runtime.kernels.tuned_file import device_of

    batch, heads, head_dim = q.shape
    plan = K.decode_plan(cache.fmt, batch, heads, cache.kv_heads, block_tables.shape[1] * cache.block_size,
                         device_of(q.device), head_dim=head_dim, block_size=cache.block_size, q_dtype=q.dtype,
                         kernel=kernel)
    if tile is not None:
        warps = max(1, tile // 16) if plan.kernel == "warps" else plan.num_warps
        changes = dict(block_n=tile, num_warps=warps, **changes)
    plan = replace(plan, **changes)
    if plan.kernel == "warps":
        plan = replace(plan, warp_page=warp_page_fits(plan.block_n, plan.num_warps, cache.block_size))
    return K.decode_attention(q, cache, block_tables, seq_lens, sm_scale, plan=plan)


def rows_plan(cache, k, lanes: int, packed: bool | None = None):
    """The write's default plan with rows over `lanes` lanes (0: the tile); packed: the default's where lanes."""
    from runtime.kernels.plan import write_warps

    plan = K.write_plan(cache.fmt, k.shape[0], cache.kv_heads, k.device, head_dim=k.shape[2], k_dtype=k.dtype)
    packed = plan.packed and lanes > 0 if packed is None else packed
    return replace(plan, lanes=lanes, packed=packed, num_warps=write_warps(lanes, plan.block_t))
