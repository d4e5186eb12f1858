"""Tile I/O of the Gluon decode kernel (`decode_gluon.py`): a 16-token tile's page, its K / V words and
per-token scales / zero points, loaded into registers a step ahead or copied into a shared-memory ring
(int4) by the TMA unit (sm_90: `TMA`, a stage's mbarrier) or cp.async, in the register layouts of
`gluon_operands`.
"""

from __future__ import annotations

import torch

from . import codes

try:  # Gluon ships with Triton >= 3.5 (decode_gluon.py falls back without it)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

# The TMA ring's shared layouts: K unswizzled (a lane reads 16 bytes of rows g and g + 8: conflict-free); V 64-byte
# swizzled (its reads of rows 2t, 2t + 1 would fall 4 to a bank unswizzled, 2 with it: TMA's swizzles move 16-byte
# chunks by row bits 1-2, where `gluon_tiles.RING_V` moves them by bits 1-2 onto bits 5-6).
TMA_SWIZZLE_K = 0
TMA_SWIZZLE_V = 64


def ring_descriptors(kw: torch.Tensor, vw: torch.Tensor, scales: tuple = (), groups: int = 1) -> tuple:
    """TMA descriptors of the int4 pages' rows (16 words: a token's 128 values of one KV head), a 16-token tile a
    copy, and of `scales` (per-token scales / zero points [blocks, kv_heads, block_size], or [..., groups] for group
    scales) in rows of a tile's 16 tokens, a row a copy. Needs rows stored whole and in order (a cache made by
    `runtime`, int4, head_dim 128)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tensors = (kw, vw, *scales)
    row = 16 * groups
    if kw.shape[-1] != 16 or not all(t.is_contiguous() and t.numel() % row == 0 for t in tensors) \
            or kw.numel() // 16 >= 2**31:
        raise ValueError(f"the TMA ring needs contiguous int4 pages of 16-word rows (< 2^31 of them) and contiguous "
                         f"per-token scales; got pages {tuple(kw.shape)}: use a DecodePlan with tma=False")

    def rows(t: torch.Tensor, width: int, box: list[int], swizzle: int):
        bits = t.element_size() * 8
        return TensorDescriptor.from_tensor(t.view(-1, width), box, gl.NVMMASharedLayout(
            swizzle_byte_width=swizzle, element_bitwidth=bits, rank=2))

    return (rows(kw, 16, [16, 16], TMA_SWIZZLE_K), rows(vw, 16, [16, 16], TMA_SWIZZLE_V),
            *(rows(t, row, [1, row], 0) for t in scales))


if gluon is not None:
    from .gluon_operands import MMA

    # Shared-memory rings of int4 tiles [stages, 16 tokens, 16 words] (`_copy_tile`). K rows are
    # plain (a lane reads 4 words of rows g, g + 8: conflict-free). V is read as V_W4 (2 words of
    # rows 2t, 2t + 1, 2t + 8, 2t + 9): row-major, rows 0, 2, 4, 6 would share banks, so the
    # offset's bits 3-4 take row bits 1-2 and the word's bit 3 moves up (16-byte chunks stay whole).
    RING_K = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    RING_V = gl.constexpr(gl.SharedLinearLayout([[0, 1], [0, 2], [0, 4], [2, 0], [4, 0], [0, 8], [1, 0], [8, 0]]))
    # Per-token scales / zero points of the ring's tiles [stages, 16 tokens], copied 2 a lane (4-8 bytes)
    RING_META = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
    META_COPY = gl.constexpr(gl.BlockedLayout([2], [32], [1], [0]))

    @gluon.jit
    def _tile_words(n0, K, V, KS, VS, KZ, VZ, bt_row, end, kvh, stride_cb, stride_ch, stride_ct, v_strides,
                    stride_mb, stride_mh, koffs, voffs, tk, tv, ts, BLOCK_SIZE: gl.constexpr,
                    SCALE_MODE: gl.constexpr, ASYM: gl.constexpr, KIND: gl.constexpr, OFF32: gl.constexpr,
                    V_KIND: gl.constexpr, V_ASYM: gl.constexpr):
        """A tile's K/V words and per-token scales / zero points (scales 0 past `end`). KIND, ASYM, the strides: K's
        pages; V_KIND, V_ASYM, v_strides (block, head, token): V's (K's but in the K/V-split formats)."""
        page = _page(bt_row, n0, end, BLOCK_SIZE, OFF32)
        base, slot = _tile_base(n0, page, kvh, stride_cb, stride_ch, stride_ct, BLOCK_SIZE)
        vbase, _ = _tile_base(n0, page, kvh, v_strides[0], v_strides[1], v_strides[2], BLOCK_SIZE)
        # Every integer page's address is inside a page (past `end`, page 0 of the cache), and the values there
        # widen to finite numbers whose scores are masked and whose p is 0: no load masks.
        # (A stale fp8 byte can be NaN, and NaN * 0 is NaN: fp8 pages load masked.)
        if KIND == codes.FLOAT:
            kw = gl.load(K + base + koffs, mask=((n0 + tk) < end)[:, None], other=0)
        else:
            kw = gl.load(K + base + koffs)
        if V_KIND == codes.FLOAT:
            vw = gl.load(V + vbase + voffs, mask=((n0 + tv) < end)[:, None], other=0)
        else:
            vw = gl.load(V + vbase + voffs)
        ks = 0.0
        vs = 0.0
        kz = 0.0
        vz = 0.0
        if SCALE_MODE == codes.PER_TOKEN:
            meta = page * stride_mb + kvh * stride_mh + slot + ts
            tmask = (n0 + ts) < end
            ks = gl.load(KS + meta, mask=tmask, other=0.0).to(gl.float32)
            vs = gl.load(VS + meta, mask=tmask, other=0.0).to(gl.float32)
            if ASYM:
                kz = gl.load(KZ + meta, mask=tmask, other=0.0).to(gl.float32)
            if V_ASYM:
                vz = gl.load(VZ + meta, mask=tmask, other=0.0).to(gl.float32)
        return kw, vw, ks, vs, kz, vz

    @gluon.jit
    def _page(bt_row, n0, end, BLOCK_SIZE: gl.constexpr, OFF32: gl.constexpr):
        """The page of the tile at n0 (page 0 past `end`: a readable address whose scores are masked), as
        the int type of the kernel's offsets (OFF32: int32, the cache holds < 2^31 words). n0 >= 0:
        divided unsigned, by a shift (signed division costs four more uniform instructions a tile)."""
        page = gl.load(bt_row + (n0.to(gl.uint32) // BLOCK_SIZE).to(gl.int32), mask=n0 < end, other=0)
        return page if OFF32 else page.to(gl.int64)

    @gluon.jit
    def _tile_base(n0, page, kvh, stride_cb, stride_ch, stride_ct, BLOCK_SIZE: gl.constexpr):
        """The offset (words) of the tile's first row, and that row's slot in its page: 0 for 16-token
        pages (splits start at multiples of 16)."""
        if BLOCK_SIZE == 16:  # TILE
            slot = 0
        else:
            slot = (n0.to(gl.uint32) % BLOCK_SIZE).to(gl.int32)
        return page * stride_cb + kvh * stride_ch + slot * stride_ct, slot

    @gluon.jit
    def _copy_tile(n0, page, K, V, k_ring, v_ring, stage, kvh, stride_cb, stride_ch, stride_ct, coffs, metas,
                   BLOCK_SIZE: gl.constexpr, SCALE_MODE: gl.constexpr, ASYM: gl.constexpr, TMA: gl.constexpr = False,
                   GROUPS: gl.constexpr = 1):
        """Start the asynchronous copy of a tile's K and V words (and per-token scales, zero points: `metas`)
        into ring stage `stage` (one cp.async group). TMA: K and V are tensor descriptors of the pages' 16-word
        rows, copied by the TMA unit (one instruction a tensor) onto the stage's mbarrier (`metas[-1]`). GROUPS:
        scales a token-head (group scales: TMA only)."""
        base, slot = _tile_base(n0, page, kvh, stride_cb, stride_ch, stride_ct, BLOCK_SIZE)
        KS, VS, KZ, VZ, ks_ring, vs_ring, kz_ring, vz_ring, stride_mb, stride_mh, bars = metas
        if TMA:
            bar = bars.index(stage)
            row = (base // 16).to(gl.int32)  # rows of 16 words (`ring_descriptors` checks the stride)
            if SCALE_MODE == codes.PER_TOKEN:
                nbytes: gl.constexpr = KS.dtype.primitive_bitwidth // 8 * 16 * GROUPS * (4 if ASYM else 2)
                mbarrier.expect(bar, 2 * 16 * 64 + nbytes)
                mrow = ((page * stride_mb + kvh * stride_mh + slot) // 16).to(gl.int32)  # rows of 16 tokens' scales
                tma.async_copy_global_to_shared(KS, [mrow, 0], bar, _meta_dest(ks_ring, stage, GROUPS))
                tma.async_copy_global_to_shared(VS, [mrow, 0], bar, _meta_dest(vs_ring, stage, GROUPS))
                if ASYM:
                    tma.async_copy_global_to_shared(KZ, [mrow, 0], bar, _meta_dest(kz_ring, stage, GROUPS))
                    tma.async_copy_global_to_shared(VZ, [mrow, 0], bar, _meta_dest(vz_ring, stage, GROUPS))
            else:
                mbarrier.expect(bar, 2 * 16 * 64)
            tma.async_copy_global_to_shared(K, [row, 0], bar, k_ring.index(stage))
            tma.async_copy_global_to_shared(V, [row, 0], bar, v_ring.index(stage))
        else:
            async_copy.async_copy_global_to_shared(k_ring.index(stage), K + base + coffs)
            async_copy.async_copy_global_to_shared(v_ring.index(stage), V + base + coffs)
        if SCALE_MODE == codes.PER_TOKEN and not TMA:
            # tiles start at multiples of 16 tokens: say so, or cp.async falls back to 2-byte copies it lacks
            meta = gl.multiple_of(page * stride_mb + kvh * stride_mh + slot, 16) + gl.arange(0, 16, layout=META_COPY)
            async_copy.async_copy_global_to_shared(ks_ring.index(stage), KS + meta)
            async_copy.async_copy_global_to_shared(vs_ring.index(stage), VS + meta)
            if ASYM:
                async_copy.async_copy_global_to_shared(kz_ring.index(stage), KZ + meta)
                async_copy.async_copy_global_to_shared(vz_ring.index(stage), VZ + meta)
        if not TMA:
            async_copy.commit_group()

    @gluon.jit
    def _meta_dest(ring, stage, GROUPS: gl.constexpr = 1):
        """Stage `stage` of a TMA scale ring ([STAGES, 1, 64]: 128-byte aligned stages) as the copy's [1, 16 GROUPS]
        box."""
        return ring.index(stage).slice(0, 16 * GROUPS, dim=1)

    @gluon.jit
    def _meta_row(ring, stage, TMA: gl.constexpr):
        """A tile's 16 per-token scales (or zero points) in ring stage `stage`."""
        if TMA:
            return ring._reinterpret(ring.dtype, [ring.shape[0], 64], RING_META).index(stage).slice(0, 16)
        else:
            return ring.index(stage)

    @gluon.jit
    def _allocate_ring(K, V, KS, VS, KZ, VZ, stride_mb, stride_mh, STAGES: gl.constexpr, SCALE_MODE: gl.constexpr,
                       ASYM: gl.constexpr, TMA: gl.constexpr = False):
        """The ring's shared memory: K and V words [STAGES, 16 tokens, 16 words] and, for per-token formats, the
        tiles' scales (and zero points) [STAGES, 16]; TMA: in the descriptors' layouts, with an mbarrier a stage.
        Returns (k_ring, v_ring, metas), metas as `_copy_tile` and `_ring_metas` take it (static scales: no scale
        rings, the word rings hold their places, unread; its last entry the mbarriers, or k_ring)."""
        if TMA:
            k_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 16, 16], K.layout)
            v_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 16, 16], V.layout)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(bars.index(i), count=1)
            fence_async_shared()
        else:
            k_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 16, 16], RING_K)
            v_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 16, 16], RING_V)
            bars = k_ring
        metas = (KS, VS, KZ, VZ, k_ring, v_ring, k_ring, v_ring, stride_mb, stride_mh, bars)
        if SCALE_MODE == codes.PER_TOKEN:
            if TMA:  # TMA boxes land on 128-byte boundaries: a stage per 64 scales, 16 used
                ks_ring = gl.allocate_shared_memory(KS.dtype, [STAGES, 1, 64], KS.layout)
                vs_ring = gl.allocate_shared_memory(VS.dtype, [STAGES, 1, 64], VS.layout)
            else:
                ks_ring = gl.allocate_shared_memory(KS.dtype.element_ty, [STAGES, 16], RING_META)
                vs_ring = gl.allocate_shared_memory(VS.dtype.element_ty, [STAGES, 16], RING_META)
            kz_ring = ks_ring
            vz_ring = vs_ring
            if ASYM:
                if TMA:
                    kz_ring = gl.allocate_shared_memory(KZ.dtype, [STAGES, 1, 64], KZ.layout)
                    vz_ring = gl.allocate_shared_memory(VZ.dtype, [STAGES, 1, 64], VZ.layout)
                else:
                    kz_ring = gl.allocate_shared_memory(KZ.dtype.element_ty, [STAGES, 16], RING_META)
                    vz_ring = gl.allocate_shared_memory(VZ.dtype.element_ty, [STAGES, 16], RING_META)
            metas = (KS, VS, KZ, VZ, ks_ring, vs_ring, kz_ring, vz_ring, stride_mb, stride_mh, bars)
        return k_ring, v_ring, metas

    @gluon.jit
    def _fill_ring(start, end, bt_row, K, V, k_ring, v_ring, kvh, stride_cb, stride_ch, stride_ct, coffs, metas,
                   AHEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr, SCALE_MODE: gl.constexpr, ASYM: gl.constexpr,
                   OFF32: gl.constexpr, TMA: gl.constexpr = False, GROUPS: gl.constexpr = 1):
        """Start the copies of the split's first AHEAD tiles into stages 0 .. AHEAD - 1; returns the next tile's
        first token and page (loaded a step before its copy)."""
        for i in gl.static_range(AHEAD):
            _copy_tile(start + 16 * i, _page(bt_row, start + 16 * i, end, BLOCK_SIZE, OFF32), K, V, k_ring, v_ring, i,
                       kvh, stride_cb, stride_ch, stride_ct, coffs, metas, BLOCK_SIZE, SCALE_MODE, ASYM, TMA, GROUPS)
        ahead = start + 16 * AHEAD
        return ahead, _page(bt_row, ahead, end, BLOCK_SIZE, OFF32)

    @gluon.jit
    def _ring_metas(n0, end, metas, stage, ts, SCALE_MODE: gl.constexpr, ASYM: gl.constexpr, TMA: gl.constexpr = False):
        """A ring tile's per-token scales and zero points (0 past `end`, as `_tile_words` loads them)."""
        ks = 0.0
        vs = 0.0
        kz = 0.0
        vz = 0.0
        if SCALE_MODE == codes.PER_TOKEN:
            _, _, _, _, ks_ring, vs_ring, kz_ring, vz_ring, _, _, _ = metas
            valid = (n0 + ts) < end
            ks = gl.where(valid, _meta_row(ks_ring, stage, TMA).load(gl.SliceLayout(1, MMA)).to(gl.float32), 0.0)
            vs = gl.where(valid, _meta_row(vs_ring, stage, TMA).load(gl.SliceLayout(1, MMA)).to(gl.float32), 0.0)
            if ASYM:
                kz = gl.where(valid, _meta_row(kz_ring, stage, TMA).load(gl.SliceLayout(1, MMA)).to(gl.float32), 0.0)
                vz = gl.where(valid, _meta_row(vz_ring, stage, TMA).load(gl.SliceLayout(1, MMA)).to(gl.float32), 0.0)
        return ks, vs, kz, vz

    @gluon.jit
    def _await_tile(bars, i, STAGES: gl.constexpr):
        """Wait for the TMA copies of the split's tile i (unsigned): its stage's mbarrier completes a phase per use,
        tile i being that stage's (i // STAGES)-th."""
        mbarrier.wait(bars.index((i % STAGES).to(gl.int32)), ((i // STAGES) & 1).to(gl.int32))

    @gluon.jit
    def _drain_ring(metas, start, end, AHEAD: gl.constexpr, STAGES: gl.constexpr, PAIRS: gl.constexpr,
                    TMA: gl.constexpr):
        """Wait for the copies still in flight after the split's last step (the AHEAD tiles past it): a program
        must not exit while a copy can still write its shared memory."""
        if not TMA:
            async_copy.wait_group(0)
        if TMA:
            step: gl.constexpr = 32 if PAIRS else 16
            done = ((gl.maximum(end - start, 0) + step - 1) // step * (step // 16)).to(gl.uint32)  # tiles consumed
            for j in gl.static_range(AHEAD):
                _await_tile(metas[10], done + j, STAGES)

    @gluon.jit
    def _await_ring(metas, n0, start, waiting: gl.constexpr, STAGES: gl.constexpr, PAIRS: gl.constexpr,
                    TMA: gl.constexpr):
        """Wait until the tile at n0 (and, with PAIRS, n0 + 16) has landed, for every lane, and the stage(s)
        written next (read by the previous step) are free: the cp.async groups down to `waiting` outstanding
        (scales, zero points; and K / V words without TMA), and with TMA the tiles' mbarrier phases; then a
        barrier. (The freed stages' reads have returned, their values used a step ago, so the TMA's writes need
        no proxy fence of ours, as CUTLASS's TMA pipelines release stages without one; Gluon's barrier analysis
        puts a bar.sync and a fence around each copy all the same.)"""
        if not TMA:
            async_copy.wait_group(waiting)
        if TMA:
            i = (n0 - start).to(gl.uint32) // 16  # the tile's index in the split: unsigned, shifts
            _await_tile(metas[10], i, STAGES)
            if PAIRS:
                _await_tile(metas[10], i + 1, STAGES)
        gl.thread_barrier()
