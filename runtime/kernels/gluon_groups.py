"""The Gluon decode kernel's tiles for group scales (`decode_gluon.py` with GROUPS > 1: GROUPS scales and zero points
per token-head, each over head_dim / GROUPS channels; integer K and V of one format; int4 tiles through the TMA ring
of `gluon_tiles.py` on sm_90 (`_group_ring_tile`), else loaded into registers a step ahead (`_group_tile`)).

K and V are dequantized as they are widened: a lane's words lie in one group of one token (K: lane (g, t) holds
channels [32t, 32t + 32) of two tokens; V: channels [16g, 16g + 16) of four), so each register pair takes one packed
fma, s n + z' in fp16 (`widen_ptx.word_scaled_asm`, `pair_scaled_asm`), with n the centred stored value and z' the
zero point plus the centre times s. The scores are then one mma chain against q as it is (q / 16, the float formats'
unit) and p . V one accumulator, as for fp8: the per-token formats' scale and zero-point terms are not needed. A
token's group scales and zero points load once a lane in a layout of the words split by group (`_by_group`) and are
broadcast over its words in registers (`_lane_scales`).

The values the dots see are rounded to fp16 once (a relative 2^-11, against the 1/15 or 1/255 of a group's range
the format itself rounds to), and so are the scales and zero points: a key or value beyond fp16's range (65504) would
overflow, one below its normal range (6e-5) loses bits (real models' keys and values lie far inside).
"""

from __future__ import annotations

from . import codes

try:  # Gluon ships with Triton >= 3.5 (decode_gluon.py falls back without it)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

if gluon is not None:
    from .gluon_attend import _rescale
    from .gluon_operands import B_OP, MMA, _k_operands_scaled, _v_operand_scaled
    from .gluon_tiles import _page, _tile_base

    def _by_group(reg: list, lane: list, words: int, groups: int):
        """A words layout [16 tokens, words] (its register and lane bases) split into [16, groups, words / groups]:
        a tile's scales [16, groups] load in its slice along the last axis, each lane holding its tokens' groups (a
        lane's words lie in one group), and broadcast back over the words in registers (`_lane_scales`)."""
        per = words // groups
        split = [[[r, c // per, c % per] for r, c in bases] for bases in (reg, lane)]
        return gl.DistributedLinearLayout(reg_bases=split[0], lane_bases=split[1], warp_bases=[], block_bases=[],
                                          shape=[16, groups, per])

    # `gluon_operands.K_W4`, `K_W8`, `V_W4`, `V_W8` as bases (register, lane) -> by group: int4 K / V in groups of 32
    # (4) or 64 (2) channels, int8 in groups of 64
    _K4 = ([[0, 1], [0, 2], [8, 0]], [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]])
    _K8 = ([[0, 1], [0, 2], [0, 4], [8, 0]], [[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]])
    _V4 = ([[0, 1], [1, 0], [8, 0]], [[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]])
    _V8 = ([[0, 1], [0, 2], [1, 0], [8, 0]], [[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]])
    K4_G4 = gl.constexpr(_by_group(*_K4, 16, 4))
    K4_G2 = gl.constexpr(_by_group(*_K4, 16, 2))
    K8_G1 = gl.constexpr(_by_group(*_K8, 32, 1))
    K8_G2 = gl.constexpr(_by_group(*_K8, 32, 2))
    V4_G4 = gl.constexpr(_by_group(*_V4, 16, 4))
    V4_G2 = gl.constexpr(_by_group(*_V4, 16, 2))
    V8_G2 = gl.constexpr(_by_group(*_V8, 32, 2))

    @gluon.constexpr_function
    def _scale_layout(kind, groups, side):
        """The layout a tile's scales load in (`_by_group`) for K (side 0) or V (side 1) of an integer format of
        `groups` scales a token-head (int8: K per token, or K and V in groups of 64; int4: 2 or 4 groups)."""
        if kind == codes.INT8:
            return K8_G1 if groups == 1 and side == 0 else (K8_G2, V8_G2)[side]
        return ((K4_G2, V4_G2) if groups == 2 else (K4_G4, V4_G4))[side]

    # a TMA scale ring's stages read as [64 / GROUPS, GROUPS] (`_ring_rows`)
    RING_GROUPS = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    @gluon.jit
    def _lane_scales(S, Z, rows, n0, end, L3: gl.constexpr, WL: gl.constexpr, ASYM: gl.constexpr,
                     CENTER: gl.constexpr, MASK: gl.constexpr):
        """A tile's scales and zero points from global memory into `_words_scales`: a token's GROUPS load into the
        slice of L3 (`_by_group`). rows: the tile's first scale row (token-head). MASK: 0 past `end` (V: a stale
        scale could be NaN, and p = 0 times NaN is NaN; K's scores are masked instead)."""
        GROUPS: gl.constexpr = L3.shape[1]
        tok = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        grp = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        off = ((rows + tok) * GROUPS)[:, None] + grp[None, :]
        valid = ((n0 + tok) < end)[:, None]
        if MASK:
            s = gl.load(S + off, mask=valid, other=0.0)
        else:
            s = gl.load(S + off)
        z = s
        if ASYM:
            if MASK:
                z = gl.load(Z + off, mask=valid, other=0.0)
            else:
                z = gl.load(Z + off)
        return _words_scales(s, z, L3, WL, ASYM, CENTER)

    @gluon.jit
    def _ring_scales(s_ring, z_ring, stage, n0, end, L3: gl.constexpr, WL: gl.constexpr, ASYM: gl.constexpr,
                     CENTER: gl.constexpr, MASK: gl.constexpr):
        """`_lane_scales` from ring stage `stage` (`gluon_tiles._copy_tile` with GROUPS: a row of the tile's 16 x
        GROUPS in a TMA stage of 64)."""
        GROUPS: gl.constexpr = L3.shape[1]
        L2: gl.constexpr = gl.SliceLayout(2, L3)
        tok = gl.arange(0, 16, layout=gl.SliceLayout(1, L2))
        valid = ((n0 + tok) < end)[:, None]
        s = _ring_rows(s_ring, stage, GROUPS).load(L2)
        if MASK:
            s = gl.where(valid, s, gl.zeros_like(s))
        z = s
        if ASYM:
            z = _ring_rows(z_ring, stage, GROUPS).load(L2)
            if MASK:
                z = gl.where(valid, z, gl.zeros_like(z))
        return _words_scales(s, z, L3, WL, ASYM, CENTER)

    @gluon.jit
    def _ring_rows(ring, stage, GROUPS: gl.constexpr):
        """A TMA scale ring's stage [1, 64] as the tile's [16 tokens, GROUPS]."""
        STAGES: gl.constexpr = ring.shape[0]
        return ring._reinterpret(ring.dtype, [STAGES, 64 // GROUPS, GROUPS], RING_GROUPS).index(stage).slice(0, 16)

    @gluon.jit
    def _words_scales(s, z, L3: gl.constexpr, WL: gl.constexpr, ASYM: gl.constexpr, CENTER: gl.constexpr):
        """Scales s and zero points z [16 tokens, GROUPS] in the slice of L3 ([16, GROUPS, words a group]) -> each
        word's scale and centred zero point (z + CENTER s; 0 for symmetric formats), fp16 [16, words] in the words'
        layout WL, broadcast over the lanes' words in registers."""
        GROUPS: gl.constexpr = L3.shape[1]
        WORDS: gl.constexpr = L3.shape[1] * L3.shape[2]
        s = s.to(gl.float32)
        z = z.to(gl.float32) + CENTER * s if ASYM else gl.zeros_like(s)
        words = gl.zeros([16, GROUPS, WORDS // GROUPS], gl.float16, layout=L3)
        s3, _ = gl.broadcast(gl.expand_dims(s.to(gl.float16), 2), words)
        z3, _ = gl.broadcast(gl.expand_dims(z.to(gl.float16), 2), words)
        return (gl.convert_layout(gl.reshape(s3, [16, WORDS]), WL, assert_trivial=True),
                gl.convert_layout(gl.reshape(z3, [16, WORDS]), WL, assert_trivial=True))

    @gluon.jit
    def _group_tile(n0, K, V, KS, VS, KZ, VZ, bt_row, end, kvh, stride_cb, stride_ch, stride_ct, v_strides, stride_mb,
                    stride_mh, koffs, voffs, KL: gl.constexpr, VL: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                    OFF32: gl.constexpr, K_KIND: gl.constexpr, K_ASYM: gl.constexpr, K_GROUPS: gl.constexpr,
                    K_CENTER: gl.constexpr, V_KIND: gl.constexpr, V_ASYM: gl.constexpr, V_GROUPS: gl.constexpr,
                    V_CENTER: gl.constexpr):
        """A tile's K/V words (integer pages: unmasked, as `_tile_words`; V's pages of their own strides
        `v_strides`) and each word's scale and centred zero point, K's and V's (`_lane_scales`), each side of its own
        kind, symmetry, groups and centre."""
        page = _page(bt_row, n0, end, BLOCK_SIZE, OFF32)
        base, slot = _tile_base(n0, page, kvh, stride_cb, stride_ch, stride_ct, BLOCK_SIZE)
        vbase, _ = _tile_base(n0, page, kvh, v_strides[0], v_strides[1], v_strides[2], BLOCK_SIZE)
        kw = gl.load(K + base + koffs)
        vw = gl.load(V + vbase + voffs)
        rows = page * stride_mb + kvh * stride_mh + slot
        ks, kz = _lane_scales(KS, KZ, rows, n0, end, _scale_layout(K_KIND, K_GROUPS, 0), KL, K_ASYM, K_CENTER,
                              False)
        vs, vz = _lane_scales(VS, VZ, rows, n0, end, _scale_layout(V_KIND, V_GROUPS, 1), VL, V_ASYM, V_CENTER, True)
        return kw, vw, ks, kz, vs, vz

    @gluon.jit
    def _group_ring_tile(n0, end, k_ring, v_ring, metas, stage, KL: gl.constexpr, VL: gl.constexpr,
                         ASYM: gl.constexpr, GROUPS: gl.constexpr, CENTER: gl.constexpr):
        """`_group_tile` of an int4 tile from ring stage `stage` (`gluon_tiles._copy_tile` with GROUPS)."""
        _, _, _, _, ks_ring, vs_ring, kz_ring, vz_ring, _, _, _ = metas
        kw = k_ring.index(stage).load(KL)
        vw = v_ring.index(stage).load(VL)
        L_K: gl.constexpr = _scale_layout(codes.INT4, GROUPS, 0)
        L_V: gl.constexpr = _scale_layout(codes.INT4, GROUPS, 1)
        ks, kz = _ring_scales(ks_ring, kz_ring, stage, n0, end, L_K, KL, ASYM, CENTER, False)
        vs, vz = _ring_scales(vs_ring, vz_ring, stage, n0, end, L_V, VL, ASYM, CENTER, True)
        return kw, vw, ks, kz, vs, vz

    @gluon.jit
    def _group_attend(n0, kw, vw, ks, kz, vs, vz, m_i, l_t, acc, end, qt, k_fold, ts, KIND: gl.constexpr,
                      ASM: gl.constexpr, VASM: gl.constexpr, K_CHAINS: gl.constexpr, SKIP_RESCALE: gl.constexpr,
                      V_KIND: gl.constexpr):
        """One 16-token tile into the state (m_i, l_t, acc): scores s^T [16 tokens, 8 heads] in log2 units (-inf past
        `end`) from the dequantized K, then the online softmax (`_rescale` as for static scales: no V scale bound)
        and p . V on the dequantized V (KIND, V_KIND: K's and V's)."""
        a = _k_operands_scaled(kw, ks, kz, KIND, ASM, K_CHAINS)
        s = mma_v2(a[0], qt[0], gl.zeros([16, 8], gl.float32, layout=MMA))
        for i in gl.static_range(1, K_CHAINS):
            s += mma_v2(a[i], qt[i], gl.zeros([16, 8], gl.float32, layout=MMA))
        s = gl.where(((n0 + ts) < end)[:, None], s * k_fold, float("-inf"))
        m_new, p, l_t, _, acc = _rescale(s, m_i, 1.0, 1.0, l_t, l_t, acc, codes.PER_TENSOR, False, SKIP_RESCALE)
        acc = mma_v2(_v_operand_scaled(vw, vs, vz, V_KIND, VASM), gl.convert_layout(p.to(gl.float16), B_OP), acc)
        return m_new, l_t + p, acc
