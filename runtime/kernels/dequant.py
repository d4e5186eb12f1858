"""Triton helpers both decode kernels share: the dot modes and exact widening of stored values.

`decode_attention._decode_kernel` (query heads x tokens tiles) and
`decode_warps._decode_kernel_warps` (one softmax state per warp) read the same
stored formats the same way; these are the pieces they have in common.
"""

from __future__ import annotations

import triton
import triton.language as tl

# How tl.dot runs: native fp16/bf16 tensor cores; fp32 in IEEE precision (q in
# fp32, parity runs); or fp32 operands in place of bf16 ones, because the
# Triton 3.6 interpreter's bf16 tl.dot and int8->bf16 casts return garbage.
DOT_NATIVE, DOT_IEEE, DOT_UPCAST = 0, 1, 2


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    if DOT == 1:
        return tl.dot(a, b, input_precision="ieee")
    elif DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _operand(x, dt: tl.constexpr, DOT: tl.constexpr, CVT_EARLY: tl.constexpr):
    """Cast a K/V tile to the dot dtype.

    With CVT_EARLY the cast is followed by a split/join of column pairs -- an identity the
    compiler does not move casts across. Without it, Triton 3.6 sinks the cast of an 8-bit
    tile below the shared-memory staging of the tensor-core operand and then reads that
    operand back one byte per instruction (LDS.U8); with it, the tile is widened in the
    registers it was loaded into and staged as 16-bit data read with ldmatrix, as in the
    bf16 kernel (SASS: ~25% fewer instructions, no LDS.U8; KERNEL_NOTES.md).
    """
    if DOT == 2:
        y = x.to(tl.float32)
    else:
        y = x.to(dt)
    if CVT_EARLY:
        R: tl.constexpr = y.shape[0]
        C: tl.constexpr = y.shape[1]
        a, b = tl.split(tl.reshape(y, (R, C // 2, 2)))
        y = tl.reshape(tl.join(a, b), (R, C))
    return y


@triton.jit
def _unpack(raw, HALF: tl.constexpr, KIND: tl.constexpr, ASYM: tl.constexpr,
            ASM_LO: tl.constexpr, ASM_HI: tl.constexpr, dt: tl.constexpr):
    """Stored tile -> integer/fp values (exact). For int4, HALF 0 = low nibbles, 1 = high.

    ASM_LO/ASM_HI (GPU only, else ""): the PTX of `widen_ptx.widen_asm`, which turns 4 stored bytes
    into 4 fp16/bf16 values with an AND or XOR, two byte permutes and two packed FMAs -- the
    generic nibble code costs ~5 instructions per value (KERNEL_NOTES.md), and Triton widens
    int8 one value per conversion instruction.
    """
    if KIND == 2:
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
    elif KIND == 1 and ASM_LO != "":
        out = tl.inline_asm_elementwise(ASM_LO, "=r,=r,r", [raw], dtype=dt.value, is_pure=True, pack=4)
    else:
        out = raw
    return out
