"""Triton KV kernels against kv_format's reference math and an fp64 attention.

On a CPU machine the kernels run under the Triton interpreter (TRITON_INTERPRET=1,
set below before the kernels are imported) at small, odd shapes; on a CUDA
machine the same tests compile the kernels and add real (Llama-sized) shapes.

* write: the bytes, scales and zero points must equal `kv_format.quantize` /
  `dynamic_scales` exactly (same IEEE division, same roundings), slots not in
  the mapping must stay untouched.
* decode: the relative oracle of shared/reference/style.md: the kernel's error
  against an fp64 attention over the *same stored bytes* (dequantized with
  kv_format.dequantize) must be at most 2x the error of plain PyTorch attention
  at the query's precision, plus a small floor; pages come from randperm,
  lengths are not multiples of the page, split-K on and off.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import zlib

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from runtime.kv_cache import allocate_layer  # noqa: E402
from runtime.kv_format import KVFormat, dequantize, dynamic_scales, quantize  # noqa: E402


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
from runtime.kernels import decode_gluon  # noqa: E402
from runtime.kernels.decode_attention import decode_attention_launch  # noqa: E402
from runtime.kernels.split_k import choose_num_splits  # noqa: E402
from tests.helpers_gluon_compile import GLUON_VARIANTS, kernel_format_of  # noqa: E402

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


def _static_scales(fmt: KVFormat, amax: torch.Tensor) -> torch.Tensor:
    """Calibrated-style scales from amax; per_tensor takes the max over heads."""
    if fmt.granularity == "per_tensor":
        amax = amax.max()
    return (amax / fmt.qmax).to(torch.float32)


def _make_cache(fmt, num_blocks, block_size, kv_heads, head_dim, k_amax=None, v_amax=None):
    ks = vs = None
    if fmt.static:
        ks, vs = _static_scales(fmt, k_amax), _static_scales(fmt, v_amax)
    cache = allocate_layer(fmt, num_blocks, block_size, kv_heads, head_dim, DEV, ks, vs)
    # poison: untouched slots must keep these bytes, and pages are never zeros
    for t in (cache.k, cache.v):
        t.view(torch.uint8).fill_(0x3C)
    return cache


def _kv(tokens, kv_heads, head_dim, dtype, gen):
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen) * 2.0
    k[:, :, 1] += 4.0  # an outlier channel, as real keys have
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    return k.to(dtype).to(DEV), v.to(dtype).to(DEV)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


# ------------------------------------------------------------------- write
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_write_kv_bytes_equal_reference(fmt):
    gen = torch.Generator().manual_seed(1)
    kv_heads, head_dim, bs, nb, tokens = 3, 16, 5, 9, 23
    k, v = _kv(tokens, kv_heads, head_dim, torch.bfloat16, gen)
    k[3] = 0.0  # an all-zero token: the scale floor (tiny) must match too
    k[5, 1, 2] = 3.0e7  # a token beyond the fp16 scale range: the scale saturates at its max
    k[4, 0, :2] = -0.0  # fp8 stores -0 as 0x80 (the GPU's fma-corrected quotient once gave +0)
    # static scales from half the amax, so the write path must clamp out-of-range values
    cache = _make_cache(fmt, nb, bs, kv_heads, head_dim,
                        k.float().abs().amax((0, 2)).cpu() / 2, v.float().abs().amax((0, 2)).cpu() / 2)
    slots = torch.randperm(nb * bs, generator=gen)[:tokens].to(DEV)
    _check_write(cache, fmt, k, v, slots)


def _check_write(cache, fmt, k, v, slots, **launch):
    """Write k, v at slots (with write_kv_launch's options `launch`, if any); the stored bytes,
    scales and zero points must equal kv_format's, the rest untouched."""
    nb, kv_heads, bs = cache.k.shape[:3]
    before_k = _bytes(cache.k).clone()
    if launch:
        K.write_kv_launch(cache, k, v, slots, **launch)
    else:
        K.write_kv(cache, k, v, slots)

    blk, off = (slots // bs).cpu(), (slots % bs).cpu()
    for name, x in (("k", k), ("v", v)):
        stored = getattr(cache, name).cpu()[blk, :, off]
        if fmt.dynamic:
            s_ref, z_ref = dynamic_scales(x.cpu(), fmt)
            s_got = getattr(cache, f"{name}_scale").cpu()[blk, :, off]
            assert torch.equal(s_got, s_ref), f"{name} scales differ: {(s_got != s_ref).sum()} of {s_ref.numel()}"
            if z_ref is not None:
                z_got = getattr(cache, f"{name}_zero").cpu()[blk, :, off]
                assert torch.equal(z_got, z_ref), f"{name} zero points differ"
            q_ref = quantize(x.cpu(), fmt, s_ref, z_ref)
        elif fmt.static:
            q_ref = quantize(x.cpu(), fmt, getattr(cache, f"{name}_scale").cpu())
        else:
            q_ref = quantize(x.cpu(), fmt)
        diff = _bytes(stored) != _bytes(q_ref)
        if diff.any():
            i = diff.nonzero()[0].tolist()
            pytest.fail(f"{fmt.name} {name}: {int(diff.sum())} elements differ, first at {i}: "
                        f"kernel {_bytes(stored)[tuple(i)]} reference {_bytes(q_ref)[tuple(i)]} (x={x.cpu()[tuple(i)]})")
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots.cpu()] = False
    after_k = _bytes(cache.k).cpu().permute(0, 2, 1, 3).reshape(nb * bs, kv_heads, -1)
    ref_k = before_k.cpu().permute(0, 2, 1, 3).reshape(nb * bs, kv_heads, -1)
    assert torch.equal(after_k[untouched], ref_k[untouched]), "write touched slots outside the mapping"


def _tie_rows(fmt: KVFormat, tokens: int, scales: list[float], head_dim: int, gen) -> torch.Tensor:
    """fp32 rows whose quotients x / s sit exactly on rounding ties (k + 1/2 for integers,
    midpoints between fp8 neighbours) or one fp32 ulp either side of them.

    Head h's rows have scale s = scales[h] (an odd number times a power of two, so that 1 / s
    is not exact and neither is a division through it): values s * j / 8 for integers j,
    exact in fp32; for dynamic formats each row's extremes are set so that kv_format's scale
    is s again (symmetric: amax = qmax * s; asymmetric: min = -3 s, max = (qmax - 3) s)."""
    qmax, heads = fmt.qmax, len(scales)
    lo, a = (0, 3) if fmt.dynamic and not fmt.symmetric else (-qmax, 0)
    j = torch.randint(int(8 * (lo - a - 1)), int(8 * (qmax - a + 1)) + 1, (tokens, heads, head_dim), generator=gen)
    q = j.double() / 8
    if fmt.dynamic:  # pin each row's extremes so the row's scale is s exactly
        q = q.clamp(lo - a, qmax - a)
        q[..., 0] = qmax - a
        q[..., 1] = lo - a
    x = (q * torch.tensor(scales, dtype=torch.float64)[None, :, None]).float()
    nudge = torch.randint(-1, 2, x.shape, generator=gen)  # -1, 0, +1 ulp: just below, on, just above
    nudge[..., :2] = 0
    x = torch.where(nudge > 0, torch.nextafter(x, torch.tensor(float("inf"))), x)
    x = torch.where(nudge < 0, torch.nextafter(x, torch.tensor(float("-inf"))), x)
    return x


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.quantized], ids=[i for f, i in zip(FORMATS, FMT_IDS) if f.quantized])
def test_write_kv_exact_at_rounding_ties(fmt):
    """Bytes equal kv_format's where the rounding is decided by the last bit of the quotient.

    The GPU kernel divides through the scale's reciprocal with fma corrections instead of
    a division; a quotient off by one ulp rounds the other way on the ties here. The
    second head's K scale is 3 * 2**-126 (where the scale dtype has it: fp32 static, bf16 /
    fp32 per-token; fp16 clamps it to 2**-14), so its values are partly subnormal and the
    corrections would underflow without the kernel's power-of-two rescaling; the last
    tokens hold inf, -inf, NaN, a subnormal and a value that overflows the quotient."""
    _check_write_at_ties(fmt, 7, 32, [5 * 2.0 ** 2, 7 * 2.0 ** -6])


def _check_write_at_ties(fmt, seed, head_dim, v_scales, **launch):
    """Rows on rounding ties (`_tie_rows`) for 2 heads, K scales 3 * 2**-4 and 3 * 2**-126, the given
    V scales, special values in the last tokens; the write's bytes against kv_format's."""
    gen = torch.Generator().manual_seed(seed)
    bs, nb, tokens = 16, 8, 120
    k_scales = [3 * 2.0 ** -4, 3 * 2.0 ** -126]
    k = _tie_rows(fmt, tokens, k_scales, head_dim, gen)
    v = _tie_rows(fmt, tokens, v_scales, head_dim, gen)
    for x in (k, v):
        x[-1, 0, 2:7] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-40, 3e38])
        x[-2, 1, 5] = 3e38
    amax = lambda sc: torch.tensor(sc, dtype=torch.float64) * fmt.qmax  # noqa: E731  (amax / qmax = the scale)
    cache = _make_cache(fmt, nb, bs, 2, head_dim, amax(k_scales).float(), amax(v_scales).float())
    if fmt.granularity == "per_tensor":  # one scale for both heads: the second head's rows are off-grid
        cache.k_scale.fill_(k_scales[0])
        cache.v_scale.fill_(v_scales[0])
    slots = torch.randperm(nb * bs, generator=gen)[:tokens].to(DEV)
    _check_write(cache, fmt, k.to(DEV), v.to(DEV), slots, **launch)


def _special_values(k, v):
    """k, v with an all-zero token, a token past the fp16 scale range, inf / -inf / NaN / subnormal /
    huge / -0 values in one token and -inf in another."""
    k[3] = 0.0
    k[5, 1, 2] = 3.0e7
    k[6, 0, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-40, 3e38, -0.0])
    v[7, 1, 3] = float("-inf")
    return k, v


INT4_FORMATS = [f for f in FORMATS if f.dtype == "int4"]
INT4_IDS = [i for f, i in zip(FORMATS, FMT_IDS) if f.dtype == "int4"]


@pytest.mark.parametrize("lanes", [0, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fmt", INT4_FORMATS, ids=INT4_IDS)
def test_write_kv_int4_lanes_bytes_equal_reference(fmt, dtype, lanes):
    """write_kv_launch(int4_lanes=N): whole int4 rows over N lanes (0: the [tokens, head_dim] tile the
    other formats use, which int4 took before; 4 and 8 are the defaults), the clamp in front of the
    division, bf16 rows widened from 32-bit words, 32-bit word stores -- kv_format's bytes still.
    On the GPU this is the fast path (fma-corrected quotient, cvt.rni / cvt.rni.u32); the
    interpreter checks the layout, the packing and the clamp bound with div_rn. Special values:
    an all-zero token, a token past the fp16 scale range, inf / -inf / NaN / subnormal / huge
    values, (GPU) a token with NaN in every odd column, and per-head static scales at both ends of `_reciprocal2`'s
    rescaling (3 * 2**-126 and 5 * 2**70)."""
    gen = torch.Generator().manual_seed(5)
    kv_heads, head_dim, bs, nb, tokens = 2, 64, 16, 6, 37
    k, v = _special_values(*_kv(tokens, kv_heads, head_dim, torch.float32, gen))
    if CUDA:  # NaNs in a token without inf: the interpreter's max propagates NaN into the scale (any kernel)
        v[8, 0, 1::2] = float("nan")
    k, v = k.to(dtype), v.to(dtype)
    amax = lambda x: x.float().abs().nan_to_num(0.0, 0.0, 0.0).amax((0, 2)).cpu() / 2  # noqa: E731
    cache = _make_cache(fmt, nb, bs, kv_heads, head_dim, amax(k), amax(v))
    if fmt.granularity == "per_head":
        cache.k_scale[1] = 3 * 2.0 ** -126
        cache.v_scale[0] = 5 * 2.0 ** 70
    slots = torch.randperm(nb * bs, generator=gen)[:tokens].to(DEV)
    _check_write(cache, fmt, k, v, slots, int4_lanes=lanes)


@pytest.mark.parametrize("lanes", [0, 2, 4, 8])
@pytest.mark.parametrize("fmt", INT4_FORMATS, ids=INT4_IDS)
def test_write_kv_int4_lanes_exact_at_rounding_ties(fmt, lanes):
    """`test_write_kv_exact_at_rounding_ties` for the int4_lanes kernels, at head_dim 64, and with a
    V scale of 5 * 2**70 (its clamp bound needs `_reciprocal2`'s scale-down where the scale dtype has it)."""
    _check_write_at_ties(fmt, 8, 64, [5 * 2.0 ** 70, 7 * 2.0 ** -6], int4_lanes=lanes)


PACKED_ROW_FORMATS = [(f, i) for f, i in zip(FORMATS, FMT_IDS)
                      if f.dtype in ("int4", "int8", "fp8_e4m3") and f.dynamic and f.scale_dtype == "float16"]


@pytest.mark.skipif(not CUDA, reason="bf16x2 inline PTX (int4_packed, byte_rows) compiles for the GPU only")
@pytest.mark.parametrize("lanes", [2, 4, 8])
@pytest.mark.parametrize("fmt", [f for f, _ in PACKED_ROW_FORMATS], ids=[i for _, i in PACKED_ROW_FORMATS])
def test_write_kv_packed_rows_bytes_equal_reference(fmt, lanes):
    """int4_packed / byte_rows (rows over `lanes` lanes, bf16x2 row min / max and symmetric clamp on the
    loaded words; int8 and fp8 stored as bytes): kv_format's bytes, on random rows with special values (NaN in
    a token without inf, NaN pairs, inf, huge, zeros) and on rows whose quotients sit on rounding ties;
    and the same bytes as on the tile path."""
    gen = torch.Generator().manual_seed(9)
    kv_heads, head_dim, bs, nb, tokens = 2, 128, 16, 8, 100
    k, v = _special_values(*_kv(tokens, kv_heads, head_dim, torch.float32, gen))
    v[8, 0, 1::2] = float("nan")
    v[9, 1, 10:20] = float("nan")
    v[10, 0, 1:] = float("nan")
    k[11:] = _tie_rows(fmt, tokens - 11, [3 * 2.0 ** -4, 5 * 2.0 ** 2], head_dim, gen)
    k, v = k.to(torch.bfloat16).to(DEV), v.to(torch.bfloat16).to(DEV)
    slots = torch.randperm(nb * bs, generator=gen)[:tokens].to(DEV)
    cache = _make_cache(fmt, nb, bs, kv_heads, head_dim)
    rows = dict(int4_lanes=lanes, int4_packed=True) if fmt.dtype == "int4" else dict(byte_rows=lanes)
    _check_write(cache, fmt, k, v, slots, **rows)
    ref = _make_cache(fmt, nb, bs, kv_heads, head_dim)
    K.write_kv_launch(ref, k, v, slots, int4_lanes=0, int4_packed=False, byte_rows=0)
    for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero"):
        if getattr(ref, name) is not None:
            assert torch.equal(_bytes(getattr(cache, name)), _bytes(getattr(ref, name))), name


def test_write_kv_skips_negative_slots():
    fmt = KVFormat("int8", "per_token")
    cache = _make_cache(fmt, 4, 16, 2, 32)
    k, v = _kv(3, 2, 32, torch.float16, torch.Generator().manual_seed(2))
    before = cache.k.clone()
    K.write_kv(cache, k, v, torch.tensor([5, -1, 40], device=DEV))
    changed = (cache.k != before).any(-1).any(1).flatten().nonzero().flatten().tolist()  # touched slots
    assert changed == [5, 40]


def test_write_kv_rejects_bad_input():
    cache = _make_cache(KVFormat("int8", "per_token"), 4, 16, 2, 32)
    k, v = _kv(3, 2, 32, torch.float16, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        K.write_kv(cache, k, v, torch.arange(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match=r"k and v must both be \[tokens, 2, 32\]"):
        K.write_kv(cache, k[:, :1], v[:, :1], torch.arange(3, device=DEV))
    with pytest.raises(ValueError, match="byte_rows must be 0, 2, 4 or 8"):
        K.write_kv_launch(cache, k, v, torch.arange(3, device=DEV), byte_rows=3)


# ------------------------------------------------------------------ decode
def _gather(cache, name, blocks, offs, dtype):
    """Dequantize one sequence's tokens [L, kv_heads, head_dim] with kv_format."""
    x = getattr(cache, name)[blocks, :, offs]
    fmt = cache.fmt
    if fmt.dynamic:
        s = getattr(cache, f"{name}_scale")[blocks, :, offs]
        z = getattr(cache, f"{name}_zero")
        return dequantize(x, fmt, s, None if z is None else z[blocks, :, offs], dtype)
    return dequantize(x, fmt, getattr(cache, f"{name}_scale"), dtype=dtype)


def _attention_ref(q, cache, block_tables, seq_lens, sm_scale, dtype):
    """Gather pages, dequantize, attend. fp64 = the truth; q's dtype = plain PyTorch at that precision."""
    batch, heads, _ = q.shape
    group = heads // cache.kv_heads
    out = torch.empty(q.shape, dtype=dtype)
    for b in range(batch):
        t = torch.arange(int(seq_lens[b]))
        blocks = block_tables[b, t // cache.block_size].long()
        offs = t % cache.block_size
        k = _gather(cache, "k", blocks, offs, dtype).repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
        v = _gather(cache, "v", blocks, offs, dtype).repeat_interleave(group, 1).transpose(0, 1)
        scores = (q[b].to(dtype)[:, None, :] @ k.transpose(1, 2))[:, 0] * sm_scale  # [H, L]
        p = torch.softmax(scores.to(torch.float64 if dtype == torch.float64 else torch.float32), -1).to(dtype)
        out[b] = (p[:, None, :] @ v)[:, 0]
    return out


def _oracle(q, cache, block_tables, seq_lens, sm_scale, dtype):
    """(fp64 attention over the cache's stored bytes, relative error of PyTorch attention in `dtype`)."""
    from dataclasses import replace

    cpu = lambda t: t.cpu() if t is not None else None  # noqa: E731
    host = replace(cache, k=cache.k.cpu(), v=cache.v.cpu(), k_scale=cpu(cache.k_scale), v_scale=cpu(cache.v_scale),
                   k_zero=cpu(cache.k_zero), v_zero=cpu(cache.v_zero))
    args = (q.cpu(), host, block_tables.cpu(), seq_lens.cpu(), sm_scale)
    truth = _attention_ref(*args, torch.float64)
    return truth, _relerr(_attention_ref(*args, dtype), truth)


def _relerr(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def _assert_meets_oracle(out, q, cache, block_tables, seq_lens, dtype, nan_msg="kernel output has NaN/Inf"):
    """The relative oracle: finite, and within twice PyTorch's own error in `dtype` of the fp64 attention (sm_scale
    0.25, as every caller launches)."""
    truth, torch_err = _oracle(q, cache, block_tables, seq_lens, 0.25, dtype)
    assert torch.isfinite(out).all(), nan_msg
    assert _relerr(out.cpu(), truth) <= 2 * torch_err + 1e-5


def _fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen):
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
    k, v = _kv(len(slots), kv_heads, head_dim, torch.bfloat16, gen)
    cache = _make_cache(fmt, num_blocks, bs, kv_heads, head_dim,
                        k.float().abs().amax((0, 2)).cpu(), v.float().abs().amax((0, 2)).cpu())
    K.write_kv(cache, k, v, slots.to(DEV))
    return cache, block_tables.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("kernel", ["default"] + (["triton"] if CUDA else []))
@pytest.mark.parametrize("split", [False, True], ids=["one-split", "split-k"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_decode_attention_relative_oracle(fmt, shape, split, kernel):
    """The default launch, and on the GPU also the Triton kernels where the default is the Gluon one."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{shape}{fmt.name}".encode()))
    cache, block_tables, lens = _fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    qdtype = torch.float16 if fmt.dtype == "fp16" or shape == "mha1-page16" else torch.bfloat16
    q = torch.randn(batch, heads, head_dim, generator=gen).to(qdtype).to(DEV)
    sm_scale = 1.0 / math.sqrt(head_dim)
    num_splits = 3 if split else 1
    # one split: the shipped default tiles and kernel; split-K: 16-token tiles (so the short CPU
    # sequences really split; the per-warp kernel then runs one warp) and, in the other kernel,
    # the V tile loaded as [head_dim, tokens]
    tiles = dict(block_n=16, v_transposed=True) if split else {}
    out = decode_attention_launch(q, cache, block_tables, lens, sm_scale, num_splits=num_splits,
                                  gluon=False if kernel == "triton" else None, **tiles)
    assert out.dtype == q.dtype and out.shape == q.shape

    truth, torch_err = _oracle(q, cache, block_tables, lens, sm_scale, qdtype)
    kernel_err = _relerr(out.cpu(), truth)
    worst = (out.cpu().double() - truth).abs().flatten().argmax().item()
    assert torch.isfinite(out).all(), "kernel output has NaN/Inf"
    assert kernel_err <= 2 * torch_err + 1e-5, (
        f"kernel error {kernel_err:.3e} > 2 x PyTorch {qdtype} error {torch_err:.3e}; worst element {worst}: "
        f"kernel {out.cpu().flatten()[worst].item():.6f} vs fp64 {truth.flatten()[worst].item():.6f}"
    )


@pytest.mark.parametrize("swap", [False, True], ids=["tokens-as-N", "tokens-as-M"])
@pytest.mark.parametrize("p_scale", [False, True], ids=["v-scaled", "p-scaled"])
@pytest.mark.parametrize("v_t", [False, True], ids=["v-rows", "v-cols"])
@pytest.mark.parametrize("fmt", [KVFormat("int8", "per_token", symmetric=False), KVFormat("int4", "per_token"),
                                 KVFormat("int4", "per_token", symmetric=False), KVFormat("fp8_e4m3", "per_tensor")],
                         ids=["int8-tok-asym", "int4-tok", "int4-tok-asym", "fp8-tensor"])
def test_decode_every_kernel_variant(fmt, swap, p_scale, v_t):
    """Each non-default code path of the query-heads x tokens kernel (the defaults pick per format) meets the oracle too."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = SHAPES["gqa3-page5"]
    gen = torch.Generator().manual_seed(11)
    cache, bt, lens = _fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).half().to(DEV)
    out = decode_attention_launch(q, cache, bt, lens, 0.25, num_splits=2, block_n=16, warps=False,
                                  swap=swap, p_scale=p_scale, v_transposed=v_t, dot_fp16=True)
    truth, torch_err = _oracle(q, cache, bt, lens, 0.25, torch.float16)
    assert _relerr(out.cpu(), truth) <= 2 * torch_err + 1e-5


@pytest.mark.parametrize("heads_n", [False, True], ids=["heads-as-M", "heads-as-N"])
@pytest.mark.parametrize("split", [1, 2], ids=["one-split", "split-k"])
@pytest.mark.parametrize("shape", ["gqa3-page5", "gqa2-page16"] + (["llama8b"] if CUDA else []))
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_decode_per_warp_kernel(fmt, shape, split, heads_n):
    """The one-softmax-state-per-warp kernel (decode_warps.py) meets the same oracle, both operand orders.

    CPU: 2 warps of 16 tokens, so the 17- and 29-token sequences end inside a warp's range and
    the 3-token one leaves a warp with no tokens at all (its state must merge with weight 0).
    GPU: also the Llama-3-8B shape, with 4 warps of 16 tokens (one split) and one-warp
    programs of 16 tokens (split-K; the default tile where there are enough programs).
    """
    batch, heads, kv_heads, head_dim, bs, seq_lens = SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"warps{shape}{fmt.name}".encode()))
    cache, bt, lens = _fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    qdtype = torch.float16 if fmt.dtype == "fp16" else torch.bfloat16
    q = torch.randn(batch, heads, head_dim, generator=gen).to(qdtype).to(DEV)
    if shape == "llama8b":
        tiles = dict(num_warps=4, block_n=64) if split == 1 else dict(num_warps=1, block_n=16)
    else:
        tiles = dict(num_warps=2, block_n=32)
    out = decode_attention_launch(q, cache, bt, lens, 0.25, num_splits=split, warps=True, heads_n=heads_n,
                                  gluon=False, **tiles)
    _assert_meets_oracle(out, q, cache, bt, lens, qdtype)


# Shapes for the Gluon kernel (head_dim 128, pages of 16k tokens): GQA groups 1, 4, 5 and 8, page
# sizes 16, 32 and 64, lengths on and around tile edges, and 8000 tokens in one program (one split).
GLUON_SHAPES = {
    "gqa4-page16": (6, 32, 8, 128, 16, [1, 15, 16, 17, 3000, 8000]),
    "gqa8-page32": (3, 16, 2, 128, 32, [500, 33, 4096]),
    "gqa5-page16": (2, 10, 2, 128, 16, [777, 1500]),
    "mha-page64": (2, 4, 4, 128, 64, [100, 2000]),
}
QUANTIZED = [f for f in FORMATS if f.quantized]


@pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only (the interpreter cannot run them)")
@pytest.mark.parametrize("split", [1, 4], ids=["one-split", "split-k"])
@pytest.mark.parametrize("shape", list(GLUON_SHAPES))
@pytest.mark.parametrize("fmt", QUANTIZED, ids=[i for f, i in zip(FORMATS, FMT_IDS) if f.quantized])
def test_decode_gluon_kernel(fmt, shape, split):
    """decode_gluon.py meets the fp64 oracle like the Triton kernels (bf16 q; fp16 q at group 5)."""
    from runtime.kernels import decode_gluon
    from runtime.kernels.formats import kernel_format

    batch, heads, kv_heads, head_dim, bs, seq_lens = GLUON_SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"gluon{shape}{fmt.name}".encode()))
    cache, bt, lens = _fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    qdtype = torch.float16 if shape == "gqa5-page16" else torch.bfloat16
    q = torch.randn(batch, heads, head_dim, generator=gen).to(qdtype).to(DEV)
    assert decode_gluon.supported(kernel_format(cache), q, bs, heads // kv_heads)
    out = decode_attention_launch(q, cache, bt, lens, 0.25, num_splits=split, gluon=True)
    _assert_meets_oracle(out, q, cache, bt, lens, qdtype)


RING_FORMATS = [f for f in QUANTIZED if f.dtype == "int4"]


@pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only (the interpreter cannot run them)")
@pytest.mark.parametrize("stages,pairs", [(2, False), (3, False), (4, True), (5, True)])
@pytest.mark.parametrize("shape", list(GLUON_SHAPES))
@pytest.mark.parametrize("fmt", RING_FORMATS, ids=lambda f: f.name)
def test_decode_gluon_ring(fmt, shape, stages, pairs):
    """The int4 shared-memory ring (filled a stage ahead, per-token scales and zero points with the words, by the
    TMA unit on sm_90, by cp.async before; `tuning.gluon_stages_for`), a tile or two tiles a step
    (`gluon_attend._attend_pair`), meets the same oracle. The default launch takes it only for splits of >= 1024 tokens, so the shapes here force it,
    with split-K (tiles past a split's end, an odd number of tiles in a split, pages out of order, lengths
    not a multiple of 16)."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = GLUON_SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"ring{shape}{fmt.name}".encode()))
    cache, bt, lens = _fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16).to(DEV)
    out = decode_attention_launch(q, cache, bt, lens, 0.25, num_splits=4, gluon=True, gluon_stages=stages,
                                  gluon_pairs=pairs)
    _assert_meets_oracle(out, q, cache, bt, lens, torch.bfloat16)


@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability()[0] >= 9),
                    reason="the TMA unit is sm_90's (Gluon kernels run on the GPU only)")
@pytest.mark.parametrize("stages,pairs", [(2, False), (4, True), (5, True)])
@pytest.mark.parametrize("shape", ["gqa4-page16", "gqa8-page32", "mha-page64"])
@pytest.mark.parametrize("fmt", RING_FORMATS, ids=lambda f: f.name)
def test_decode_gluon_ring_filled_by_tma_matches_cp_async(fmt, shape, stages, pairs):
    """The ring filled by the TMA unit (`gluon_tma` 1: K and V words; 2: and the per-token scales and zero points,
    the sm_90 default) holds the same bytes as cp.async's: outputs equal bit for bit, with split-K, pages out of
    order, lengths not a multiple of 16 and odd stage counts (a stage's mbarrier phase is its tile index //
    STAGES)."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = GLUON_SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"tma{shape}{fmt.name}".encode()))
    cache, bt, lens = _fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16).to(DEV)
    outs = [decode_attention_launch(q, cache, bt, lens, 0.25, num_splits=4, gluon=True, gluon_stages=stages,
                                    gluon_pairs=pairs, gluon_tma=tma) for tma in (0, 1, 2)]
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


@pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only (the interpreter cannot run them)")
@pytest.mark.parametrize("fmt", RING_FORMATS, ids=lambda f: f.name)
def test_decode_default_launch_of_few_programs_takes_the_pair_ring(fmt):
    """Few (sequence, KV head) pairs: the default launch plans int4's ring of tiles two a step over short splits
    (`tuning.gluon_plan`: 6 pairs, splits of 256 tokens) and meets the oracle."""
    from runtime.kernels.formats import kernel_format
    from runtime.kernels.split_k import sm_count
    from runtime.kernels.tuning import gluon_plan

    batch, heads, kv_heads, head_dim, bs, seq_lens = GLUON_SHAPES["gqa8-page32"]
    gen = torch.Generator().manual_seed(zlib.crc32(f"few{fmt.name}".encode()))
    cache, bt, lens = _fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16).to(DEV)
    _, splits, stages, pairs = gluon_plan(kernel_format(cache), batch, kv_heads, bt.shape[1] * bs, sm_count(q.device),
                                          group=heads // kv_heads)
    assert (stages, pairs) == (4, True) and splits > 1
    out = decode_attention_launch(q, cache, bt, lens, 0.25)
    _assert_meets_oracle(out, q, cache, bt, lens, torch.bfloat16)


@pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only (the interpreter cannot run them)")
@pytest.mark.parametrize("chains", [1, 2, 4])
@pytest.mark.parametrize("shape", ["gqa4-page16", "gqa5-page16"])
@pytest.mark.parametrize("fmt", [KVFormat("fp8_e4m3", "per_tensor"), KVFormat("int8", "per_token"),
                                 KVFormat("int4", "per_token", symmetric=False)], ids=["fp8", "int8-tok", "int4-tok-asym"])
def test_decode_gluon_k_chains(fmt, shape, chains):
    """The scores as 1, 2 or 4 independent chains of mma over blocks of k (`gluon_operands._k_operands`; the default
    launch takes 2 for int8 per-token) meet the same oracle: a block of K paired with the wrong block of q fails it
    (bf16 q; fp16 q at group 5)."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = GLUON_SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"chains{shape}{fmt.name}".encode()))
    cache, bt, lens = _fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    qdtype = torch.float16 if shape == "gqa5-page16" else torch.bfloat16
    q = torch.randn(batch, heads, head_dim, generator=gen).to(qdtype).to(DEV)
    out = decode_attention_launch(q, cache, bt, lens, 0.25, num_splits=4, gluon=True, gluon_k_chains=chains)
    _assert_meets_oracle(out, q, cache, bt, lens, qdtype)


def _stored_values(words: torch.Tensor, kind: int, fp8_dtype, symmetric: bool) -> torch.Tensor:
    """int32 words [n] -> their values [n, 4 or 8] in storage order, as the Gluon kernel widens them
    (int8 / int4 centred: signed n, unsigned n - 128, nibble - 8)."""
    raw = words.view(torch.uint8).reshape(-1, 4)
    if kind == 0:
        return raw.view(fp8_dtype).to(torch.float32)
    if kind == 1:
        return (raw.view(torch.int8) if symmetric else raw.to(torch.int32) - 128).to(torch.float32)
    nib = torch.stack([raw & 0xF, raw >> 4], -1).reshape(-1, 8).to(torch.int32)
    return (nib - 8).to(torch.float32)


@pytest.mark.skipif(not CUDA, reason="inline PTX compiles for the GPU only; the interpreter has no PTX")
@pytest.mark.parametrize("kind,fp8,symmetric", [(0, 1, True), (0, 2, True), (1, 0, True), (1, 0, False),
                                                (2, 0, True), (2, 0, False)],
                         ids=["e4m3", "e5m2", "int8", "uint8", "int4", "uint4"])
def test_gluon_widening_exact_for_every_byte(kind, fp8, symmetric):
    """widen_ptx.pair_asm (V: two tokens' words -> their values interleaved, centred) and word_asm
    (K: one word -> its values; integers as the raw fp16 subnormals n * 2^-24, int4's high nibbles
    16 n * 2^-24, signed int8 flipped to n + 128) are exact for every byte in every position."""
    import triton
    import triton.language as tl

    from runtime.kernels import widen_ptx
    from runtime.kernels.formats import FP8_E4M3

    @triton.jit
    def widen(A, B, Y, ASM: tl.constexpr, PAIR: tl.constexpr, N: tl.constexpr, CONSTRAINTS: tl.constexpr):
        offs = tl.arange(0, 256)
        args = [tl.load(A + offs), tl.load(B + offs)] if PAIR else [tl.load(A + offs)]
        out = tl.inline_asm_elementwise(ASM, CONSTRAINTS, args, dtype=(tl.float16,) * N, is_pure=True, pack=1)
        for i in tl.static_range(N):
            tl.store(Y + offs * N + i, out[i].to(tl.float32))

    per_word = 8 if kind == 2 else 4
    i = torch.arange(256, dtype=torch.int32)
    # word i holds bytes i, i + 85, i + 170, i + 37 (mod 256): every byte value in every position
    a = torch.stack([i, (i + 85) % 256, (i + 170) % 256, (i + 37) % 256], -1).to(torch.uint8).view(torch.int32)[:, 0]
    b = torch.stack([(i + 3) % 256, (i + 101) % 256, (255 - i), (i * 7) % 256], -1).to(torch.uint8).view(torch.int32)[:, 0]
    fp8_dtype = torch.float8_e4m3fn if fp8 == FP8_E4M3 else torch.float8_e5m2
    want_a, want_b = (_stored_values(w, kind, fp8_dtype, symmetric) for w in (a, b))
    want_k = want_a
    if kind:  # uncentred, in units of 2^-24; int4's odd (high-nibble) values x 16
        raw = want_a + (8 if kind == 2 else 128)
        want_k = raw * 2.0 ** -24 * (torch.tensor([1.0, 16.0] * 4) if kind == 2 else 1.0)
    for pair in (False, True):
        n = 2 * per_word if pair else per_word
        asm = (widen_ptx.pair_asm if pair else widen_ptx.word_asm)(kind, fp8, symmetric)
        y = torch.empty(256, n, dtype=torch.float32, device=DEV)
        widen[(1,)](a.to(DEV), b.to(DEV), y, ASM=asm, PAIR=pair, N=n,
                    CONSTRAINTS="=h," * n + ("r,r" if pair else "r"))
        want = torch.stack([want_a, want_b], -1).reshape(256, n) if pair else want_k
        assert torch.equal(y.cpu().nan_to_num(7777.0), want.nan_to_num(7777.0)), \
            f"pair={pair}: first mismatch at {(y.cpu().nan_to_num(7777.0) != want.nan_to_num(7777.0)).nonzero()[0].tolist()}"


@pytest.fixture(scope="module")
def gluon_sm90_builds():
    """Every Gluon kernel variant cross-compiled for the H200 (tests/helpers_gluon_compile.py), in a
    process of its own: under TRITON_INTERPRET=1 (set here on CPU machines) Gluon cannot compile."""
    import json
    import subprocess
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "tests" / "helpers_gluon_compile.py")], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stderr[-3000:]
    return {tuple(r["variant"]): r for r in map(json.loads, run.stdout.splitlines())}


@pytest.mark.parametrize("variant", GLUON_VARIANTS,
                         ids=[f"kind{k}-mode{m}{'-asym' if a else ''}-stages{s}{'-pairs' if p else ''}-group{g}"
                              f"{f'-tma{t}' if t else ''}" for k, m, a, s, p, g, t in GLUON_VARIANTS])
def test_gluon_kernel_compiles_for_sm90(gluon_sm90_builds, variant):
    """Cross-compiled for sm_90 (no GPU needed): every format's layout relabelling compiles to
    register renames (`assert_trivial` in `_k_operands` / `_v_operand`; a wrong permutation fails the
    build), K and V touch shared memory only in the int4 ring (4 stages of tiles two a step, or 2 of one, of 1 KB of
    K, 1 KB of V and the tile's per-token scales and zero points, and where the TMA unit fills it an 8-byte mbarrier a
    stage and its scales on 128-byte boundaries), no variant spills inside its tile loop, and with 128 registers the
    static formats do not spill at all (16 programs per SM is what the split rule assumes); for GQA groups 1, 4 and 8
    (fp8 per-token, whose cap depends on the group, for 1-8)."""
    build = gluon_sm90_builds[variant]
    assert "error" not in build, build.get("error")
    _, mode, asym, stages, _, _, tma = variant
    # per-token fp16 scales (and zero points) a tile: 16 of them, or a 128-byte row where TMA copies them
    metas = (4 if asym else 2) * (128 if tma == 2 else 16 * 2) if mode == 3 else 0
    barrier = 8 if tma else 0
    assert build["shared"] == stages * (2 * 16 * 64 + metas + barrier), \
        "K and V go to registers, int4 tiles through the ring"
    assert build["regs"] <= (build["cap"] or 255)
    assert build["loop_local"] == 0, f"spills in the tile loop: {build}"
    if mode != 3:
        assert build["cap"] == 128 and build["stack"] == 0, f"static format spills: {build}"


def test_decode_default_launch_matches_forced_split():
    """The public signature (heuristic split count) agrees with a forced single split."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = SHAPES["gqa3-page5"]
    gen = torch.Generator().manual_seed(7)
    cache, bt, lens = _fill_cache(KVFormat("int8", "per_token"), batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).half().to(DEV)
    a = K.decode_attention(q, cache, bt, lens, 0.25)
    b = decode_attention_launch(q, cache, bt, lens, 0.25, num_splits=1)
    assert _relerr(a.cpu(), b.cpu().double()) < 2e-3


@pytest.mark.parametrize("share", [0.0, math.inf], ids=["out-dtype-partials", "fp32-partials"])
@pytest.mark.parametrize("fmt", [KVFormat("int8", "per_token"), KVFormat("int4", "per_head")], ids=["int8-tok", "int4"])
def test_split_partials_in_either_dtype(fmt, share, monkeypatch):
    """Split-K partials stored in q's dtype (bf16 here) and in fp32 (`split_k.partial_dtype`, forced through
    its threshold) both meet the oracle, with pages out of order and a sequence shorter than a split."""
    from runtime.kernels import split_k

    monkeypatch.setattr(split_k, "PARTIAL_ROUNDING_SHARE", share)
    batch, heads, kv_heads, head_dim, bs, seq_lens = SHAPES["gqa3-page5"]
    gen = torch.Generator().manual_seed(zlib.crc32(f"partials{fmt.name}".encode()))
    cache, bt, lens = _fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16).to(DEV)
    out = decode_attention_launch(q, cache, bt, lens, 0.25, num_splits=3, block_n=16)
    _assert_meets_oracle(out, q, cache, bt, lens, torch.bfloat16,
                         "kernel output has NaN/Inf (an empty split's partial must weigh 0)")


@pytest.mark.parametrize("splits", [5, 2, 512], ids=["slices-of-32", "whole-rows", "512-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-acc", "bf16-normalized"])
def test_merge_splits_against_fp64(dtype, splits):
    """`split_k.merge_splits` over head_dim 80 and 5 splits (three 32-wide slices, the last one masked), 2
    (one 128-wide program, masked past 80) or 512 (the int4 ring's most, `tuning.RING_MAX_SPLITS`), one split empty (m = -inf, l = 0), against the same merge in fp64:
    fp32 partials hold unnormalized acc, 16-bit ones o = acc / l (`split_k.partial_dtype`)."""
    from runtime.kernels.split_k import merge_splits

    gen = torch.Generator().manual_seed(3)
    batch, heads, dim = 2, 3, 80
    empty = splits - 2
    m = torch.randn(batch, heads, splits, generator=gen, dtype=torch.float64) * 4
    m[:, :, empty] = float("-inf")
    lsum = torch.rand(batch, heads, splits, generator=gen, dtype=torch.float64) * 20 + 1
    lsum[:, :, empty] = 0
    o = torch.randn(batch, heads, splits, dim, generator=gen, dtype=torch.float64)
    o[:, :, empty] = 0
    stored = (o * lsum[..., None]).float() if dtype == torch.float32 else o.to(dtype)
    w = torch.where(m == float("-inf"), 0.0, torch.exp2(m - m.amax(-1, keepdim=True))) * lsum
    # each split's output as stored (acc / l for fp32 partials; the empty split's weight is 0)
    split_out = stored.double() / lsum.clamp(min=1)[..., None] if dtype == torch.float32 else stored.double()
    want = (w[..., None] * split_out).sum(2) / w.sum(-1)[..., None]
    out = torch.empty(batch, heads, dim, dtype=torch.float32, device=DEV)
    merge_splits(m.float().flatten().to(DEV), lsum.float().flatten().to(DEV), stored.flatten().to(DEV), out, splits)
    # fp32 arithmetic on the stored partials: a few fp32 roundings of terms of the output's size
    assert torch.allclose(out.cpu().double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_partial_dtype_policy():
    """Partials in the output's dtype where fp32 ones would be >= 1/48 of a split's KV bytes (worked by hand)."""
    from runtime.kernels.split_k import partial_dtype

    def out(heads):
        return torch.empty(1, heads, 128, dtype=torch.bfloat16)

    # Llama-3-70B TP8 (8 query heads on 1 KV head), int4 per-head: 272-token splits of 128 B a token read
    # 34816 B; an fp32 partial is 8 x 128 x 4 = 4096 B (11.8%)
    assert partial_dtype(out(8), 1, 272, 128.0) == torch.bfloat16
    # fp8 at 528 tokens (70B TP8 32 x 32768): 4096 B against 135168 B (3.0%)
    assert partial_dtype(out(8), 1, 528, 256.0) == torch.bfloat16
    # Llama-3-8B (4 query heads a KV head), int4 per-head at 1024 tokens: 2048 B against 131072 B (1.6%)
    assert partial_dtype(out(32), 8, 1024, 128.0) == torch.float32
    # the boundary: 2048 B is 1/48 of 98304 B = 768 tokens of 128 B
    assert partial_dtype(out(32), 8, 768, 128.0) == torch.bfloat16
    assert partial_dtype(out(32), 8, 769, 128.0) == torch.float32


def test_decode_rejects_bad_input():
    cache = _make_cache(KVFormat("int8", "per_token"), 4, 16, 2, 32)
    q = torch.randn(1, 3, 32, dtype=torch.float16, device=DEV)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=DEV)
    lens = torch.ones(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="not a multiple"):
        K.decode_attention(q, cache, bt, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        K.decode_attention(q[:, :2], cache, bt.long(), lens, 1.0)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        K.decode_attention(q[:, :2], cache, bt, lens.long(), 1.0)


def test_split_count_policy():
    """Split counts against wave arithmetic worked by hand (132 SMs, 4 resident programs: 528 slots)."""
    # 1 x 131072, 8 pairs: one wave of 8 x 64 = 512 programs is the best 64 splits allow;
    # 59 splits (472 programs, one wave) cost 1/59, within 10% of 1/64 -- the fewest that are
    assert choose_num_splits(1, 8, 131072, 64, 132, 4) == 59
    # 16 x 32768, 128 pairs: 4 splits = 512 programs, one wave (cost 1/4); 5 would need 2 waves
    assert choose_num_splits(16, 8, 32768, 64, 132, 4) == 4
    # 93 x 8192, 744 pairs: 1 split = 2 waves (cost 2), 2 splits = 3 waves of halves (1.5);
    # the floor is 744/528 = 1.41 (16 splits: 1.44), and 1.5 is within 10% of it
    assert choose_num_splits(93, 8, 8192, 64, 132, 4) == 2
    # 128 x 4096, 1024 pairs: 2 waves either way (1.94 of work): no split
    assert choose_num_splits(128, 8, 4096, 64, 132, 4) == 1
    # 3 resident programs (396 slots), 16 x 32768: 3 splits = 384 programs, one wave
    assert choose_num_splits(16, 8, 32768, 128, 132, 3) == 3
    # short context: splits stay >= 512 tokens (600 tokens: at most 2)
    assert choose_num_splits(1, 8, 600, 64, 132, 4) == 2


def test_gluon_programs_per_sm_follow_the_register_cap():
    """The split rule's resident programs for a register cap. A warp's registers come from one of an
    SM's 4 sub-partitions of 16384, 8 per thread at a time (worked by hand: 128 -> 4 x 16384 // 4096
    = 16, 120 -> 4 x (16384 // 3840 = 4) = 16, 112 and 104 -> 16 (the driver's count for 106 and 123
    registers on the H200), 96 -> 4 x 5 = 20, 89 rounds up to 96 -> 20, 80 -> 4 x 6 = 24, 64 -> 32,
    40 -> 4 x 12 = 48 but an SM runs at most 32); uncapped counts 12 (154-168 registers)."""
    from runtime.kernels.tuning import gluon_registers

    int4 = kernel_format_of(2, 2)
    assert [gluon_registers(int4, cap)[1] for cap in (128, 120, 112, 104, 96, 89, 80, 64, 40)] == [
        16, 16, 16, 16, 20, 20, 24, 32, 32]
    assert gluon_registers(int4, 0) == (None, 12)
    # defaults: static formats 128; symmetric int4 per-token 120; int8 per-token and int4 asym uncapped
    assert gluon_registers(kernel_format_of(1, 2)) == (128, 16)
    assert gluon_registers(int4) == (128, 16)
    assert gluon_registers(kernel_format_of(2, 3)) == (120, 16)
    assert gluon_registers(kernel_format_of(2, 3, asym=True)) == (None, 12)
    assert gluon_registers(kernel_format_of(2, 3, asym=True), ring=True) == (128, 16)  # 118 registers built
    assert gluon_registers(kernel_format_of(1, 3)) == (None, 12)
    # fp8 per-token: 128 where it compiles without spills (groups 2-7), else uncapped
    assert [gluon_registers(kernel_format_of(0, 3), group=g) for g in (1, 2, 4, 7, 8)] == [
        (None, 12), (128, 16), (128, 16), (128, 16), (None, 12)]
    assert gluon_registers(kernel_format_of(0, 3), 128, group=8) == (128, 16)  # an explicit cap is kept


def test_gluon_plan_takes_the_ring_for_long_splits_or_few_programs():
    """Splits by the wave rule at 16 programs per SM (132 SMs; splitting at all within 10% of the best,
    then 5%); int4 takes the ring where they are >= 1024 tokens long (2048 with one KV head), where they make
    <= 1024 programs (tiles two a step), or where splits of 1024 still make 1024 programs (more than one KV
    head), the registers otherwise (and asymmetric per-token int4 the registers' uncapped 12 programs per SM)."""
    from runtime.kernels.tuning import gluon_plan

    int4 = kernel_format_of(2, 2)
    # 128 pairs, 2112 slots: 16 splits (2048 programs, 2048 tokens each); 15 would be 10% slower than
    # the best count by the wave model (1920 of 2112), within the old 10% tolerance, not within 5%
    assert gluon_plan(int4, 16, 8, 32768, 132) == (128, 16, 2, False)
    assert gluon_plan(int4, 128, 8, 4096, 132) == (128, 2, 2, False)  # 2048 programs of 2048 tokens
    # one KV head per GPU (70B at TP 8): 64 pairs, 31 splits of ~264 tokens, on the register path
    assert gluon_plan(int4, 64, 1, 8192, 132) == (128, 31, 0, False)
    # per-token int4 the same, through a 4-stage ring at its own cap, tiles two a step; asymmetric at 128 (16
    # per SM) there, but
    # 70B's 31 splits are too short for it: the register plan, uncapped (12 per SM, 1584 slots for 64
    # pairs: 24 splits fill one wave, 22 is the first within 10%, 23 within 5%)
    assert gluon_plan(kernel_format_of(2, 3), 16, 8, 32768, 132) == (120, 16, 4, True)
    assert gluon_plan(kernel_format_of(2, 3, asym=True), 16, 8, 32768, 132) == (128, 16, 4, True)
    assert gluon_plan(kernel_format_of(2, 3, asym=True), 64, 1, 8192, 132) == (None, 23, 0, False)
    # one sequence of 131072 on 8 KV heads: the wave rule's 244 splits of 544 tokens are too short for the ring,
    # 128 splits of 1024 make 1024 programs (ONE_WARP_PROGRAMS): the ring with tiles two a step, per-head too;
    # 4 x 32768 the same (32 pairs x 32 splits). With one KV head (70B TP8) not: 16 and 32 x 32768 (122 and 63
    # splits) keep the registers, and so does 64 x 32768, whose 32 splits of 1024 are short of 2048 there.
    # Few programs take the ring of tiles two a step at the wave rule's count: 8B's 1 x 32768 (8 pairs x 122
    # splits = 976 programs)
    for fmt in (int4, kernel_format_of(2, 3), kernel_format_of(2, 3, asym=True)):
        assert gluon_plan(fmt, 1, 8, 131072, 132)[1:] == (128, 4, True)
        assert gluon_plan(fmt, 4, 8, 32768, 132)[1:] == (32, 4, True)
        assert gluon_plan(fmt, 16, 1, 32768, 132)[2:] == (0, False)
        assert gluon_plan(fmt, 32, 1, 32768, 132)[2:] == (0, False)
        assert gluon_plan(fmt, 64, 1, 32768, 132)[2:] == (0, False)
        assert gluon_plan(fmt, 128, 1, 32768, 132)[1:] == (16, 2 if fmt is int4 else 4, fmt is not int4)
        assert gluon_plan(fmt, 1, 8, 32768, 132)[1:] == (122, 4, True)
        # ... and at least RING_FEW_PROGRAMS where splits of 256 tokens allow: 70B's 1 x 131072 512 (not 244),
        # 2 x 131072 256 a sequence (512 programs, not 488); 1 x 65536 is held to 256 by its length
        assert gluon_plan(fmt, 1, 1, 131072, 132)[1:] == (512, 4, True)
        assert gluon_plan(fmt, 2, 1, 131072, 132)[1:] == (256, 4, True)
        assert gluon_plan(fmt, 1, 1, 65536, 132)[1:] == (256, 4, True)
    assert gluon_plan(int4, 1, 1, 131072, 132, pairs=False) == (128, 512, 2, False)  # asked for one tile a step
    assert gluon_plan(int4, 1, 8, 131072, 132, stages=0) == (128, 244, 0, False)  # asked for the registers
    assert gluon_plan(int4, 1, 8, 131072, 132, num_splits=200) == (128, 200, 0, False)  # splits kept: no ring
    # 8-bit formats never take the ring
    assert gluon_plan(kernel_format_of(1, 2), 16, 8, 32768, 132) == (128, 16, 0, False)
    assert gluon_plan(kernel_format_of(1, 2), 1, 8, 131072, 132)[2:] == (0, False)
    # int8 per-token (uncapped, 12 per SM), 1464 pairs in 1584 slots: one split (92% of the slots) is within
    # 10% of the model's best count, so no split (5% alone would take 14: 13 waves of 1/14 each)
    assert gluon_plan(kernel_format_of(1, 3), 183, 8, 8448, 132) == (None, 1, 0, False)
    # ... while 93 sequences (744 pairs) split: 2 is the first count within 10%, then 5% picks 17
    assert gluon_plan(kernel_format_of(1, 3), 93, 8, 8448, 132) == (None, 17, 0, False)
    # explicit options are kept
    assert gluon_plan(int4, 16, 8, 32768, 132, stages=0, num_splits=7, maxnreg=96) == (96, 7, 0, False)
    assert gluon_plan(int4, 64, 1, 8192, 132, stages=3) == (128, 31, 3, False)
    # per-token int4 takes its tiles two a step in a 4-stage ring; an explicit smaller ring is refused
    assert gluon_plan(kernel_format_of(2, 3), 16, 8, 32768, 132, pairs=False) == (120, 16, 2, False)
    with pytest.raises(ValueError, match="gluon_stages=4"):
        gluon_plan(kernel_format_of(2, 3), 16, 8, 32768, 132, stages=3, pairs=True)
    # the ring is int4's only: an 8-bit format asked for one gets an error that says so, not a compile failure
    with pytest.raises(ValueError, match="int4 formats only"):
        gluon_plan(kernel_format_of(0, 1), 16, 8, 32768, 132, stages=2)
    # where the TMA unit fills the ring (sm_90), per-head int4 takes its tiles two a step as well, in 4 stages, at the
    # same split counts; the per-token plans and the registers' are unchanged
    assert gluon_plan(int4, 16, 8, 32768, 132, tma=2) == (128, 16, 4, True)
    assert gluon_plan(int4, 128, 8, 4096, 132, tma=2) == (128, 2, 4, True)
    assert gluon_plan(int4, 128, 1, 32768, 132, tma=2)[1:] == (16, 4, True)
    assert gluon_plan(int4, 64, 1, 8192, 132, tma=2) == (128, 31, 0, False)
    assert gluon_plan(kernel_format_of(2, 3, asym=True), 16, 8, 32768, 132, tma=2) == (128, 16, 4, True)


def test_tma_for_int4_on_hopper_only():
    """The TMA unit fills int4's ring from sm_90 on (`tuning.gluon_tma_for`: words and scales); Ampere's cp.async
    ring stays for sm_8x, and the 8-bit formats have no ring to fill."""
    from runtime.kernels.tuning import gluon_tma_for

    for mode, asym in ((1, False), (2, False), (3, False), (3, True)):
        assert gluon_tma_for(kernel_format_of(2, mode, asym), 9) == 2
        assert gluon_tma_for(kernel_format_of(2, mode, asym), 8) == 0
        assert gluon_tma_for(kernel_format_of(1, mode, asym), 9) == 0


@pytest.mark.skipif(decode_gluon.gluon is None, reason="this Triton has no Gluon (TMA descriptors are Gluon's)")
def test_ring_descriptors_describe_a_tile_a_copy():
    """`decode_gluon.ring_descriptors`: K / V pages as rows of 16 words, a 16-token tile a box, V 64-byte swizzled;
    per-token scales as rows of 16, a tile's 16 a box; a cache whose rows are not whole and in order gets an error
    that says what to pass instead of a wrong copy."""
    from runtime.kernels.decode_gluon import TMA_SWIZZLE_V, ring_descriptors

    pages = torch.zeros(6, 2, 16, 16, dtype=torch.int32)
    scales = torch.zeros(6, 2, 16, dtype=torch.float16)
    k, v, ks = ring_descriptors(pages, pages.clone(), (scales,))
    assert (k.shape, k.block_shape, v.block_shape, ks.shape, ks.block_shape) == \
        (torch.Size([192, 16]), [16, 16], [16, 16], torch.Size([12, 16]), [1, 16])
    assert (k.layout.swizzle_byte_width, v.layout.swizzle_byte_width) == (0, TMA_SWIZZLE_V)
    assert (ks.layout.element_bitwidth, k.layout.element_bitwidth) == (16, 32)
    with pytest.raises(ValueError, match="gluon_tma=0"):
        ring_descriptors(pages.transpose(1, 2), pages)


def test_wave_cost_counts_partial_waves_whole():
    from runtime.kernels.split_k import wave_cost

    assert wave_cost(128, 4, 528) == 0.25  # 512 programs: one wave of quarter-length programs
    assert wave_cost(128, 5, 528) == 2 / 5  # 640 programs: a second, mostly empty wave
    assert wave_cost(744, 1, 528) == 2.0


# ------------------------------------------------------------ PTX widening
@pytest.mark.skipif(not CUDA, reason="inline PTX compiles for the GPU only; the interpreter has no PTX")
@pytest.mark.parametrize("bits,dtype,symmetric", [(4, torch.bfloat16, True), (4, torch.bfloat16, False),
                                                  (4, torch.float16, True), (4, torch.float16, False),
                                                  (8, torch.float16, True), (8, torch.float16, False)])
def test_widen_asm_exact_for_every_byte(bits, dtype, symmetric):
    """widen_ptx.widen_asm turns each of the 256 stored bytes into exactly its integer value(s)."""
    import triton
    import triton.language as tl

    from runtime.kernels.dequant import _unpack
    from runtime.kernels.widen_ptx import widen_asm

    @triton.jit
    def widen(X, Y, HALF: tl.constexpr, KIND: tl.constexpr, ASYM: tl.constexpr, LO: tl.constexpr,
              HI: tl.constexpr, DT: tl.constexpr):
        offs = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
        y = _unpack(tl.load(X + offs), HALF, KIND, ASYM, LO, HI, DT)
        tl.store(Y + offs, y.to(tl.float32))

    lo, hi = widen_asm(bits, dtype, symmetric)
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if bits == 8 and symmetric:
        raw = raw.view(torch.int8)
    x = raw.to(DEV)
    tl_dt = tl.float16 if dtype == torch.float16 else tl.bfloat16
    halves = [0, 1] if bits == 4 else [0]
    for half in halves:
        y = torch.empty(256, dtype=torch.float32, device=DEV)
        widen[(1,)](x, y, HALF=half, KIND=2 if bits == 4 else 1, ASYM=not symmetric, LO=lo, HI=hi, DT=tl_dt)
        if bits == 8:
            want = raw.to(torch.float32)
        else:
            nib = (raw.to(torch.int32) >> (4 * half)) & 0xF
            want = (nib - (8 if symmetric else 0)).to(torch.float32)
        assert torch.equal(y.cpu(), want), f"half {half}: first mismatch at byte {(y.cpu() != want).nonzero()[0].item()}"
