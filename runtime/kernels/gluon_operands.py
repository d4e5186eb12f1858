"""The Gluon decode kernel's register layouts (`decode_gluon.py`): the mma operands, the K / V words
as loaded, q / out rows, and the relabellings between them.

A dot product does not care in which order it visits head_dim, so the kernel reads K and V in the
order that makes each lane's A-operand elements contiguous in the page, and widens the loaded
32-bit words in place (`widen_ptx`). In Gluon those orders are reshapes and permutes of register
layouts; the final conversion to the mma operand layout is checked to move no data
(`assert_trivial`): a wrong permutation fails the build.
"""

from __future__ import annotations

from . import codes

try:  # Gluon ships with Triton >= 3.5 (decode_gluon.py falls back without it)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

if gluon is not None:
    MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
    A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
    B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
    # q / out rows [8 heads, 128]: 4 lanes per head, 32 contiguous values each
    ROWS = gl.constexpr(gl.BlockedLayout([1, 32], [8, 4], [1, 1], [1, 0]))
    # K words [16 tokens, W]: lane (g, t) holds rows g and g + 8, words [t W/4, (t + 1) W/4)
    K_W8 = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0]))
    K_W4 = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0]))
    # V words [16 tokens, W]: lane (g, t) holds rows 2t, 2t + 1, 2t + 8, 2t + 9, words [g W/8, (g + 1) W/8)
    V_W8 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0]], lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]],
        warp_bases=[], block_bases=[], shape=[16, 32]))
    V_W4 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [1, 0], [8, 0]], lane_bases=[[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]],
        warp_bases=[], block_bases=[], shape=[16, 16]))

    @gluon.jit
    def _widen(w, KIND: gl.constexpr, ASM: gl.constexpr):
        """Words [R, C] -> fp16 values [R, 4C] (8-bit) or [R, 8C] (int4) in storage order (`word_asm`)."""
        if KIND == codes.INT4:
            x = gl.inline_asm_elementwise(ASM, "=h," * 8 + "r", [w], dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        else:
            x = gl.inline_asm_elementwise(ASM, "=h," * 4 + "r", [w], dtype=(gl.float16,) * 4, is_pure=True, pack=1)
        return _word_values(x, KIND)

    @gluon.jit
    def _widen_scaled(w, s, z, KIND: gl.constexpr, ASM: gl.constexpr):
        """`_widen` of integer words dequantized on the way (`widen_ptx.word_scaled_asm`): s, z [R, C] fp16, each
        word's scale and centred zero point, in the words' layout."""
        if KIND == codes.INT4:
            x = gl.inline_asm_elementwise(ASM, "=h," * 8 + "r,h,h", [w, s, z], dtype=(gl.float16,) * 8, is_pure=True,
                                          pack=1)
        else:
            x = gl.inline_asm_elementwise(ASM, "=h," * 4 + "r,h,h", [w, s, z], dtype=(gl.float16,) * 4, is_pure=True,
                                          pack=1)
        return _word_values(x, KIND)

    @gluon.jit
    def _word_values(x, KIND: gl.constexpr):
        """A word's widened values, output i = value i (a tuple of 8 or 4 [R, C]) -> [R, 8C] / [R, 4C] in storage
        order: join puts its second operand on a new last axis, so joining (even, odd) pairs outermost-last rebuilds
        the storage order."""
        R: gl.constexpr = x[0].shape[0]
        C: gl.constexpr = x[0].shape[1]
        if KIND == codes.INT4:
            y = gl.join(gl.join(gl.join(x[0], x[4]), gl.join(x[2], x[6])), gl.join(gl.join(x[1], x[5]),
                                                                                gl.join(x[3], x[7])))
            return gl.reshape(y, [R, 8 * C])
        else:
            return gl.reshape(gl.join(gl.join(x[0], x[2]), gl.join(x[1], x[3])), [R, 4 * C])

    @gluon.jit
    def _k_columns(x, KIND: gl.constexpr):
        """[R, 128] in head_dim order -> [R, 128] in the scores' k order (K's rows and q's alike).

        For K, lane (g, t) holds stored columns [32t, 32t + 32) of rows g and g + 8; the A operand
        wants k = 16i + 8h + 2t + e there (i < 8; h, e < 2), with (k, k + 1) in one register. e is
        the column bit `word_asm` pairs in a register (fp8: bit 0, int8: bit 1, int4: bit 2), h the
        lowest other bit, i the remaining three."""
        R: gl.constexpr = x.shape[0]
        y = gl.reshape(x, [R, 4, 2, 2, 2, 2, 2])  # (row, t, d4, d3, d2, d1, d0)
        if KIND == codes.FLOAT:
            y = gl.permute(y, (0, 2, 3, 4, 5, 1, 6))
        elif KIND == codes.INT8:
            y = gl.permute(y, (0, 2, 3, 4, 6, 1, 5))
        else:
            y = gl.permute(y, (0, 2, 3, 5, 6, 1, 4))
        return gl.reshape(y, [R, 128])

    @gluon.jit
    def _halves(x):
        """[R, C] -> its columns [0, C / 2) and [C / 2, C)."""
        R: gl.constexpr = x.shape[0]
        C: gl.constexpr = x.shape[1]
        return gl.split(gl.permute(gl.reshape(x, [R, 2, C // 2]), (0, 2, 1)))

    @gluon.jit
    def _k_parts(x, PARTS: gl.constexpr):
        """[R, 128] in the scores' k order -> PARTS (1 or 2) column blocks of 128 / PARTS, as a tuple."""
        if PARTS == 1:
            return (x,)
        else:
            return _halves(x)

    @gluon.jit
    def _k_operands(w, KIND: gl.constexpr, ASM: gl.constexpr, PARTS: gl.constexpr):
        """K words [16, W] -> the scores' A operand [16 tokens, 128 k] as PARTS (1 or 2) blocks along k, a tuple of
        [16, 128 / PARTS] (a register rename: k's bits 5 and 6 are register bits of the A operand). Each block
        starts its own chain of mma: one chain of 8 m16n8k16 waits on each result in turn."""
        return _a_operands(_widen(w, KIND, ASM), KIND, PARTS)

    @gluon.jit
    def _k_operands_scaled(w, s, z, KIND: gl.constexpr, ASM: gl.constexpr, PARTS: gl.constexpr):
        """`_k_operands` of integer K dequantized on the way (`_widen_scaled`): the A operands hold s n + z'."""
        return _a_operands(_widen_scaled(w, s, z, KIND, ASM), KIND, PARTS)

    @gluon.jit
    def _a_operands(x, KIND: gl.constexpr, PARTS: gl.constexpr):
        """fp16 K rows [16, 128] in head_dim order, lane (g, t) holding columns [32t, 32t + 32) of rows g and g + 8
        (widened words, or rows loaded so) -> the scores' A operands in KIND's column order (`_k_operands`)."""
        parts = _k_parts(_k_columns(x, KIND), PARTS)
        ops = (gl.convert_layout(parts[0], A_OP, assert_trivial=True),)
        for i in gl.static_range(1, PARTS):
            ops = ops + (gl.convert_layout(parts[i], A_OP, assert_trivial=True),)
        return ops

    @gluon.jit
    def _q_operands(q, KIND: gl.constexpr, PARTS: gl.constexpr):
        """q rows [8 heads, 128] in head_dim order -> the scores' B operands q^T, in the k order and the PARTS
        blocks of `_k_operands` (a tuple of [128 / PARTS, 8])."""
        parts = _k_parts(_k_columns(q, KIND), PARTS)
        qt = (gl.convert_layout(gl.permute(parts[0], (1, 0)), B_OP),)
        for i in gl.static_range(1, PARTS):
            qt = qt + (gl.convert_layout(gl.permute(parts[i], (1, 0)), B_OP),)
        return qt

    @gluon.jit
    def _widen_pairs(w, KIND: gl.constexpr, ASM: gl.constexpr):
        """V words [16, C] -> fp16 values [16, 4C] (8-bit) or [16, 8C] (int4) in storage order, through
        `pair_asm` on the words of tokens 2i and 2i + 1 (the token-parity axis is in registers)."""
        even, odd = _token_pairs(w)
        if KIND == codes.INT4:
            x = gl.inline_asm_elementwise(ASM, "=h," * 16 + "r,r", [even, odd], dtype=(gl.float16,) * 16,
                                          is_pure=True, pack=1)
        else:
            x = gl.inline_asm_elementwise(ASM, "=h," * 8 + "r,r", [even, odd], dtype=(gl.float16,) * 8,
                                          is_pure=True, pack=1)
        return _pair_values(x, KIND)

    @gluon.jit
    def _token_pairs(x):
        """[16, C] -> its even and odd tokens' rows, [8, C] each."""
        C: gl.constexpr = x.shape[1]
        return gl.split(gl.permute(gl.reshape(x, [8, 2, C]), (0, 2, 1)))

    @gluon.jit
    def _pair_values(x, KIND: gl.constexpr):
        """`pair_asm`'s outputs (a tuple of 16 (int4) or 8 [8, C]: output 2i the even token's value i, 2i + 1 the
        odd one's) -> [16, 8C] / [16, 4C] in storage order."""
        C: gl.constexpr = x[0].shape[1]
        if KIND == codes.INT4:
            p0, p1, p2, p3, p4, p5, p6, p7 = (gl.join(x[0], x[1]), gl.join(x[2], x[3]), gl.join(x[4], x[5]),
                                              gl.join(x[6], x[7]), gl.join(x[8], x[9]), gl.join(x[10], x[11]),
                                              gl.join(x[12], x[13]), gl.join(x[14], x[15]))
            y = gl.join(gl.join(gl.join(p0, p4), gl.join(p2, p6)), gl.join(gl.join(p1, p5), gl.join(p3, p7)))
            y = gl.permute(y, (0, 2, 1, 3, 4, 5))  # (token pair, parity, word, value bits high to low)
            return gl.reshape(y, [16, 8 * C])
        else:
            p0, p1, p2, p3 = gl.join(x[0], x[1]), gl.join(x[2], x[3]), gl.join(x[4], x[5]), gl.join(x[6], x[7])
            y = gl.permute(gl.join(gl.join(p0, p2), gl.join(p1, p3)), (0, 2, 1, 3, 4))
            return gl.reshape(y, [16, 4 * C])

    @gluon.jit
    def _v_operand(w, KIND: gl.constexpr, ASM: gl.constexpr):
        """V words [16, W] -> p . V's A operand V^T [128 m, 16 tokens]: lane (g, t) holds stored
        columns d = 16g + 2j + r (j < 8, r < 2), which the A operand calls m = 16j + 8r + g."""
        return _v_rows(_widen_pairs(w, KIND, ASM))

    @gluon.jit
    def _v_rows(values):
        """V's values [16 tokens, 128] in storage order (`_widen_pairs`) -> the A operand V^T (`_v_operand`)."""
        y = gl.permute(values, (1, 0))
        y = gl.permute(gl.reshape(y, [8, 8, 2, 16]), (1, 2, 0, 3))
        return gl.convert_layout(gl.reshape(y, [128, 16]), A_OP, assert_trivial=True)

    @gluon.jit
    def _v_operand_scaled(w, s, z, KIND: gl.constexpr, ASM: gl.constexpr):
        """`_v_operand` of integer V dequantized on the way (`widen_ptx.pair_scaled_asm`): s, z [16, W] fp16, each
        word's scale and centred zero point, in the words' layout."""
        even, odd = _token_pairs(w)
        s_even, s_odd = _token_pairs(s)
        z_even, z_odd = _token_pairs(z)
        if KIND == codes.INT4:
            x = gl.inline_asm_elementwise(ASM, "=h," * 16 + "r,r,h,h,h,h", [even, odd, s_even, s_odd, z_even, z_odd],
                                          dtype=(gl.float16,) * 16, is_pure=True, pack=1)
        else:
            x = gl.inline_asm_elementwise(ASM, "=h," * 8 + "r,r,h,h,h,h", [even, odd, s_even, s_odd, z_even, z_odd],
                                          dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        return _v_rows(_pair_values(x, KIND))

    @gluon.jit
    def _out_rows(acc):
        """o^T [128 m, 8] -> o [8 heads, 128] in head_dim order (d = 16g + 2j + r for m = 16j + 8r + g)."""
        y = gl.permute(gl.reshape(acc, [8, 2, 8, 8]), (3, 2, 0, 1))
        return gl.convert_layout(gl.reshape(y, [8, 128]), ROWS)
