"""A tile's attention in the Gluon decode kernel (`decode_gluon.py`): the scores of its 16 tokens, the online
softmax step and p . V, one tile a step (`_attend`) or two (`_attend_pair`), on the operands of `gluon_operands`.

A tile's scores are one chain of 8 mma (k = 128 in steps of 16), each waiting on the last's accumulator, or
(`K_CHAINS`) 2 independent chains over blocks of k, summed: a shorter dependency chain for the formats
with the fewest programs per SM to hide it (`DecodePlan.k_chains`).

Online softmax per column (head): the row sums of p accumulate elementwise and are reduced once at the
kernel's end, and where no column's max grew the rescale is skipped (`DecodePlan.skip_rescale`). Static K
scales fold into the softmax scale and static V scales multiply the output (the kernel's); per-token K
scales multiply the scores (zero points add qsum * z); per-token V scales go on p as p * s / c with c the
largest V scale seen so far (so the fp16 p stays in [0, 1]); c's growth folds into the accumulator's
rescale, zero points add sum_n p_n z_n.
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
    from .gluon_operands import B_OP, MMA, _k_operands, _v_operand

    @gluon.jit
    def _rescale(s, m_i, c_v, c_new, l_t, z_t, acc, SCALE_MODE: gl.constexpr, ASYM: gl.constexpr,
                 SKIP_RESCALE: gl.constexpr):
        """The new column max, p, and the state rescaled to it."""
        m_new = gl.maximum(m_i, gl.max(s, 0))
        p = gl.exp2(s - m_new[None, :])
        # SKIP_RESCALE: rescale the state only when a column's max (or the V scale bound) grew:
        # otherwise alpha is exactly 1. Past the first tiles of a long context it rarely grows, and
        # the rescale is 36 of a tile's ~300 instructions. The condition is warp-uniform (one-warp
        # programs).
        grown = gl.max(m_new - m_i, 0) > 0
        if SCALE_MODE == codes.PER_TOKEN:
            grown = grown | (c_new > c_v)
        if grown or not SKIP_RESCALE:
            alpha = gl.exp2(m_i - m_new)
            l_t = l_t * alpha[None, :]
            if ASYM:
                z_t = z_t * alpha[None, :]
            if SCALE_MODE == codes.PER_TOKEN:
                alpha = alpha * (c_v / c_new)
            acc = acc * alpha[None, :]
        return m_new, p, l_t, z_t, acc

    @gluon.jit
    def _scores(n0, kw, ks, kz, end, qt, qsum, k_fold, k_off, ts, KIND: gl.constexpr, SCALE_MODE: gl.constexpr,
                ASYM: gl.constexpr, ASM: gl.constexpr, K_CENTER: gl.constexpr, K_CHAINS: gl.constexpr = 1):
        """A tile's scores s^T [16 tokens, 8 heads] in log2 units, -inf past `end`."""
        # K_CHAINS independent chains of mma over blocks of k (qt: q's blocks), summed
        a = _k_operands(kw, KIND, ASM, K_CHAINS)
        s = mma_v2(a[0], qt[0], gl.zeros([16, 8], gl.float32, layout=MMA))
        for i in gl.static_range(1, K_CHAINS):
            s += mma_v2(a[i], qt[i], gl.zeros([16, 8], gl.float32, layout=MMA))
        if SCALE_MODE == codes.PER_TOKEN:  # k = ks (n - K_CENTER) + kz for stored n
            if K_CENTER != 0:
                s = s - K_CENTER * qsum[None, :]
            s = s * ks[:, None]
            if ASYM:
                s += kz[:, None] * qsum[None, :]
            s = s * k_fold
        elif K_CENTER != 0:  # k_off = K_CENTER * sum(q) * k_fold
            s = s * k_fold - k_off[None, :]
        else:
            s = s * k_fold
        return gl.where(((n0 + ts) < end)[:, None], s, float("-inf"))

    @gluon.jit
    def _p_dot_v(p, vw, vs, vz, c_new, c_inv, z_t, acc, KIND: gl.constexpr, SCALE_MODE: gl.constexpr,
                 ASYM: gl.constexpr, VASM: gl.constexpr, CENTER: gl.constexpr, INV: gl.constexpr = False):
        """acc += V^T p^T for a tile's p (per-token V: p s / c, with c_inv = 1 / c where INV, and the zero
        points' sum into z_t)."""
        if SCALE_MODE == codes.PER_TOKEN:
            if ASYM:
                z_t += p * (vz + CENTER * vs)[:, None]
            if INV:
                pw = p * (vs * c_inv)[:, None]
            else:
                pw = p * (vs / c_new)[:, None]
        else:
            pw = p
        pt = gl.convert_layout(pw.to(gl.float16), B_OP)
        return z_t, mma_v2(_v_operand(vw, KIND, VASM), pt, acc)

    @gluon.jit
    def _attend(n0, kw, vw, ks, vs, kz, vz, m_i, l_t, z_t, acc, c_v, end, qt, qsum, k_fold, k_off, ts,
                KIND: gl.constexpr, SCALE_MODE: gl.constexpr, ASYM: gl.constexpr, ASM: gl.constexpr,
                VASM: gl.constexpr, CENTER: gl.constexpr, K_CENTER: gl.constexpr, SKIP_RESCALE: gl.constexpr,
                K_CHAINS: gl.constexpr, V_KIND: gl.constexpr, V_ASYM: gl.constexpr):
        """One 16-token tile into the online softmax state (m_i, l_t, z_t, acc, c_v). KIND, ASYM: K's format;
        V_KIND, V_ASYM: V's (the same but in the K/V-split formats)."""
        s = _scores(n0, kw, ks, kz, end, qt, qsum, k_fold, k_off, ts, KIND, SCALE_MODE, ASYM, ASM, K_CENTER, K_CHAINS)
        return _attend_scored(s, vw, vs, vz, m_i, l_t, z_t, acc, c_v, SCALE_MODE, VASM, CENTER, SKIP_RESCALE, V_KIND,
                              V_ASYM)

    @gluon.jit
    def _attend_scored(s, vw, vs, vz, m_i, l_t, z_t, acc, c_v, SCALE_MODE: gl.constexpr, VASM: gl.constexpr,
                       CENTER: gl.constexpr, SKIP_RESCALE: gl.constexpr, V_KIND: gl.constexpr, V_ASYM: gl.constexpr):
        """A tile's scores s^T [16 tokens, 8 heads] (log2 units) and its V words into the online softmax state."""
        c_new = c_v
        if SCALE_MODE == codes.PER_TOKEN:
            c_new = gl.maximum(c_v, gl.max(vs, 0))
        m_new, p, l_t, z_t, acc = _rescale(s, m_i, c_v, c_new, l_t, z_t, acc, SCALE_MODE, V_ASYM, SKIP_RESCALE)
        l_t += p
        z_t, acc = _p_dot_v(p, vw, vs, vz, c_new, 0.0, z_t, acc, V_KIND, SCALE_MODE, V_ASYM, VASM, CENTER)
        return m_new, l_t, z_t, acc, c_new

    @gluon.jit
    def _attend_pair(n0, kw0, vw0, ks0, vs0, kz0, vz0, kw1, ks1, vs1, kz1, m_i, l_t, z_t, acc, c_v,
                     end, qt, qsum, k_fold, k_off, ts, KIND: gl.constexpr, SCALE_MODE: gl.constexpr,
                     ASYM: gl.constexpr, ASM: gl.constexpr, VASM: gl.constexpr, CENTER: gl.constexpr,
                     K_CENTER: gl.constexpr, SKIP_RESCALE: gl.constexpr, K_CHAINS: gl.constexpr,
                     V_KIND: gl.constexpr, V_ASYM: gl.constexpr):
        """Tiles n0 and n0 + 16 into the state with one max, one rescale test and one V scale bound: the
        softmax bookkeeping (warp reductions, the division by c) is paid once per 32 tokens. Returns the
        state with tile n0's p . V in it, and what tile n0 + 16's (`_p_dot_v`) needs: p and 1 / c (the
        caller loads tile n0 + 16's V words only then, one tile's V held in registers at a time)."""
        s0 = _scores(n0, kw0, ks0, kz0, end, qt, qsum, k_fold, k_off, ts, KIND, SCALE_MODE, ASYM, ASM, K_CENTER,
                     K_CHAINS)
        s1 = _scores(n0 + 16, kw1, ks1, kz1, end, qt, qsum, k_fold, k_off, ts, KIND, SCALE_MODE, ASYM, ASM,
                     K_CENTER, K_CHAINS)
        c_new = c_v
        if SCALE_MODE == codes.PER_TOKEN:
            c_new = gl.maximum(c_v, gl.max(gl.maximum(vs0, vs1), 0))
        # the max of both tiles (the p `_rescale` returns for it is unused)
        m_new, _, l_t, z_t, acc = _rescale(gl.maximum(s0, s1), m_i, c_v, c_new, l_t, z_t, acc, SCALE_MODE, V_ASYM,
                                           SKIP_RESCALE)
        p0 = gl.exp2(s0 - m_new[None, :])
        p1 = gl.exp2(s1 - m_new[None, :])
        # one division a step: p s / c as p (s (1 / c)) (to fp16 next: the extra rounding is below its ulp)
        c_inv = 1.0 / c_new
        l_t += p0 + p1
        z_t, acc = _p_dot_v(p0, vw0, vs0, vz0, c_new, c_inv, z_t, acc, V_KIND, SCALE_MODE, V_ASYM, VASM, CENTER,
                            True)
        return m_new, l_t, z_t, acc, c_new, p1, c_inv
