"""The write kernel (write_kv.py, write_rows.py): the bytes, scales and zero points it stores equal
`kv_quant.quantize` / `dynamic_scales` exactly (same IEEE division, same roundings) for every format, under its
default plan and with rows over any number of lanes, at rounding ties and special values; slots not in the
mapping stay untouched."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

from runtime.kv_format import KVFormat
from runtime.kv_quant import dynamic_scales, quantize
from tests.helpers_kernels import CUDA, DEV, FMT_IDS, FORMATS, K, as_bytes, kv, make_cache, rows_plan


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_write_kv_bytes_equal_reference(fmt):
    gen = torch.Generator().manual_seed(1)
    kv_heads, head_dim, bs, nb, tokens = 3, 16, 5, 9, 23
    k, v = kv(tokens, kv_heads, head_dim, torch.bfloat16, gen)
    k[3] = 0.0  # an all-zero token: the scale floor (tiny) must match too
    k[5, 1, 2] = 3.0e7  # a token beyond the fp16 scale range: the scale saturates at its max
    k[4, 0, :2] = -0.0  # fp8 stores -0 as 0x80 (the GPU's fma-corrected quotient once gave +0)
    # static scales from half the amax, so the write path must clamp out-of-range values
    cache = make_cache(fmt, nb, bs, kv_heads, head_dim,
                        k.float().abs().amax((0, 2)).cpu() / 2, v.float().abs().amax((0, 2)).cpu() / 2)
    slots = torch.randperm(nb * bs, generator=gen)[:tokens].to(DEV)
    _check_write(cache, fmt, k, v, slots)


def _check_write(cache, fmt, k, v, slots, lanes=None):
    """Write k, v at slots (under the default plan, or with rows over `lanes` lanes: `rows_plan`); the stored
    bytes, scales and zero points must equal kv_format's, the rest untouched."""
    nb, kv_heads, bs = cache.k.shape[:3]
    before_k = as_bytes(cache.k).clone()
    K.write_kv(cache, k, v, slots, plan=None if lanes is None else rows_plan(cache, k, lanes))
    _check_written(cache, fmt, k, v, slots, before_k)


def _check_written(cache, fmt, k, v, slots, before_k=None):
    """The bytes, scales and zero points at `slots` equal kv_format's; with `before_k`, the rest are untouched."""
    nb, kv_heads, bs = cache.k.shape[:3]

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
        diff = as_bytes(stored) != as_bytes(q_ref)
        if diff.any():
            i = diff.nonzero()[0].tolist()
            pytest.fail(f"{fmt.name} {name}: {int(diff.sum())} elements differ, first at {i}: "
                        f"kernel {as_bytes(stored)[tuple(i)]} reference {as_bytes(q_ref)[tuple(i)]} (x={x.cpu()[tuple(i)]})")
    if before_k is None:
        return
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots.cpu()] = False
    after_k = as_bytes(cache.k).cpu().permute(0, 2, 1, 3).reshape(nb * bs, kv_heads, -1)
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


def _check_write_at_ties(fmt, seed, head_dim, v_scales, lanes=None):
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
    cache = make_cache(fmt, nb, bs, 2, head_dim, amax(k_scales).float(), amax(v_scales).float())
    if fmt.granularity == "per_tensor":  # one scale for both heads: the second head's rows are off-grid
        cache.k_scale.fill_(k_scales[0])
        cache.v_scale.fill_(v_scales[0])
    slots = torch.randperm(nb * bs, generator=gen)[:tokens].to(DEV)
    _check_write(cache, fmt, k.to(DEV), v.to(DEV), slots, lanes)


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
    """WritePlan.lanes = N: whole int4 rows over N lanes (0: the [tokens, head_dim] tile the
    other formats use, which int4 took before; 4 and 8 are the defaults), the clamp in front of the
    division, bf16 rows widened from 32-bit words, 32-bit word stores -- kv_format's bytes still.
    On the GPU this is the fast path (fma-corrected quotient, cvt.rni / cvt.rni.u32); the
    interpreter checks the layout, the packing and the clamp bound with div_rn. Special values:
    an all-zero token, a token past the fp16 scale range, inf / -inf / NaN / subnormal / huge
    values, (GPU) a token with NaN in every odd column, and per-head static scales at both ends of `_reciprocal2`'s
    rescaling (3 * 2**-126 and 5 * 2**70)."""
    gen = torch.Generator().manual_seed(5)
    kv_heads, head_dim, bs, nb, tokens = 2, 64, 16, 6, 37
    k, v = _special_values(*kv(tokens, kv_heads, head_dim, torch.float32, gen))
    if CUDA:  # NaNs in a token without inf: the interpreter's max propagates NaN into the scale (any kernel)
        v[8, 0, 1::2] = float("nan")
    k, v = k.to(dtype), v.to(dtype)
    amax = lambda x: x.float().abs().nan_to_num(0.0, 0.0, 0.0).amax((0, 2)).cpu() / 2  # noqa: E731
    cache = make_cache(fmt, nb, bs, kv_heads, head_dim, amax(k), amax(v))
    if fmt.granularity == "per_head":
        cache.k_scale[1] = 3 * 2.0 ** -126
        cache.v_scale[0] = 5 * 2.0 ** 70
    slots = torch.randperm(nb * bs, generator=gen)[:tokens].to(DEV)
    _check_write(cache, fmt, k, v, slots, lanes)


@pytest.mark.parametrize("lanes", [0, 2, 4, 8])
@pytest.mark.parametrize("fmt", INT4_FORMATS, ids=INT4_IDS)
def test_write_kv_int4_lanes_exact_at_rounding_ties(fmt, lanes):
    """`test_write_kv_exact_at_rounding_ties` for int4 rows over lanes, at head_dim 64, and with a
    V scale of 5 * 2**70 (its clamp bound needs `_reciprocal2`'s scale-down where the scale dtype has it)."""
    _check_write_at_ties(fmt, 8, 64, [5 * 2.0 ** 70, 7 * 2.0 ** -6], lanes)


PACKED_ROW_FORMATS = [(f, i) for f, i in zip(FORMATS, FMT_IDS)
                      if f.dtype in ("int4", "int8", "fp8_e4m3") and f.dynamic and f.scale_dtype == "float16"]


@pytest.mark.skipif(not CUDA, reason="bf16x2 inline PTX (packed rows) compiles for the GPU only")
@pytest.mark.parametrize("lanes", [2, 4, 8])
@pytest.mark.parametrize("fmt", [f for f, _ in PACKED_ROW_FORMATS], ids=[i for _, i in PACKED_ROW_FORMATS])
def test_write_kv_packed_rows_bytes_equal_reference(fmt, lanes):
    """Packed rows (WritePlan.packed: rows over `lanes` lanes, bf16x2 row min / max and symmetric clamp on the
    loaded words; int8 and fp8 stored as bytes): kv_format's bytes, on random rows with special values (NaN in
    a token without inf, NaN pairs, inf, huge, zeros) and on rows whose quotients sit on rounding ties;
    and the same bytes as on the tile path."""
    gen = torch.Generator().manual_seed(9)
    kv_heads, head_dim, bs, nb, tokens = 2, 128, 16, 8, 100
    k, v = _special_values(*kv(tokens, kv_heads, head_dim, torch.float32, gen))
    v[8, 0, 1::2] = float("nan")
    v[9, 1, 10:20] = float("nan")
    v[10, 0, 1:] = float("nan")
    k[11:] = _tie_rows(fmt, tokens - 11, [3 * 2.0 ** -4, 5 * 2.0 ** 2], head_dim, gen)
    k, v = k.to(torch.bfloat16).to(DEV), v.to(torch.bfloat16).to(DEV)
    slots = torch.randperm(nb * bs, generator=gen)[:tokens].to(DEV)
    cache = make_cache(fmt, nb, bs, kv_heads, head_dim)
    K.write_kv(cache, k, v, slots, plan=rows_plan(cache, k, lanes, packed=True))
    _check_written(cache, fmt, k, v, slots)
    ref = make_cache(fmt, nb, bs, kv_heads, head_dim)
    K.write_kv(ref, k, v, slots, plan=rows_plan(ref, k, 0, packed=False))
    for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero"):
        if getattr(ref, name) is not None:
            assert torch.equal(as_bytes(getattr(cache, name)), as_bytes(getattr(ref, name))), name


def test_write_kv_skips_negative_slots():
    fmt = KVFormat("int8", "per_token")
    cache = make_cache(fmt, 4, 16, 2, 32)
    k, v = kv(3, 2, 32, torch.float16, torch.Generator().manual_seed(2))
    before = cache.k.clone()
    K.write_kv(cache, k, v, torch.tensor([5, -1, 40], device=DEV))
    changed = (cache.k != before).any(-1).any(1).flatten().nonzero().flatten().tolist()  # touched slots
    assert changed == [5, 40]


def test_write_kv_rejects_bad_input():
    cache = make_cache(KVFormat("int8", "per_token"), 4, 16, 2, 32)
    k, v = kv(3, 2, 32, torch.float16, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        K.write_kv(cache, k, v, torch.arange(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match=r"k and v must both be \[tokens, 2, 32\]"):
        K.write_kv(cache, k[:, :1], v[:, :1], torch.arange(3, device=DEV))
    with pytest.raises(ValueError, match=r"WritePlan.lanes=3"):
        K.write_kv(cache, k, v, torch.arange(3, device=DEV), plan=replace(rows_plan(cache, k, 0), lanes=3))
    with pytest.raises(ValueError, match=r"WritePlan.packed=True"):
        K.write_kv(cache, k, v, torch.arange(3, device=DEV), plan=replace(rows_plan(cache, k, 0), packed=True))



@pytest.mark.parametrize("fmt", [KVFormat("int8", "per_token"), KVFormat("int4", "per_token", symmetric=False),
                                 KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False)],
                         ids=["int8", "int4-asym", "k8v4"])
def test_write_kv_in_pieces_past_the_32_bit_offsets(fmt, monkeypatch):
    """A write whose source spans more elements than the kernels address in 32 bits goes in pieces: with the limit
    lowered to 5 tokens' worth, 23 tokens store what one launch stores (uniform and K/V-split formats), and for a
    uniform format the reference bytes."""
    gen = torch.Generator().manual_seed(4)
    kv_heads, head_dim, bs, nb, tokens = 2, 16, 4, 8, 23
    k, v = kv(tokens, kv_heads, head_dim, torch.bfloat16, gen)
    slots = torch.randperm(nb * bs, generator=gen)[:tokens].to(DEV)
    whole = make_cache(fmt, nb, bs, kv_heads, head_dim)
    K.write_kv(whole, k, v, slots)
    launch = importlib.import_module("runtime.kernels.launch")
    monkeypatch.setattr(launch, "MAX_WRITE_ELEMENTS", 5 * kv_heads * head_dim)
    calls = []
    monkeypatch.setattr(launch, "_write_kv_kernel", _Counting(launch._write_kv_kernel, calls))
    pieces = make_cache(fmt, nb, bs, kv_heads, head_dim)
    K.write_kv(pieces, k, v, slots)
    for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero"):
        if getattr(whole, name) is not None:
            assert torch.equal(as_bytes(getattr(pieces, name)), as_bytes(getattr(whole, name))), name
    if fmt.v_dtype is None:  # a K/V-split format launches write_mixed's kernel
        assert calls == [5, 5, 5, 5, 3]
        _check_written(pieces, fmt, k, v, slots)


class _Counting:
    """A launched kernel's stand-in that records each grid's token count, then launches the kernel."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append(args[9])  # num_tokens
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.skipif(not CUDA, reason="2^31 source elements: a GPU-sized write")
def test_write_kv_past_2_to_31_elements_on_cuda():
    """2.2 G source elements in one call (the size that once hit an illegal address): every token lands, the last
    ones included, with the reference bytes of a sample of rows."""
    fmt = KVFormat("int8", "per_token")
    kv_heads, head_dim, bs = 8, 128, 64
    tokens = 2**31 // (kv_heads * head_dim) + 4096
    nb = -(-tokens // bs)
    k = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    cache = make_cache(fmt, nb, bs, kv_heads, head_dim)
    slots = torch.arange(tokens, device="cuda")
    K.write_kv(cache, k, v, slots)
    torch.cuda.synchronize()
    sample = torch.cat((torch.arange(64), torch.arange(tokens - 64, tokens))).cuda()
    s_ref, _ = dynamic_scales(v[sample].cpu(), fmt)
    got = cache.v_scale[sample // bs, :, sample % bs].cpu()
    assert torch.equal(got, s_ref)
    assert torch.equal(cache.v[sample // bs, :, sample % bs].cpu(), quantize(v[sample].cpu(), fmt, s_ref))
