"""The quantized formats' decode kernel on the GPU (`plan.DecodePlan`), written in Gluon (Triton's explicit-layout
dialect).

The Triton kernels (`decode_warps.py`, `decode_tiles.py`) leave register layouts to the
compiler, which stages 8-bit V through shared memory and reads it back one byte per
instruction (V's token axis is the p . V product's reduction axis, but the page rows are
contiguous along head_dim), pads the 4 heads of a GQA group to mma's 16 rows, and widens
int8/int4 in ~600 instructions per 16-token tile (docs/kernels.md). Here a program is one warp
over 16-token tiles, with every layout written out:

* Heads on the mma N dimension (8 columns, a group of <= 8 heads): s^T = K q^T and
  o^T = V^T p^T, so K and V^T are the A operands (m16n8k16, fp16) and the accumulator is
  128 x 8 fp32 (32 registers), not 16 x 128.
* No shared memory for K or V. A dot product does not care in which order it visits
  head_dim, so the kernel picks the order in which each lane's A-operand elements are
  contiguous in the page: lane (g, t) holds bytes [32t, 32t + 32) of K rows g and g + 8
  (two 16-byte loads each) and bytes [16g, 16g + 16) of V rows 2t, 2t + 1, 2t + 8, 2t + 9.
  q is loaded once in the same head_dim order (`_q_operands`), and the output is written back
  in page order (`_out_rows`). In Gluon these orders are reshapes and permutes of register
  layouts (`gluon_operands.py`: `_k_operands`, `_v_operand`): the final conversion to the mma
  operand layout is checked to move no data (`assert_trivial`).
* Pages are loaded as 32-bit words (carried to the next iteration as words: a loop-carried
  byte tensor costs a byte permute per value) and widened to fp16 in PTX. K (`word_asm`): fp8
  by the hardware's paired conversion; int8/int4 by one LOP3 per register pair whose result,
  an fp16 subnormal n * 2^-24, is the value (the 2^24 and the centre go into the softmax
  scale and a sum(q) term). V (`pair_asm`): one byte permute interleaves two tokens' words so
  that each register holds the token pair the p . V operand wants, then fp8 converts and
  int8/int4 go under fp16's 1024 exponent and one packed add (a high nibble: one fma)
  recentres them (FasterTransformer's trick), exact.
* The next tile's words are loaded before this tile is used (one tile in flight while one is
  computed). Integer pages load unmasked: past a sequence's end the words are still inside a
  page and widen to finite values. ptxas copies the loop-carried words into place at the end of
  each step, and that copy waits for the load (Nsight Compute: a third of int4's stall samples on
  one move), so int4 with long splits takes a ring in shared memory instead (`STAGES`,
  `tuning.gluon_stages_for`; the tile I/O is `gluon_tiles.py`): the next stages fill (words, and
  per-token scales and zero points) while this one computes, and the page index is loaded one
  step earlier; tiles go two a step (`_attend_pair`, `PAIRS`). On sm_90 the TMA unit fills the ring
  (`TMA`, `ring_descriptors`: one copy a tensor and tile, completion on a stage's mbarrier), which
  takes the copies' address arithmetic and LSU traffic off the warp; before, cp.async from every lane. Page offsets are int32 where the cache allows
  (`OFF32`), and a 16-token page needs no slot arithmetic.
* A tile's attention is `gluon_attend.py`: its scores (one chain of 8 mma, or `K_CHAINS` 2
  independent chains over blocks of k, `DecodePlan.k_chains`), the online softmax per column
  (head) with per-token scales on the scores and on p, and p . V.

Numerics: the dots run in fp16 on exact operands (fp8, int8 and int4 values are exact in
fp16, K's integers as subnormals; q / 16 (int4's odd columns q / 256) and p are rounded to fp16,
as in the Triton kernels' `dot_fp16` path), with fp32 accumulation. Needs head_dim 128, a GQA group of <= 8 heads, pages of a multiple of 16 tokens
and fp16/bf16 q; `supported` says when, and the launcher falls back to the Triton kernels
otherwise (and always under the interpreter, which cannot run Gluon).
"""

from __future__ import annotations

import torch

from . import codes
from .formats import KernelFormat
from .group_io import _program_tokens, _static_folds
from .widen_ptx import pair_asm, pair_scaled_asm, word_asm, word_scaled_asm

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernels serve every format
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

HEAD_DIM = 128
MAX_GROUP = 8  # query heads per KV head: the mma's N
TILE = 16  # tokens per iteration: the mma's M (scores) and K (p . V)
# Split-K: up to 256 splits of >= 256 tokens (one-warp programs need ~2000 to fill an H200:
# at 70B TP8, 64 x 8192, 32 splits took 0.051 ms for fp8 against 0.056 at 16 splits of 512; with
# one sequence, 512 splits took 0.054 ms against 0.042 at 256: the merge grows with the splits).
MAX_SPLITS = 256
MIN_TOKENS_PER_SPLIT = 256


def serves(kf: KernelFormat, block_size: int, group: int) -> bool:
    """Whether the kernel is written for this format and shape (head_dim 128, <= 8 query heads per KV
    head, pages of 16k tokens, a quantized format)."""
    return (gluon is not None and kf.head_dim == HEAD_DIM and group <= MAX_GROUP and block_size % TILE == 0
            and kf.scale_mode != codes.NO_SCALE)


def supported(kf: KernelFormat, q: torch.Tensor, block_size: int, group: int) -> bool:
    """Whether this kernel serves the launch (else the Triton kernels do): `serves`, on CUDA outside
    the interpreter, with fp16/bf16 q."""
    from triton import knobs

    return (serves(kf, block_size, group) and q.is_cuda and not knobs.runtime.interpret
            and q.dtype in (torch.float16, torch.bfloat16))


# group scales the kernel serves (`gluon_groups.py`: K and V dequantized as they are widened, a lane's words in one
# group): 2 for int4 / int8, 4 for int4
GROUPS_SERVED = (2, 4)


def _groups_served(kf: KernelFormat) -> bool:
    """An integer side whose group scales the dequantizing tiles load (`gluon_groups._scale_layout`)."""
    return kf.kind != codes.FLOAT and kf.groups in GROUPS_SERVED and (kf.groups == 2 or kf.kind == codes.INT4)


def serves_mixed(kf_k: KernelFormat, kf_v: KernelFormat, block_size: int, group: int) -> bool:
    """Whether the kernel is written for a format of `formats.served_by_mixed`: each side `serves`, per-token scales
    in fp16 / bf16 / fp32 (not e8m0); K and V of their own dtype and symmetry with a scale a token-head (`V_KIND`),
    integer K and V of one format with GROUPS_SERVED group scales (`GROUPS`), or int8 K of a scale a token-head with
    integer V of GROUPS_SERVED group scales (K8V4 with V groups: `V_GROUPS`)."""
    if not all(serves(kf, block_size, group) and kf.scale_mode == codes.PER_TOKEN
               and kf.scale_dtype != codes.SCALE_E8M0 for kf in (kf_k, kf_v)):
        return False
    if kf_k.groups == 1 and kf_v.groups == 1:
        return True
    if kf_k == kf_v:
        return _groups_served(kf_k)
    return kf_k.kind == codes.INT8 and kf_k.groups == 1 and _groups_served(kf_v)


def dequantized(kf_k: KernelFormat, kf_v: KernelFormat) -> bool:
    """Whether K and V are dequantized as they are widened (`gluon_groups.py`): wherever a side has group scales."""
    return kf_k.groups > 1 or kf_v.groups > 1


def widening(kf: KernelFormat, kf_v: KernelFormat | None = None) -> dict[str, str]:
    """The kernel's PTX constants for this format: K's word widening and V's token-pair widening (V's format: kf_v
    where K and V differ); each side dequantizes as it widens where a side has group scales (`dequantized`)."""
    kf_v = kf if kf_v is None else kf_v
    if dequantized(kf, kf_v):
        return dict(ASM=word_scaled_asm(kf.kind, not kf.asym), VASM=pair_scaled_asm(kf_v.kind, not kf_v.asym))
    return dict(ASM=word_asm(kf.kind, kf.fp8, not kf.asym), VASM=pair_asm(kf_v.kind, kf_v.fp8, not kf_v.asym))


if gluon is not None:
    from .gluon_attend import _attend, _attend_pair, _p_dot_v
    from .gluon_groups import _group_attend, _group_ring_tile, _group_tile
    from .gluon_operands import K_W4, K_W8, MMA, ROWS, V_W4, V_W8, _out_rows, _q_operands
    from .gluon_tiles import (
        _allocate_ring,
        _await_ring,
        _copy_tile,
        _drain_ring,
        _fill_ring,
        _page,
        _ring_metas,
        _tile_words,
    )

    # ints that change step to step add no compiled variants while serving (runtime/warmup.py)
    @gluon.jit(do_not_specialize=["num_splits", "stride_btb"])
    def _decode_kernel_gluon(
        Q, K, V, KS, VS, KZ, VZ, BT, SEQ, OUT, PM, PL, PACC,
        qk_scale, tokens_per_split, num_splits,
        stride_qb, stride_qh, stride_ob, stride_oh, stride_btb,
        stride_cb, stride_ch, stride_ct, stride_mb, stride_mh, stride_vcb, stride_vch, stride_vct,
        NUM_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr, GROUP: gl.constexpr,
        KIND: gl.constexpr, SCALE_MODE: gl.constexpr, ASYM: gl.constexpr, ASM: gl.constexpr, VASM: gl.constexpr, SPLIT: gl.constexpr,
        SKIP_RESCALE: gl.constexpr, STAGES: gl.constexpr = 0,
        OFF32: gl.constexpr = False, PAIRS: gl.constexpr = False, K_CHAINS: gl.constexpr = 1,
        TMA: gl.constexpr = False, V_KIND: gl.constexpr = -1, V_ASYM: gl.constexpr = False,
        GROUPS: gl.constexpr = 1, DEQUANT: gl.constexpr = False, V_GROUPS: gl.constexpr = 1,
    ):
        """K, V: the pages as int32 words, strides in words (TMA: tensor descriptors of their 16-word rows, and KS, VS,
        KZ, VZ of the per-token scales' rows of 16). KIND, ASYM, stride_c*: K's format and pages, and V's too unless
        V_KIND >= 0: then V is stored as V_KIND / V_ASYM with its pages' strides stride_vc* (the K/V-split formats,
        per-token scales of one dtype, loaded from registers: STAGES 0). GROUPS > 1: that many scales (and zero
        points) per token-head. DEQUANT (a side with group scales, `dequantized`): integer K and V dequantized as they
        widen (`gluon_groups.py`), V of V_GROUPS scales a token-head; int4 of one format through the TMA ring
        (STAGES, TMA; not PAIRS), the others from registers."""
        b, kvh, sp, start, end = _program_tokens(SEQ, tokens_per_split)
        if V_KIND < 0:  # one format for K and V
            VK: gl.constexpr = KIND
            VA: gl.constexpr = ASYM
            v_strides = (stride_cb, stride_ch, stride_ct)
        else:
            VK: gl.constexpr = V_KIND
            VA: gl.constexpr = V_ASYM
            v_strides = (stride_vcb, stride_vch, stride_vct)

        # q rows of the group, / 16 (exact) so fp16 holds q up to 16 x 65504; int4's odd columns
        # (high nibbles, widened to 16 n: `word_asm`) / 256
        hr = gl.arange(0, 8, layout=gl.SliceLayout(1, ROWS))
        dr = gl.arange(0, 128, layout=gl.SliceLayout(0, ROWS))
        hmask_r = hr < GROUP
        q = gl.load(Q + b * stride_qb + (kvh * GROUP + hr)[:, None] * stride_qh + dr[None, :],
                    mask=hmask_r[:, None], other=0.0)
        # K's values as the dots see them: dequantized (group scales, float formats) or the stored integers
        K_VALUES: gl.constexpr = KIND == codes.FLOAT or DEQUANT
        nibble = gl.full([1, 128], 1.0, gl.float32, layout=ROWS)
        if KIND == codes.INT4 and not K_VALUES:
            nibble = gl.where(dr[None, :] % 2 == 1, 16.0, 1.0)
        q16 = (q.to(gl.float32) * (0.0625 / nibble)).to(gl.float16)
        qt = _q_operands(q16, KIND, K_CHAINS)
        # the dots' unit: q / 16, and for stored int8 / int4 K the subnormal 2^-24 (`word_asm`)
        k_fold, v_fold = _static_folds(KS, VS, kvh, qk_scale, 0.0625 if K_VALUES else 0.0625 / 16777216.0,
                                       SCALE_MODE)
        qsum = 0.0  # sum(q) of the rounded q the dots see, in the dots' unit: centres and zero points
        if not K_VALUES:
            qsum = gl.convert_layout(gl.sum(q16.to(gl.float32) * (nibble / 16777216.0), 1), gl.SliceLayout(0, MMA))

        # centres of the stored integers: K's (`word_asm` does not centre; K_MID: the dequantizing widening's) and
        # V's (`pair_asm` widens centred)
        if KIND == codes.INT4:
            K_CENTER: gl.constexpr = 0.0 if ASYM else 8.0
            K_MID: gl.constexpr = 8.0
            KL: gl.constexpr = K_W4
            K_WORDS: gl.constexpr = 16
        else:
            K_CENTER: gl.constexpr = 0.0 if ASYM or KIND == codes.FLOAT else 128.0
            K_MID: gl.constexpr = 128.0
            KL: gl.constexpr = K_W8
            K_WORDS: gl.constexpr = 32
        if VK == codes.INT4:
            CENTER: gl.constexpr = 8.0
            VL: gl.constexpr = V_W4
            V_WORDS: gl.constexpr = 16
        else:
            CENTER: gl.constexpr = 128.0
            VL: gl.constexpr = V_W8
            V_WORDS: gl.constexpr = 32
        tk = gl.arange(0, 16, layout=gl.SliceLayout(1, KL))
        tv = gl.arange(0, 16, layout=gl.SliceLayout(1, VL))
        ts = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
        koffs = tk[:, None] * stride_ct + gl.arange(0, K_WORDS, layout=gl.SliceLayout(0, KL))[None, :]
        voffs = tv[:, None] * v_strides[2] + gl.arange(0, V_WORDS, layout=gl.SliceLayout(0, VL))[None, :]
        bt_row = BT + b * stride_btb

        m_i = gl.full([8], -1e30, gl.float32, layout=gl.SliceLayout(0, MMA))  # finite: no NaN from -inf - -inf
        l_t = gl.zeros([16, 8], gl.float32, layout=MMA)  # row sums of p, reduced at the end
        z_t = gl.zeros([16, 8], gl.float32, layout=MMA)  # sum_n p_n z_n (asymmetric per-token V)
        acc = gl.zeros([128, 8], gl.float32, layout=MMA)
        c_v = qk_scale * 0.0 + 1e-30  # per-token V: the largest V scale so far (acc holds sum p s / c_v)

        words = (K, V, KS, VS, KZ, VZ, bt_row, end, kvh, stride_cb, stride_ch, stride_ct, v_strides, stride_mb,
                 stride_mh, koffs, voffs, tk, tv, ts)
        state = (m_i, l_t, z_t, acc, c_v)
        consts = (end, qt, qsum, k_fold, K_CENTER * qsum * k_fold, ts)
        if DEQUANT and STAGES == 0:
            gwords = (K, V, KS, VS, KZ, VZ, bt_row, end, kvh, stride_cb, stride_ch, stride_ct, v_strides, stride_mb,
                      stride_mh, koffs, voffs)
            # each side its own kind, symmetry, groups and centre (constexprs: passed one by one, not in a tuple)
            nxt = _group_tile(start, *gwords, KL, VL, BLOCK_SIZE, OFF32, KIND, ASYM, GROUPS, K_MID, VK, VA, V_GROUPS,
                              CENTER)
            for n0 in range(start, end, 16):
                cur = nxt
                nxt = _group_tile(n0 + 16, *gwords, KL, VL, BLOCK_SIZE, OFF32, KIND, ASYM, GROUPS, K_MID, VK, VA,
                                  V_GROUPS, CENTER)
                m_i, l_t, acc = _group_attend(n0, *cur, m_i, l_t, acc, end, qt, k_fold, ts, KIND, ASM, VASM, K_CHAINS,
                                              SKIP_RESCALE, VK)
            state = (m_i, l_t, z_t, acc, c_v)
        elif STAGES > 0:
            # int4: a ring of STAGES tiles in shared memory (words, per-token scales and zero points), filled
            # by cp.async STAGES - 1 tiles ahead (bytes in flight that hold no registers); each tile's page
            # is loaded one step earlier.
            k_ring, v_ring, metas = _allocate_ring(K, V, KS, VS, KZ, VZ, stride_mb, stride_mh, STAGES, SCALE_MODE,
                                                   ASYM, TMA)
            # PAIRS: two tiles a step (`_attend_pair`), the ring STAGES - 2 tiles ahead
            ahead, page = _fill_ring(start, end, bt_row, K, V, k_ring, v_ring, kvh, stride_cb, stride_ch, stride_ct,
                                     koffs, metas, STAGES - 1 - PAIRS, BLOCK_SIZE, SCALE_MODE, ASYM, OFF32, TMA, GROUPS)
            stage = 0
            if PAIRS:
                page1 = _page(bt_row, ahead + 16, end, BLOCK_SIZE, OFF32)
                for n0 in range(start, end, 32):
                    # tiles n0 and n0 + 16 have landed, and the stages written next are free
                    _await_ring(metas, n0, start, STAGES - 4, STAGES, True, TMA)
                    _copy_tile(ahead, page, K, V, k_ring, v_ring, (stage + STAGES - 2) % STAGES, kvh, stride_cb,
                               stride_ch, stride_ct, koffs, metas, BLOCK_SIZE, SCALE_MODE, ASYM, TMA)
                    _copy_tile(ahead + 16, page1, K, V, k_ring, v_ring, (stage + STAGES - 1) % STAGES, kvh,
                               stride_cb, stride_ch, stride_ct, koffs, metas, BLOCK_SIZE, SCALE_MODE, ASYM, TMA)
                    ahead += 32
                    page = _page(bt_row, ahead, end, BLOCK_SIZE, OFF32)
                    page1 = _page(bt_row, ahead + 16, end, BLOCK_SIZE, OFF32)
                    stage1 = (stage + 1) % STAGES
                    kw0 = k_ring.index(stage).load(KL)
                    vw0 = v_ring.index(stage).load(VL)
                    ks0, vs0, kz0, vz0 = _ring_metas(n0, end, metas, stage, ts, SCALE_MODE, ASYM, TMA)
                    kw1 = k_ring.index(stage1).load(KL)
                    ks1, vs1, kz1, vz1 = _ring_metas(n0 + 16, end, metas, stage1, ts, SCALE_MODE, ASYM, TMA)
                    m_i, l_t, z_t, acc, c_v, p1, c_inv = _attend_pair(
                        n0, kw0, vw0, ks0, vs0, kz0, vz0, kw1, ks1, vs1, kz1, *state, *consts, KIND, SCALE_MODE, ASYM, ASM,
                        VASM, CENTER, K_CENTER, SKIP_RESCALE, K_CHAINS, VK, VA)
                    vw1 = v_ring.index(stage1).load(VL)
                    z_t, acc = _p_dot_v(p1, vw1, vs1, vz1, c_v, c_inv, z_t, acc, VK, SCALE_MODE, VA, VASM, CENTER,
                                        True)
                    state = (m_i, l_t, z_t, acc, c_v)
                    stage = (stage + 2) % STAGES
            else:
                for n0 in range(start, end, 16):
                    # tile n0 has landed (for every lane), and the stage written next (read by the previous step)
                    # is free
                    _await_ring(metas, n0, start, STAGES - 2, STAGES, False, TMA)
                    _copy_tile(ahead, page, K, V, k_ring, v_ring, (stage + STAGES - 1) % STAGES, kvh, stride_cb,
                               stride_ch, stride_ct, koffs, metas, BLOCK_SIZE, SCALE_MODE, ASYM, TMA, GROUPS)
                    ahead += 16
                    page = _page(bt_row, ahead, end, BLOCK_SIZE, OFF32)  # after its last use: no register move
                    if DEQUANT:  # int4 group scales through the TMA ring (`gluon_groups.py`)
                        cur = _group_ring_tile(n0, end, k_ring, v_ring, metas, stage, KL, VL, ASYM, GROUPS, CENTER)
                        stage = (stage + 1) % STAGES
                        m_i, l_t, z_t, acc, c_v = state
                        m_i, l_t, acc = _group_attend(n0, *cur, m_i, l_t, acc, end, qt, k_fold, ts, KIND, ASM, VASM,
                                                      K_CHAINS, SKIP_RESCALE, KIND)
                        state = (m_i, l_t, z_t, acc, c_v)
                    else:
                        kw = k_ring.index(stage).load(KL)
                        vw = v_ring.index(stage).load(VL)
                        ks, vs, kz, vz = _ring_metas(n0, end, metas, stage, ts, SCALE_MODE, ASYM, TMA)
                        stage = (stage + 1) % STAGES
                        state = _attend(n0, kw, vw, ks, vs, kz, vz, *state, *consts, KIND, SCALE_MODE, ASYM, ASM,
                                        VASM, CENTER, K_CENTER, SKIP_RESCALE, K_CHAINS, VK, VA)
            _drain_ring(metas, start, end, STAGES - 1 - PAIRS, STAGES, PAIRS, TMA)
        else:
            # the next tile's words load while this one computes
            nxt = _tile_words(start, *words, BLOCK_SIZE, SCALE_MODE, ASYM, KIND, OFF32, VK, VA)
            for n0 in range(start, end, 16):
                cur = nxt
                nxt = _tile_words(n0 + 16, *words, BLOCK_SIZE, SCALE_MODE, ASYM, KIND, OFF32, VK, VA)
                state = _attend(n0, *cur, *state, *consts, KIND, SCALE_MODE, ASYM, ASM, VASM, CENTER, K_CENTER,
                                SKIP_RESCALE, K_CHAINS, VK, VA)
        m_i, l_t, z_t, acc, c_v = state

        l_i = gl.sum(l_t, 0)
        if DEQUANT:  # the dequantized values' own sum
            o = acc
        elif SCALE_MODE == codes.PER_TOKEN:
            o = acc * c_v
            if VA:
                o += gl.sum(z_t, 0)[None, :]
        else:
            o = acc * v_fold
        _store_output(o, l_i, m_i, OUT, PM, PL, PACC, b, sp, kvh, hr, dr, hmask_r, num_splits, stride_ob, stride_oh,
                      NUM_HEADS, GROUP, SPLIT)

    @gluon.jit
    def _store_output(o, l_i, m_i, OUT, PM, PL, PACC, b, sp, kvh, hr, dr, hmask_r, num_splits, stride_ob, stride_oh,
                      NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, SPLIT: gl.constexpr):
        """Unnormalized o^T [128, 8], the row sums l and the running max m of a program: with SPLIT the partial for
        the merge (o as is into fp32 PACC, else o / l, 0 for an empty split: `split_k.partial_dtype`), else o / l
        in OUT's dtype. hr, dr: the aranges of the ROWS layout."""
        o = _out_rows(o)
        l_r = gl.convert_layout(l_i, gl.SliceLayout(1, ROWS))
        heads = kvh * GROUP + hr
        if SPLIT:
            prow = (b * NUM_HEADS + heads) * num_splits + sp
            m_r = gl.convert_layout(m_i, gl.SliceLayout(1, ROWS))
            # an empty split (past the sequence's end) reports m = -inf: the merge gives it weight 0
            gl.store(PM + prow, gl.where(l_r > 0, m_r, float("-inf")), mask=hmask_r)
            gl.store(PL + prow, l_r, mask=hmask_r)
            if PACC.dtype.element_ty != gl.float32:  # the split's own output (0 where empty): `split_k.partial_dtype`
                o = o * gl.where(l_r > 0, 1.0 / l_r, 0.0)[:, None]
            gl.store(PACC + prow[:, None] * 128 + dr[None, :], o.to(PACC.dtype.element_ty), mask=hmask_r[:, None])
        else:
            o = o / l_r[:, None]
            gl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + dr[None, :], o.to(OUT.dtype.element_ty),
                     mask=hmask_r[:, None])
