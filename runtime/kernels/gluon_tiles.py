"""Tile I/O of the Gluon decode kernel (`decode_gluon.py`): a 16-token tile's page, its K / V words and
per-token scales / zero points, loaded into registers a step ahead or copied by cp.async into a
shared-memory ring (int4), in the register layouts of `gluon_operands`.
"""

from __future__ import annotations

try:  # Gluon ships with Triton >= 3.5 (decode_gluon.py falls back without it)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

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
    def _tile_words(n0, K, V, KS, VS, KZ, VZ, bt_row, end, kvh, stride_cb, stride_ch, stride_ct, stride_mb,
                    stride_mh, koffs, voffs, tk, tv, ts, BLOCK_SIZE: gl.constexpr, SCALE_MODE: gl.constexpr,
                    ASYM: gl.constexpr, KIND: gl.constexpr, OFF32: gl.constexpr):
        """A tile's K/V words and per-token scales / zero points (scales 0 past `end`)."""
        page = _page(bt_row, n0, end, BLOCK_SIZE, OFF32)
        base, slot = _tile_base(n0, page, kvh, stride_cb, stride_ch, stride_ct, BLOCK_SIZE)
        if KIND == 0:
            kw = gl.load(K + base + koffs, mask=((n0 + tk) < end)[:, None], other=0)
            vw = gl.load(V + base + voffs, mask=((n0 + tv) < end)[:, None], other=0)
        else:
            # Every address is inside a page (past `end`, page 0 of the cache), and the values there
            # widen to finite numbers whose scores are masked and whose p is 0: no load masks.
            # (A stale fp8 byte can be NaN, and NaN * 0 is NaN.)
            kw = gl.load(K + base + koffs)
            vw = gl.load(V + base + voffs)
        ks = 0.0
        vs = 0.0
        kz = 0.0
        vz = 0.0
        if SCALE_MODE == 3:
            meta = page * stride_mb + kvh * stride_mh + slot + ts
            tmask = (n0 + ts) < end
            ks = gl.load(KS + meta, mask=tmask, other=0.0).to(gl.float32)
            vs = gl.load(VS + meta, mask=tmask, other=0.0).to(gl.float32)
            if ASYM:
                kz = gl.load(KZ + meta, mask=tmask, other=0.0).to(gl.float32)
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
                   BLOCK_SIZE: gl.constexpr, SCALE_MODE: gl.constexpr, ASYM: gl.constexpr):
        """Start the asynchronous copy of a tile's K and V words (and per-token scales, zero points: `metas`)
        into ring stage `stage` (one group)."""
        base, slot = _tile_base(n0, page, kvh, stride_cb, stride_ch, stride_ct, BLOCK_SIZE)
        async_copy.async_copy_global_to_shared(k_ring.index(stage), K + base + coffs)
        async_copy.async_copy_global_to_shared(v_ring.index(stage), V + base + coffs)
        if SCALE_MODE == 3:
            KS, VS, KZ, VZ, ks_ring, vs_ring, kz_ring, vz_ring, stride_mb, stride_mh = metas
            # tiles start at multiples of 16 tokens: say so, or cp.async falls back to 2-byte copies it lacks
            meta = gl.multiple_of(page * stride_mb + kvh * stride_mh + slot, 16) + gl.arange(0, 16, layout=META_COPY)
            async_copy.async_copy_global_to_shared(ks_ring.index(stage), KS + meta)
            async_copy.async_copy_global_to_shared(vs_ring.index(stage), VS + meta)
            if ASYM:
                async_copy.async_copy_global_to_shared(kz_ring.index(stage), KZ + meta)
                async_copy.async_copy_global_to_shared(vz_ring.index(stage), VZ + meta)
        async_copy.commit_group()

    @gluon.jit
    def _allocate_ring(KS, VS, KZ, VZ, stride_mb, stride_mh, STAGES: gl.constexpr, SCALE_MODE: gl.constexpr,
                       ASYM: gl.constexpr):
        """The ring's shared memory: K and V words [STAGES, 16 tokens, 16 words] and, for per-token formats, the
        tiles' scales (and zero points) [STAGES, 16]. Returns (k_ring, v_ring, metas), metas as `_copy_tile` and
        `_ring_metas` take it (static scales: no scale rings, the word rings hold their places, unread)."""
        k_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 16, 16], RING_K)
        v_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 16, 16], RING_V)
        metas = (KS, VS, KZ, VZ, k_ring, v_ring, k_ring, v_ring, stride_mb, stride_mh)
        if SCALE_MODE == 3:
            ks_ring = gl.allocate_shared_memory(KS.dtype.element_ty, [STAGES, 16], RING_META)
            vs_ring = gl.allocate_shared_memory(VS.dtype.element_ty, [STAGES, 16], RING_META)
            kz_ring = ks_ring
            vz_ring = vs_ring
            if ASYM:
                kz_ring = gl.allocate_shared_memory(KZ.dtype.element_ty, [STAGES, 16], RING_META)
                vz_ring = gl.allocate_shared_memory(VZ.dtype.element_ty, [STAGES, 16], RING_META)
            metas = (KS, VS, KZ, VZ, ks_ring, vs_ring, kz_ring, vz_ring, stride_mb, stride_mh)
        return k_ring, v_ring, metas

    @gluon.jit
    def _fill_ring(start, end, bt_row, K, V, k_ring, v_ring, kvh, stride_cb, stride_ch, stride_ct, coffs, metas,
                   AHEAD: gl.constexpr, BLOCK_SIZE: gl.constexpr, SCALE_MODE: gl.constexpr, ASYM: gl.constexpr,
                   OFF32: gl.constexpr):
        """Start the copies of the split's first AHEAD tiles into stages 0 .. AHEAD - 1; returns the next tile's
        first token and page (loaded a step before its copy)."""
        for i in gl.static_range(AHEAD):
            _copy_tile(start + 16 * i, _page(bt_row, start + 16 * i, end, BLOCK_SIZE, OFF32), K, V, k_ring, v_ring, i,
                       kvh, stride_cb, stride_ch, stride_ct, coffs, metas, BLOCK_SIZE, SCALE_MODE, ASYM)
        ahead = start + 16 * AHEAD
        return ahead, _page(bt_row, ahead, end, BLOCK_SIZE, OFF32)

    @gluon.jit
    def _ring_metas(n0, end, metas, stage, ts, SCALE_MODE: gl.constexpr, ASYM: gl.constexpr):
        """A ring tile's per-token scales and zero points (0 past `end`, as `_tile_words` loads them)."""
        ks = 0.0
        vs = 0.0
        kz = 0.0
        vz = 0.0
        if SCALE_MODE == 3:
            _, _, _, _, ks_ring, vs_ring, kz_ring, vz_ring, _, _ = metas
            valid = (n0 + ts) < end
            ks = gl.where(valid, ks_ring.index(stage).load(gl.SliceLayout(1, MMA)).to(gl.float32), 0.0)
            vs = gl.where(valid, vs_ring.index(stage).load(gl.SliceLayout(1, MMA)).to(gl.float32), 0.0)
            if ASYM:
                kz = gl.where(valid, kz_ring.index(stage).load(gl.SliceLayout(1, MMA)).to(gl.float32), 0.0)
                vz = gl.where(valid, vz_ring.index(stage).load(gl.SliceLayout(1, MMA)).to(gl.float32), 0.0)
        return ks, vs, kz, vz
