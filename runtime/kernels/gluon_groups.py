"""The Gluon decode kernel's tiles for group scales (`decode_gluon.py` with GROUPS > 1: GROUPS scales and zero points
per token-head, each over head_dim / GROUPS channels; integer K and V of one format, tiles loaded into registers).

The words, their widening and the mma operands are the per-token formats' (`gluon_operands`); the scales enter where
the per-token ones do, once per group, so the dots stay on the exact stored values:

* scores: q . k = sum_g s_g (q_g . k_g) (+ z_g sum(q_g) for asymmetric K), with q_g the query masked to group g's
  channels: one mma chain a group against the tile's one K operand (`group_q`: q's operands and sums a group);
* p . V, two groups (group 64): the accumulator's rows are head_dim channels, and every 16-row mma tile holds
  channels of every group (lane g's rows are channels 16g .. 16g + 15), so each group has an accumulator of its
  own, acc_g += V^T (p s_g / c)^T, and the output takes group g's rows from acc_g (`group_output`). V's zero
  points add sum_n p_n z_n,g to group g's rows. The softmax bound c on the V scales is the largest of any group's
  seen so far, as for per-token V.
* p . V, four groups (int4 group 32, where four accumulators would not fit the registers): V is dequantized as it
  is widened, s n + z' in fp16 by one packed fma a register pair (`widen_ptx.pair_scaled_asm`; a lane's 16
  channels lie in one group, its scales loaded in the words' layout), and p . V runs on those values with one
  accumulator (GROUPS > 2).
"""

from __future__ import annotations

try:  # Gluon ships with Triton >= 3.5 (decode_gluon.py falls back without it)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

if gluon is not None:
    from .gluon_operands import B_OP, MMA, _k_operands, _q_operands, _v_operand, _v_operand_scaled
    from .gluon_tiles import _page, _tile_base

    @gluon.jit
    def _group_state(z_t, acc, GROUPS: gl.constexpr):
        """The initial (z_t, acc) tuples: one a group, or one in all where V is dequantized (GROUPS > 2)."""
        z_g = ()
        acc_g = ()
        for _ in gl.static_range(1 if GROUPS > 2 else GROUPS):
            z_g = z_g + (z_t,)
            acc_g = acc_g + (acc,)
        return z_g, acc_g

    @gluon.jit
    def _group_q(q16, dr, nibble, KIND: gl.constexpr, K_CHAINS: gl.constexpr, GROUPS: gl.constexpr):
        """Per group: q's B operands masked to the group's channels (`_q_operands`), and the masked q's sums in the
        dots' unit (`decode_gluon`'s qsum); two tuples of GROUPS."""
        GS: gl.constexpr = 128 // GROUPS
        qts = ()
        qsums = ()
        for g in gl.static_range(GROUPS):
            qg = gl.where((dr[None, :] // GS) == g, q16, gl.zeros_like(q16))
            qts = qts + (_q_operands(qg, KIND, K_CHAINS),)
            qsums = qsums + (gl.convert_layout(gl.sum(qg.to(gl.float32) * (nibble / 16777216.0), 1),
                                               gl.SliceLayout(0, MMA)),)
        return qts, qsums

    @gluon.jit
    def _group_tile(n0, K, V, KS, VS, KZ, VZ, bt_row, end, kvh, stride_cb, stride_ch, stride_ct, stride_mb, stride_mh,
                    koffs, voffs, ts, tv, vcols, BLOCK_SIZE: gl.constexpr, ASYM: gl.constexpr, OFF32: gl.constexpr,
                    GROUPS: gl.constexpr, CENTER: gl.constexpr):
        """A tile's K/V words (integer pages: unmasked, as `_tile_words`) and its scales and zero points, a tuple of
        GROUPS [16] vectors each (0 past `end`); where V is dequantized (GROUPS > 2), V's as one-tuples of [16, W]
        fp16 in the words' layout (tv, vcols: its token and word indices): each word's scale and centred zero point
        z + CENTER s."""
        page = _page(bt_row, n0, end, BLOCK_SIZE, OFF32)
        base, slot = _tile_base(n0, page, kvh, stride_cb, stride_ch, stride_ct, BLOCK_SIZE)
        kw = gl.load(K + base + koffs)
        vw = gl.load(V + base + voffs)
        meta = (page * stride_mb + kvh * stride_mh + slot + ts) * GROUPS
        tmask = (n0 + ts) < end
        ks = ()
        vs = ()
        kz = ()
        vz = ()
        for g in gl.static_range(GROUPS):
            ks = ks + (gl.load(KS + meta + g, mask=tmask, other=0.0).to(gl.float32),)
            if ASYM:
                kz = kz + (gl.load(KZ + meta + g, mask=tmask, other=0.0).to(gl.float32),)
            else:
                kz = kz + (0.0,)
            if GROUPS <= 2:
                vs = vs + (gl.load(VS + meta + g, mask=tmask, other=0.0).to(gl.float32),)
                if ASYM:
                    vz = vz + (gl.load(VZ + meta + g, mask=tmask, other=0.0).to(gl.float32),)
                else:
                    vz = vz + (0.0,)
        if GROUPS > 2:  # int4 words: 8 channels each, inside one group
            voff = ((page * stride_mb + kvh * stride_mh + slot + tv) * GROUPS)[:, None] + (vcols * 8 // (128 // GROUPS)
                                                                                        )[None, :]
            vmask = ((n0 + tv) < end)[:, None]
            s_w = gl.load(VS + voff, mask=vmask, other=0.0).to(gl.float32)
            z_w = gl.zeros_like(s_w)
            if ASYM:
                z_w = gl.load(VZ + voff, mask=vmask, other=0.0).to(gl.float32) + CENTER * s_w
            vs = (s_w.to(gl.float16),)
            vz = (z_w.to(gl.float16),)
        return kw, vw, ks, vs, kz, vz

    @gluon.jit
    def _group_scores(n0, kw, ks, kz, end, qts, qsums, k_fold, ts, KIND: gl.constexpr, ASYM: gl.constexpr,
                      ASM: gl.constexpr, K_CENTER: gl.constexpr, K_CHAINS: gl.constexpr, GROUPS: gl.constexpr):
        """A tile's scores s^T [16 tokens, 8 heads] in log2 units, -inf past `end`: sum_g s_g (q_g . k_g)."""
        a = _k_operands(kw, KIND, ASM, K_CHAINS)
        s = gl.zeros([16, 8], gl.float32, layout=MMA)
        for g in gl.static_range(GROUPS):
            qt = qts[g]
            sg = mma_v2(a[0], qt[0], gl.zeros([16, 8], gl.float32, layout=MMA))
            for i in gl.static_range(1, K_CHAINS):
                sg += mma_v2(a[i], qt[i], gl.zeros([16, 8], gl.float32, layout=MMA))
            if K_CENTER != 0:  # k = s_g (n - K_CENTER) for stored n
                sg = sg - K_CENTER * qsums[g][None, :]
            s += sg * ks[g][:, None]
            if ASYM:
                s += kz[g][:, None] * qsums[g][None, :]
        return gl.where(((n0 + ts) < end)[:, None], s * k_fold, float("-inf"))

    @gluon.jit
    def _group_attend(n0, kw, vw, ks, vs, kz, vz, m_i, l_t, z_t, acc, c_v, end, qts, qsums, k_fold, ts,
                      KIND: gl.constexpr, ASYM: gl.constexpr, ASM: gl.constexpr, VASM: gl.constexpr,
                      CENTER: gl.constexpr, K_CENTER: gl.constexpr, K_CHAINS: gl.constexpr, GROUPS: gl.constexpr):
        """One 16-token tile into the state (m_i, l_t, z_t, acc, c_v); z_t and acc: a tuple of GROUPS."""
        s = _group_scores(n0, kw, ks, kz, end, qts, qsums, k_fold, ts, KIND, ASYM, ASM, K_CENTER, K_CHAINS, GROUPS)
        if GROUPS > 2:  # V's values dequantized: p as it is, one accumulator
            m_new = gl.maximum(m_i, gl.max(s, 0))
            p = gl.exp2(s - m_new[None, :])
            alpha = gl.exp2(m_i - m_new)
            pt = gl.convert_layout(p.to(gl.float16), B_OP)
            acc_new = (mma_v2(_v_operand_scaled(vw, vs[0], vz[0], VASM), pt, acc[0] * alpha[None, :]),)
            l_t = l_t * alpha[None, :] + p
            z_new = z_t
            c_new = c_v
        else:
            c_new = c_v
            for g in gl.static_range(GROUPS):
                c_new = gl.maximum(c_new, gl.max(vs[g], 0))
            m_new = gl.maximum(m_i, gl.max(s, 0))
            p = gl.exp2(s - m_new[None, :])
            alpha = gl.exp2(m_i - m_new)
            l_t = l_t * alpha[None, :] + p
            a_acc = alpha * (c_v / c_new)
            vop = _v_operand(vw, KIND, VASM)
            z_new = ()
            acc_new = ()
            for g in gl.static_range(GROUPS):
                pt = gl.convert_layout((p * (vs[g] / c_new)[:, None]).to(gl.float16), B_OP)
                acc_new = acc_new + (mma_v2(vop, pt, acc[g] * a_acc[None, :]),)
                if ASYM:
                    z_new = z_new + (z_t[g] * alpha[None, :] + p * (vz[g] + CENTER * vs[g])[:, None],)
                else:
                    z_new = z_new + (z_t[g],)
        return m_new, l_t, z_new, acc_new, c_new

    @gluon.jit
    def _group_output(z_t, acc, c_v, ASYM: gl.constexpr, GROUPS: gl.constexpr):
        """o^T [128 m, 8] from the groups' accumulators: row m (channel d = 16 (m % 8) + 2 (m // 16) + (m // 8) % 2,
        `gluon_operands._v_operand`) from its group's."""
        if GROUPS > 2:  # V dequantized: one accumulator of the values themselves
            o = acc[0]
        else:
            GS: gl.constexpr = 128 // GROUPS
            m = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
            grp = ((m % 8) * 16 + (m // 16) * 2 + (m // 8) % 2) // GS
            o = gl.zeros([128, 8], gl.float32, layout=MMA)
            for g in gl.static_range(GROUPS):
                og = acc[g] * c_v
                if ASYM:
                    og += gl.sum(z_t[g], 0)[None, :]
                o = gl.where((grp == g)[:, None], og, o)
        return o
