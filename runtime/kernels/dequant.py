"""Triton helpers both decode kernels share: the dot modes and exact widening of stored values.

`decode_warps._decode_kernel_warps` (one softmax state per warp), `prefill_context._prefill_context_kernel`
and `decode_tiles._decode_kernel` (query heads x tokens tiles) read the stored formats the same way; these
are the pieces they have in common.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import codes


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    if DOT == codes.DOT_IEEE:
        return tl.dot(a, b, input_precision="ieee")
    elif DOT == codes.DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _operand(x, dt: tl.constexpr, DOT: tl.constexpr):
    """Cast a K/V tile (or q, p) to the dot dtype (fp32 where the interpreter's bf16 dots are upcast)."""
    if DOT == codes.DOT_UPCAST:
        y = x.to(tl.float32)
    else:
        y = x.to(dt)
    return y


@triton.jit
def _dequant_v(vraw, HALF: tl.constexpr, VS, VZ, meta, nmask, KIND: tl.constexpr, SCALE_MODE: tl.constexpr,
               ASYM: tl.constexpr, dt: tl.constexpr, DOT: tl.constexpr, ASM_LO: tl.constexpr, ASM_HI: tl.constexpr):
    """V tile [BLOCK_N, D] in the dot dtype: per-token formats dequantized in fp32 first, others exact raw values."""
    v = _unpack(vraw, HALF, KIND, ASYM, ASM_LO, ASM_HI, dt)
    if SCALE_MODE == codes.PER_TOKEN:
        v = v.to(tl.float32) * tl.load(VS + meta, mask=nmask, other=0.0).to(tl.float32)[:, None]
        if ASYM:
            v += tl.load(VZ + meta, mask=nmask, other=0.0).to(tl.float32)[:, None]
    return _operand(v, dt, DOT)


@triton.jit
def _unpack(raw, HALF: tl.constexpr, KIND: tl.constexpr, ASYM: tl.constexpr,
            ASM_LO: tl.constexpr, ASM_HI: tl.constexpr, dt: tl.constexpr):
    """Stored tile -> integer/fp values (exact). For int4, HALF 0 = low nibbles, 1 = high.

    ASM_LO/ASM_HI (GPU only, else ""): the PTX of `widen_ptx.widen_asm`, which turns 4 stored bytes
    into 4 fp16/bf16 values with an AND or XOR, two byte permutes and two packed FMAs -- the
    generic nibble code costs ~5 instructions per value (docs/kernels.md), and Triton widens
    int8 one value per conversion instruction.
    """
    if KIND == codes.INT4:
        if ASM_LO != "":
            if HALF == 0:
                out = tl.inline_asm_elementwise(ASM_LO, "=r,=r,r", [raw], dtype=dt.value, is_pure=True, pack=4)
            else:
                out = tl.inline_asm_elementwise(ASM_HI, "=r,=r,r", [raw], dtype=dt.value, is_pure=True, pack=4)
        else:
            if HALF == 0:
                nib = raw & 0xF
            else:
                nib = raw >> 4
            if ASYM:
                out = nib
            else:
                out = nib.to(tl.int8) - 8
    elif KIND == codes.INT8 and ASM_LO != "":
        out = tl.inline_asm_elementwise(ASM_LO, "=r,=r,r", [raw], dtype=dt.value, is_pure=True, pack=4)
    else:
        out = raw
    return out
