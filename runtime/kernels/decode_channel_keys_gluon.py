"""Decode attention over per-channel keys (KIVI) on the GPU, in Gluon: the layouts of decode_gluon.py (a program is
one warp; the query heads of a KV head on the mma's N; K and V^T are A operands widened from their words in
registers, with no shared memory) and the position rule of decode_channel_keys.py (the query's own block from its
fp16 residual slot, every earlier block quantized).

A block of 64 keys has one scale s_c and zero z_c per channel, so

    q . k_t = sum_c (q_c s_c) code_tc + q . z

folds the block's scales into q's B operand once a block (4 tiles of 16 keys) and its zeros into one bias a head,
and the codes enter the mma as `word_asm` widens them (subnormals n 2^-24, high nibbles 16 n): q s / 16 on even
channels, / 256 on odd, rounded to fp16 once, as decode_gluon.py rounds q / 16. The K words, q and the scales are
all read in the order where lane (g, t) holds channels [32t, 32t + 32): the scales' loads are 16-byte vectors and
the B operand is a relabelling of q's registers (`_q_operands`). V is int4 per-token asym, through
`gluon_attend._attend_scored` as in decode_gluon.py. On sm_90 the K and V words and V's per-token scales and zeros
come through decode_gluon.py's shared-memory ring of tiles filled by TMA (gluon_tiles.py; V's zeros in the place of
its per-token format's K scales), otherwise in registers a tile ahead. A block's scales load at the block. The own
block's fp16 keys are A operands in the same column order, against q / 16.

Needs head_dim 128, a GQA group of <= 8 heads and fp16 / bf16 q on CUDA outside the interpreter
(`serves`); decode_channel_keys.py's Triton kernel serves the rest.
"""

from __future__ import annotations

import torch

from . import codes
from .gluon_tiles import ring_descriptors
from .group_io import _program_tokens
from .widen_ptx import pair_asm, word_asm

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves per-channel keys
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

HEAD_DIM = 128
MAX_GROUP = 8


def serves(device, q_dtype: torch.dtype, group: int, head_dim: int) -> bool:
    """Whether this kernel can run a per-channel-key launch on `device` (a tuned_file.Device): Gluon on CUDA outside the
    interpreter, fp16 / bf16 q, head_dim 128, <= 8 query heads per KV head."""
    return (gluon is not None and device.cuda and not device.interpret
            and q_dtype in (torch.float16, torch.bfloat16) and head_dim == HEAD_DIM and group <= MAX_GROUP)

if gluon is not None:
    from .decode_gluon import _store_output
    from .gluon_attend import _attend_scored
    from .gluon_operands import K_W4, MMA, ROWS, V_W4, _a_operands, _k_operands, _q_operands
    from .gluon_tiles import _allocate_ring, _await_ring, _copy_tile, _drain_ring, _fill_ring, _page, _ring_metas

    # fp16 residual rows [16 tokens, 128]: lane (g, t) holds channels [32t, 32t + 32) of rows g and g + 8, as the
    # widened K words
    RES_ROWS = gl.constexpr(gl.BlockedLayout([1, 32], [8, 4], [1, 1], [1, 0]))

    @gluon.jit
    def _tile(slot: gl.constexpr, page, K, V, VS, VZ, kvh, stride_pb, stride_ph, stride_pt, stride_mb, stride_mh,
              koffs, voffs, ts):
        """The K and V words and V's per-token scales and zero points of the tile at position `slot` (0, 16, 32 or
        48) of `page`."""
        base = page * stride_pb + kvh * stride_ph + slot * stride_pt
        kw = gl.load(K + base + koffs)
        vw = gl.load(V + base + voffs)
        meta = page * stride_mb + kvh * stride_mh + slot + ts
        return kw, vw, gl.load(VS + meta).to(gl.float32), gl.load(VZ + meta).to(gl.float32)

    @gluon.jit
    def _block_scales(KS, KZ, page, kvh, stride_sb, stride_sh, dc):
        """A block's per-channel scales and zero points [128] (fp16, in q's row layout)."""
        chan = page * stride_sb + kvh * stride_sh + dc
        return gl.load(KS + chan), gl.load(KZ + chan)

    @gluon.jit
    def _block_fold(qn, ks, kz, K_CHAINS: gl.constexpr):
        """q's B operands with the block's scales folded in (fp16 qn s) and the zero points' bias q . z per head
        (fp32, on the scores' head axis). qn: q / 16 on even channels, / 256 on odd (registers alternate)."""
        qs = (qn * ks.to(gl.float32)[None, :]).to(gl.float16)
        even, odd = gl.split(gl.reshape(qn * kz.to(gl.float32)[None, :], [8, 64, 2]))
        bias = gl.sum(even * 16.0 + odd * 256.0, 1)
        return _q_operands(qs, codes.INT4, K_CHAINS), gl.convert_layout(bias, gl.SliceLayout(0, MMA))

    @gluon.jit
    def _mma_scores(a, qt, K_CHAINS: gl.constexpr):
        s = mma_v2(a[0], qt[0], gl.zeros([16, 8], gl.float32, layout=MMA))
        for i in gl.static_range(1, K_CHAINS):
            s += mma_v2(a[i], qt[i], gl.zeros([16, 8], gl.float32, layout=MMA))
        return s

    @gluon.jit
    def _residual_operands(RES, slot, kvh, stride_rs, stride_rh, stride_rt, tr, dres, valid, K_CHAINS: gl.constexpr):
        """A tile of the residual's fp16 keys [16, 128] as the scores' A operands, in `_k_operands`'s column order
        (rows past the sequence's end: 0)."""
        x = gl.load(RES + slot * stride_rs + kvh * stride_rh + tr[:, None] * stride_rt + dres[None, :],
                    mask=valid[:, None], other=0.0)
        return _a_operands(x, codes.INT4, K_CHAINS)

    # ints that change step to step add no compiled variants while serving (runtime/warmup.py)
    @gluon.jit(do_not_specialize=["num_splits", "tokens_per_split", "stride_btb"])
    def _decode_channel_keys_gluon(
        Q, K, V, KS, KZ, VS, VZ, RES, SLOT, BT, SEQ, OUT, PM, PL, PACC, KD, VD, VSD, VZD,
        qk_scale, tokens_per_split, num_splits,
        stride_qb, stride_qh, stride_ob, stride_oh, stride_btb,
        stride_pb, stride_ph, stride_pt, stride_sb, stride_sh, stride_mb, stride_mh, stride_rs, stride_rh, stride_rt,
        NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, ASM: gl.constexpr, VASM: gl.constexpr, SPLIT: gl.constexpr,
        SKIP_RESCALE: gl.constexpr, K_CHAINS: gl.constexpr, STAGES: gl.constexpr, TMA: gl.constexpr,
    ):
        """K, V: the int4 pages as int32 words (strides stride_p* in words); KS, KZ: per-channel scales and zero
        points [pages, kv_heads, 128]; VS, VZ: V's per-token ones; RES: the fp16 residual [slots, kv_heads, 64,
        128] and SLOT the slot of each page's block (-1: none). KD, VD, VSD, VZD: what the ring (STAGES > 0) copies
        from, K, V, VS, VZ or with TMA their descriptors (`gluon_tiles.ring_descriptors`). A split covers whole blocks."""
        b, kvh, sp, start, end = _program_tokens(SEQ, tokens_per_split)
        seq_len = gl.load(SEQ + b)
        own = (seq_len - 1) // 64 * 64  # the query's own block: fp16 keys from the residual
        stop = gl.minimum(end, own)

        hr = gl.arange(0, 8, layout=gl.SliceLayout(1, ROWS))
        dr = gl.arange(0, 128, layout=gl.SliceLayout(0, ROWS))
        hmask_r = hr < GROUP
        q = gl.load(Q + b * stride_qb + (kvh * GROUP + hr)[:, None] * stride_qh + dr[None, :],
                    mask=hmask_r[:, None], other=0.0).to(gl.float32)
        # q s / 16 keeps fp16 in range; odd channels (high nibbles, 16 n) / 256
        nibble = gl.where(dr % 2 == 1, 16.0, 1.0)
        qn = q * (0.0625 / nibble)[None, :]
        k_fold = qk_scale * 268435456.0  # the dots' unit: 2^-4 (prescale) x 2^-24 (the codes' subnormals)

        tk = gl.arange(0, 16, layout=gl.SliceLayout(1, K_W4))
        tv = gl.arange(0, 16, layout=gl.SliceLayout(1, V_W4))
        ts = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
        koffs = tk[:, None] * stride_pt + gl.arange(0, 16, layout=gl.SliceLayout(0, K_W4))[None, :]
        voffs = tv[:, None] * stride_pt + gl.arange(0, 16, layout=gl.SliceLayout(0, V_W4))[None, :]
        bt_row = BT + b * stride_btb

        m_i = gl.full([8], -1e30, gl.float32, layout=gl.SliceLayout(0, MMA))  # finite: no NaN from -inf - -inf
        l_t = gl.zeros([16, 8], gl.float32, layout=MMA)  # row sums of p, reduced at the end
        z_t = gl.zeros([16, 8], gl.float32, layout=MMA)  # sum_n p_n z_n of V's zero points
        acc = gl.zeros([128, 8], gl.float32, layout=MMA)
        c_v = qk_scale * 0.0 + 1e-30  # the largest V scale so far (acc holds sum p s / c_v)
        state = (m_i, l_t, z_t, acc, c_v)
        tile_args = (K, V, VS, VZ, kvh, stride_pb, stride_ph, stride_pt, stride_mb, stride_mh, koffs, voffs, ts)

        # complete blocks: quantized keys. The next block's page and the next tiles' words load while this tile
        # computes; the block's scales at the block (loaded a block ahead they spill in the loop)
        page = _page(bt_row, start, stop, 64, False)
        if STAGES > 0:
            # the words and V's per-token scales through decode_gluon.py's ring of tiles in shared memory (TMA on
            # sm_90, else cp.async), its per-token format without zero points: V's zero points take the place of
            # its K scales
            k_ring, v_ring, metas = _allocate_ring(KD, VD, VZD, VSD, VZD, VSD, stride_mb, stride_mh, STAGES,
                                                   codes.PER_TOKEN, False, TMA)
            ahead, page_ahead = _fill_ring(start, stop, bt_row, KD, VD, k_ring, v_ring, kvh, stride_pb, stride_ph,
                                           stride_pt, koffs, metas, STAGES - 1, 64, codes.PER_TOKEN, False,
                                           False, TMA)
            stage = 0
        else:
            nxt = _tile(0, page, *tile_args)
        for n0 in range(start, stop, 64):
            ks, kz = _block_scales(KS, KZ, page, kvh, stride_sb, stride_sh, dr)
            qt, bias = _block_fold(qn, ks, kz, K_CHAINS)
            page_next = _page(bt_row, n0 + 64, stop, 64, False)
            bias = bias * qk_scale
            if STAGES > 0:
                for t in gl.static_range(4):
                    # the tile has landed and the stage written next is free; its copy goes out STAGES - 1 ahead
                    _await_ring(metas, n0 + 16 * t, start, STAGES - 2, STAGES, False, TMA)
                    _copy_tile(ahead, page_ahead, KD, VD, k_ring, v_ring, (stage + STAGES - 1) % STAGES, kvh,
                               stride_pb, stride_ph, stride_pt, koffs, metas, 64, codes.PER_TOKEN, False, TMA)
                    ahead += 16
                    page_ahead = _page(bt_row, ahead, stop, 64, False)
                    kw = k_ring.index(stage).load(K_W4)
                    vw = v_ring.index(stage).load(V_W4)
                    vz, vs, _, _ = _ring_metas(n0 + 16 * t, stop, metas, stage, ts, codes.PER_TOKEN, False, TMA)
                    stage = (stage + 1) % STAGES
                    s = _mma_scores(_k_operands(kw, codes.INT4, ASM, K_CHAINS), qt, K_CHAINS) * k_fold + bias[None, :]
                    state = _attend_scored(s, vw, vs, vz, *state, codes.PER_TOKEN, VASM, 8.0, SKIP_RESCALE,
                                           codes.INT4, True)
            else:
                for t in gl.static_range(4):
                    kw, vw, vs, vz = nxt
                    if t < 3:
                        nxt = _tile(16 * (t + 1), page, *tile_args)
                    else:
                        nxt = _tile(0, page_next, *tile_args)
                    s = _mma_scores(_k_operands(kw, codes.INT4, ASM, K_CHAINS), qt, K_CHAINS) * k_fold + bias[None, :]
                    state = _attend_scored(s, vw, vs, vz, *state, codes.PER_TOKEN, VASM, 8.0, SKIP_RESCALE,
                                           codes.INT4, True)
            page = page_next
        if STAGES > 0:
            _drain_ring(metas, start, stop, STAGES - 1, STAGES, False, TMA)

        if (start <= own) & (own < end):  # this split holds the own block: its keys from the residual
            page = gl.load(bt_row + own // 64).to(gl.int64)
            slot = gl.maximum(gl.load(SLOT + page), 0).to(gl.int64)  # -1: a CUDA graph's padding row (output dropped)
            qr = _q_operands((qn * nibble[None, :]).to(gl.float16), codes.INT4, K_CHAINS)  # q / 16 (exact)
            tr = gl.arange(0, 16, layout=gl.SliceLayout(1, RES_ROWS))
            dres = gl.arange(0, 128, layout=gl.SliceLayout(0, RES_ROWS))
            for t in gl.static_range(4):
                a = _residual_operands(RES, slot, kvh, stride_rs, stride_rh, stride_rt, 16 * t + tr, dres,
                                       own + 16 * t + tr < seq_len, K_CHAINS)
                kw, vw, vs, vz = _tile(16 * t, page, *tile_args)
                valid = own + 16 * t + ts < seq_len
                s = gl.where(valid[:, None], _mma_scores(a, qr, K_CHAINS) * (qk_scale * 16.0), float("-inf"))
                state = _attend_scored(s, vw, gl.where(valid, vs, 0.0), vz, *state, codes.PER_TOKEN, VASM, 8.0,
                                       SKIP_RESCALE, codes.INT4, True)
        m_i, l_t, z_t, acc, c_v = state
        _store_output(acc * c_v + gl.sum(z_t, 0)[None, :], gl.sum(l_t, 0), m_i, OUT, PM, PL, PACC, b, sp, kvh, hr,
                      dr, hmask_r, num_splits, stride_ob, stride_oh, NUM_HEADS, GROUP, SPLIT)


def launch(q, cache, block_tables, seq_lens, qk_scale: float, out, splits: tuple, split: bool, plan) -> None:
    """The kernel into `out` (or the split partials); splits: `split_k.split_plan`'s (tokens per split, splits,
    partial buffers); split: whether the launch writes partials (`split_k.splits_write_partials`); plan: its
    k_chains, skip_rescale, register cap and ring (stages, tma)."""
    batch, num_heads, _ = q.shape
    _, kv_heads, _, _ = cache.k.shape
    tokens_per_split, num_splits, (pm, pl, pacc) = splits
    kw, vw = cache.k.view(torch.int32), cache.v.view(torch.int32)
    res = cache.k_residual
    ring = (kw, vw, cache.v_scale, cache.v_zero)
    if plan.stages and plan.tma:
        kd, vd, vzd, vsd = ring_descriptors(kw, vw, (cache.v_zero, cache.v_scale))
        ring = (kd, vd, vsd, vzd)
    _decode_channel_keys_gluon[(batch, kv_heads, num_splits)](
        q, kw, vw, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero, res, cache.residual.slot_of,
        block_tables, seq_lens, out, pm, pl, pacc, *ring,
        qk_scale, tokens_per_split, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kw.stride(0), kw.stride(1), kw.stride(2), cache.k_scale.stride(0), cache.k_scale.stride(1),
        cache.v_scale.stride(0), cache.v_scale.stride(1), res.stride(0), res.stride(1), res.stride(2),
        NUM_HEADS=num_heads, GROUP=num_heads // kv_heads, ASM=word_asm(codes.INT4, codes.FP8_NONE, False),
        VASM=pair_asm(codes.INT4, codes.FP8_NONE, False), SPLIT=split, SKIP_RESCALE=plan.skip_rescale,
        K_CHAINS=plan.k_chains, STAGES=plan.stages, TMA=plan.tma, num_warps=1,
        **({"maxnreg": plan.registers} if plan.registers else {}),
    )

