"""The PTX that widens stored bytes to fp16 / bf16 (widen_ptx.py): exact for every byte in every position, for the
Gluon kernel's K words and V token pairs and the Triton kernels' int8 / int4 tiles. GPU only (the interpreter has
no PTX)."""

from __future__ import annotations

import pytest
import torch

from runtime.kernels import codes
from tests.helpers_kernels import CUDA, DEV


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


def _every_byte_words() -> tuple[torch.Tensor, torch.Tensor]:
    """Two sets of 256 int32 words (two tokens' words for the pair widening), each holding every byte value in every
    position: word i of the first holds bytes i, i + 85, i + 170, i + 37 (mod 256)."""
    i = torch.arange(256, dtype=torch.int32)
    a = torch.stack([i, (i + 85) % 256, (i + 170) % 256, (i + 37) % 256], -1).to(torch.uint8).view(torch.int32)[:, 0]
    b = torch.stack([(i + 3) % 256, (i + 101) % 256, (255 - i), (i * 7) % 256], -1).to(torch.uint8).view(torch.int32)[:, 0]
    return a, b


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

    @triton.jit
    def widen(A, B, Y, ASM: tl.constexpr, PAIR: tl.constexpr, N: tl.constexpr, CONSTRAINTS: tl.constexpr):
        offs = tl.arange(0, 256)
        args = [tl.load(A + offs), tl.load(B + offs)] if PAIR else [tl.load(A + offs)]
        out = tl.inline_asm_elementwise(ASM, CONSTRAINTS, args, dtype=(tl.float16,) * N, is_pure=True, pack=1)
        for i in tl.static_range(N):
            tl.store(Y + offs * N + i, out[i].to(tl.float32))

    per_word = 8 if kind == 2 else 4
    a, b = _every_byte_words()
    fp8_dtype = torch.float8_e4m3fn if fp8 == codes.FP8_E4M3 else torch.float8_e5m2
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


@pytest.mark.skipif(not CUDA, reason="inline PTX compiles for the GPU only; the interpreter has no PTX")
@pytest.mark.parametrize("kind,symmetric", [(1, True), (1, False), (2, True), (2, False)],
                         ids=["int8", "uint8", "int4", "uint4"])
def test_gluon_scaled_widening_rounds_once(kind, symmetric):
    """widen_ptx.word_scaled_asm (K of group scales: a word, its scale and zero point -> its values) and
    pair_scaled_asm (V: two tokens' words, scales and zero points -> their values interleaved) give s n + z for every
    byte in every position, n the centred value, rounded once to fp16 (the fp64 product and sum, then one rounding)."""
    import triton
    import triton.language as tl

    from runtime.kernels import widen_ptx

    @triton.jit
    def widen(A, B, SA, SB, ZA, ZB, Y, ASM: tl.constexpr, PAIR: tl.constexpr, N: tl.constexpr,
              CONSTRAINTS: tl.constexpr):
        offs = tl.arange(0, 256)
        if PAIR:
            args = [tl.load(A + offs), tl.load(B + offs), tl.load(SA + offs), tl.load(SB + offs), tl.load(ZA + offs),
                    tl.load(ZB + offs)]
        else:
            args = [tl.load(A + offs), tl.load(SA + offs), tl.load(ZA + offs)]
        out = tl.inline_asm_elementwise(ASM, CONSTRAINTS, args, dtype=(tl.float16,) * N, is_pure=True, pack=1)
        for i in tl.static_range(N):
            tl.store(Y + offs * N + i, out[i].to(tl.float32))

    per_word = 8 if kind == 2 else 4
    a, b = _every_byte_words()
    gen = torch.Generator().manual_seed(kind * 2 + symmetric)
    # scales over four decades, zero points of either sign (fp16 values: what the kernel passes)
    sa, sb = ((10.0 ** (torch.rand(256, generator=gen) * 4 - 3)).half() for _ in range(2))
    za, zb = ((torch.randn(256, generator=gen) * 3).half() for _ in range(2))
    va, vb = (_stored_values(w, kind, None, symmetric).double() for w in (a, b))
    want_a = (sa.double()[:, None] * va + za.double()[:, None]).half().float()
    want_b = (sb.double()[:, None] * vb + zb.double()[:, None]).half().float()
    for pair in (False, True):
        n = 2 * per_word if pair else per_word
        asm = (widen_ptx.pair_scaled_asm(kind, symmetric) if pair else widen_ptx.word_scaled_asm(kind, symmetric))
        y = torch.empty(256, n, dtype=torch.float32, device=DEV)
        widen[(1,)](*(t.to(DEV) for t in (a, b, sa, sb, za, zb)), y, ASM=asm, PAIR=pair, N=n,
                    CONSTRAINTS="=h," * n + ("r,r,h,h,h,h" if pair else "r,h,h"))
        want = torch.stack([want_a, want_b], -1).reshape(256, n) if pair else want_a
        assert torch.equal(y.cpu(), want), f"pair={pair}: first mismatch at {(y.cpu() != want).nonzero()[0].tolist()}"


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
