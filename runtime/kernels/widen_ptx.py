"""PTX that widens stored 8-/4-bit KV values to 16-bit floats exactly, for every kernel that
inlines it: the Triton decode kernels (`widen_asm`: 4 stored bytes -> 4 values, through
`dequant._unpack`) and the Gluon decode kernel (`word_asm` for K, `pair_asm` for V; `word_scaled_asm`,
`pair_scaled_asm` for group scales, where the values are dequantized as they are widened). The
strings are built once per format and passed to the kernels as constexprs."""

from __future__ import annotations

import functools

import torch

from . import codes


def _half2(x: float, dtype: torch.dtype = torch.float16) -> str:
    """A PTX b32 immediate holding x as `dtype` (fp16 or bf16) in both halves."""
    h = torch.tensor(x, dtype=dtype).view(torch.int16).item() & 0xFFFF
    return f"{(h << 16) | h:#010x}"


@functools.cache  # once per (bits, dtype, symmetric), not per launch
def widen_asm(bits: int, dtype: torch.dtype, symmetric: bool) -> tuple[str, str]:
    """PTX turning 4 stored bytes into 4 values of `dtype`: (low nibbles, high nibbles) for int4,
    (the 4 bytes, unused) for int8 (fp16 only: bf16's 8-bit significand cannot hold 256 + n).

    A value n in [0, 256) placed under the exponent byte of 2**7 (bf16 0x43..) or 2**10
    (fp16 0x64..) is exactly 128 + n or 1024 + n (int4 nibbles need no more than bf16's
    7 stored bits); one packed FMA removes that offset and the stored zero (8 for symmetric
    int4; symmetric int8 is flipped to n + 128 by an XOR of the sign bits first). Two values
    per 32-bit register, element 2i in the low half.
    """
    if bits == 8 and dtype != torch.float16:
        raise ValueError("int8 widening in PTX needs fp16 (bf16 cannot represent 1024 + n exactly)")
    if dtype == torch.bfloat16:
        magic, one, base, fma = 0x43434343, 0x3F803F80, 128.0, "fma.rn.bf16x2"
    else:
        magic, one, base, fma = 0x64646464, 0x3C003C00, 1024.0, "fma.rn.f16x2"
    zero = (8 if bits == 4 else 128) if symmetric else 0
    if bits == 4:
        preps = ("and.b32 t, t, 0x0F0F0F0F; ", "shr.b32 t, t, 4; and.b32 t, t, 0x0F0F0F0F; ")
    else:
        preps = ("xor.b32 t, t, 0x80808080; " if symmetric else "",)
    progs = [
        "{ .reg .b32 t, m, o, b; mov.b32 t, $2; " + prep
        + f"mov.b32 m, {magic:#010x}; mov.b32 o, {one:#010x}; mov.b32 b, {_half2(-(base + zero), dtype)}; "
        "prmt.b32 $0, t, m, 0x4140; prmt.b32 $1, t, m, 0x4342; "
        f"{fma} $0, $0, o, b; {fma} $1, $1, o, b; }}"
        for prep in preps
    ]
    return progs[0], progs[1] if bits == 4 else ""


# PTX registers c0-c2 holding the widening constants (f16x2 instructions take no immediates)
_INT4_CONSTANTS = (f".reg .b32 c0, c1, c2; mov.b32 c0, {_half2(-1032.0)}; mov.b32 c1, {_half2(0.0625)}; "
                  f"mov.b32 c2, {_half2(-72.0)}; ")
_INT8_CONSTANTS = f".reg .b32 c0; mov.b32 c0, {_half2(-1152.0)}; "


def _int_widen(kind: int, symmetric: bool, src: str, dst: list[str]) -> str:
    """PTX: the values at bits 0-7 / 16-23 of register `src` (int8) or at bits 0-3 / 16-19 and
    4-7 / 20-23 (int4) -> packed fp16 pairs, centred (n - 128 / n - 8), into `dst` (after
    `_INT8_CONSTANTS` / `_INT4_CONSTANTS`).

    A byte or low nibble n placed under fp16 1024.0's exponent (0x6400) is 1024 + n exactly;
    a high nibble there is 1024 + 16 n, which one fma by 1/16 takes to 64 + n (FasterTransformer's
    trick: no shift per nibble). Signed int8 is first flipped to n + 128 (XOR 0x80,
    in the same LOP3)."""
    if kind != codes.INT4:
        magic = 0x64806480 if symmetric else 0x64006400
        return f"lop3.b32 {dst[0]}, {src}, 0x00FF00FF, {magic:#010x}, 0x6A; add.rn.f16x2 {dst[0]}, {dst[0]}, c0; "
    return (f"lop3.b32 {dst[0]}, {src}, 0x000F000F, 0x64006400, 0xEA; "
            f"lop3.b32 {dst[1]}, {src}, 0x00F000F0, 0x64006400, 0xEA; "
            f"add.rn.f16x2 {dst[0]}, {dst[0]}, c0; fma.rn.f16x2 {dst[1]}, {dst[1]}, c1, c2; ")


@functools.cache
def word_asm(kind: int, fp8: int, symmetric: bool) -> str:
    """PTX for K: one 32-bit word of stored values -> its 4 (8-bit) or 8 (int4) values as fp16, in
    storage order (int4: even element in the low nibble).

    fp8: `cvt.rn.f16x2.e4m3x2` / `e5m2x2` (exact). int8 / int4: the masked bits *are* the fp16
    value, a subnormal: a byte (or low nibble) n at bits 0-7 of a half is n * 2^-24 exactly, a high
    nibble 16 n * 2^-24. One LOP3 per register pair and nothing else: no bias to remove, so the
    scores' accumulator sums terms of the stored values' own size (the tensor cores take fp16
    subnormals; `test_decode_gluon_kernel` checks it). The kernel divides q's odd columns by 16 for
    int4 (so high nibbles count n), multiplies the scores by 2^24 through the softmax scale, and
    takes the centre (signed int8 is flipped to n + 128, symmetric int4 stores n + 8) off as
    `K_CENTER * sum(q)`. Registers hold values (i, i + 2) (int8) or (i, i + 4) (int4); the K
    operand's column order (`_k_columns`) is chosen so that these are its register pairs.
    """
    if kind == codes.FLOAT:
        name = {codes.FP8_E4M3: "e4m3", codes.FP8_E5M2: "e5m2"}[fp8]
        return ("{ .reg .b16 l, h; .reg .b32 a, b; mov.b32 {l, h}, $4; "
                f"cvt.rn.f16x2.{name}x2 a, l; cvt.rn.f16x2.{name}x2 b, h; "
                "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")
    if kind != codes.INT4:
        flip = 0x00800080 if symmetric else 0  # (w & mask) ^ flip
        return ("{ .reg .b32 s, a, b; shr.b32 s, $4, 8; "
                f"lop3.b32 a, $4, 0x00FF00FF, {flip:#010x}, 0x6A; lop3.b32 b, s, 0x00FF00FF, {flip:#010x}, 0x6A; "
                "mov.b32 {$0, $2}, a; mov.b32 {$1, $3}, b; }")
    return ("{ .reg .b32 s, a, b, c, d; shr.b32 s, $8, 8; "
            "and.b32 a, $8, 0x000F000F; and.b32 b, $8, 0x00F000F0; and.b32 c, s, 0x000F000F; and.b32 d, s, 0x00F000F0; "
            "mov.b32 {$0, $4}, a; mov.b32 {$1, $5}, b; mov.b32 {$2, $6}, c; mov.b32 {$3, $7}, d; }")


@functools.cache
def pair_asm(kind: int, fp8: int, symmetric: bool) -> str:
    """PTX for V: the same word of two consecutive tokens -> output 2i is the first token's value i,
    output 2i + 1 the second's, each pair already in one register. Integers come out centred
    (`_int_widen`): p . V sums over thousands of tokens, where uncentred values and a separate
    centre term cancel and the tensor cores' fp32 accumulation (not exact) leaves the difference
    (asymmetric int8 per-token: 4.0e-3 against 1.7e-3 at 2731 tokens per split).

    p . V reduces over tokens, so V's A operand pairs two tokens of one head_dim column per
    register. One byte permute per word interleaves the tokens before widening; widening the
    tokens separately and repacking afterwards cost a permute per register instead (8-bit: two
    per word, int4: four)."""
    body, n = _pair_body(kind, fp8, symmetric)
    return body + "".join(f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, r{i}; " for i in range(n)) + "}"


@functools.cache
def word_scaled_asm(kind: int, symmetric: bool) -> str:
    """`word_asm` for integer K of group scales, dequantized: inputs the word, then its fp16 scale and centred zero
    point (z + centre x s: a lane's word lies in one group of one token); each centred value n (`_int_widen`) becomes
    s n + z' by one packed fma (rounded once to fp16). Outputs in `word_asm`'s order: register i holds values
    (i, i + n / 2)."""
    n = 8 if kind == codes.INT4 else 4
    regs = [f"r{i}" for i in range(n // 2)]
    per = n // 4  # fp16 pairs a byte position gives: int8 1, int4 2 (low and high nibble)
    body = (f"{{ .reg .b32 u, sp, zp, {', '.join(regs)}; "
            + (_INT4_CONSTANTS if kind == codes.INT4 else _INT8_CONSTANTS)
            + f"shr.b32 u, ${n}, 8; mov.b32 sp, {{${n + 1}, ${n + 1}}}; mov.b32 zp, {{${n + 2}, ${n + 2}}}; "
            + _int_widen(kind, symmetric, f"${n}", regs[:per]) + _int_widen(kind, symmetric, "u", regs[per:])
            + "".join(f"fma.rn.f16x2 {r}, {r}, sp, zp; " for r in regs))
    return body + "".join(f"mov.b32 {{${i}, ${i + n // 2}}}, r{i}; " for i in range(n // 2)) + "}"


@functools.cache
def pair_scaled_asm(kind: int, symmetric: bool) -> str:
    """`pair_asm` for integer V of group scales, dequantized: inputs the two tokens' words, then their fp16 scales
    (first token, second) and centred zero points (z + centre x s); each centred value n becomes s n + z' by one
    packed fma (rounded once to fp16)."""
    body, n = _pair_body(kind, codes.FP8_NONE, symmetric)
    scale = (f".reg .b32 sp, zp; mov.b32 sp, {{${2 * n + 2}, ${2 * n + 3}}}; "
             f"mov.b32 zp, {{${2 * n + 4}, ${2 * n + 5}}}; "
             + "".join(f"fma.rn.f16x2 r{i}, r{i}, sp, zp; " for i in range(n)))
    return body + scale + "".join(f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, r{i}; " for i in range(n)) + "}"


def _pair_body(kind: int, fp8: int, symmetric: bool) -> tuple[str, int]:
    """`pair_asm`'s PTX up to its outputs: the block with registers r0 .. r(n-1) holding the token pairs (open), and
    n, the values a word holds."""
    n = 8 if kind == codes.INT4 else 4  # values per word; inputs are $2n (first token), $2n+1
    a, b = f"${2 * n}", f"${2 * n + 1}"
    if kind == codes.FLOAT:  # x = (a0, b0, a1, b1), y = (a2, b2, a3, b3): each 16-bit half is a token pair
        name = {codes.FP8_E4M3: "e4m3", codes.FP8_E5M2: "e5m2"}[fp8]
        body = (f"{{ .reg .b16 l0, h0, l1, h1; .reg .b32 x, y, r0, r1, r2, r3; "
                f"prmt.b32 x, {a}, {b}, 0x5140; prmt.b32 y, {a}, {b}, 0x7362; "
                "mov.b32 {l0, h0}, x; mov.b32 {l1, h1}, y; "
                f"cvt.rn.f16x2.{name}x2 r0, l0; cvt.rn.f16x2.{name}x2 r1, h0; "
                f"cvt.rn.f16x2.{name}x2 r2, l1; cvt.rn.f16x2.{name}x2 r3, h1; ")
    else:  # x = (a0, a1, b0, b1), y = (a2, a3, b2, b3) bytes; >> 8 brings the odd bytes down
        regs = [f"r{i}" for i in range(n)]
        per = n // 4  # fp16 pairs per byte position: int8 1, int4 2 (low and high nibble)
        body = (f"{{ .reg .b32 x, y, u, v, {', '.join(regs)}; "
                + (_INT4_CONSTANTS if kind == codes.INT4 else _INT8_CONSTANTS)
                + f"prmt.b32 x, {a}, {b}, 0x5410; prmt.b32 y, {a}, {b}, 0x7632; shr.b32 u, x, 8; shr.b32 v, y, 8; "
                + "".join(_int_widen(kind, symmetric, src, regs[i * per:(i + 1) * per])
                          for i, src in enumerate(("x", "u", "y", "v"))))
    return body, n
