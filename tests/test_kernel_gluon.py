"""The Gluon decode kernel (decode_gluon.py, the quantized formats' default on the GPU): its plans against the fp64
oracle on the GPU (every format, the int4 ring one and two tiles a step, filled by the TMA unit or cp.async, 1 or 2
mma chains), and every default build cross-compiled for sm_90 without a GPU (no spills in the tile loop, shared
memory only in the ring)."""

from __future__ import annotations

import os
import sys
import zlib

import pytest
import torch

from runtime.kernels import decode_gluon
from runtime.kv_format import KVFormat
from tests.helpers_gluon_compile import FORMATS_BY_NAME, GLUON_VARIANTS
from tests.helpers_kernels import CUDA, DEV, FMT_IDS, FORMATS, K, assert_meets_oracle, decode_with, fill_cache

HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9


GLUON_SHAPES = {
    "gqa4-page16": (6, 32, 8, 128, 16, [1, 15, 16, 17, 3000, 8000]),
    "gqa8-page32": (3, 16, 2, 128, 32, [500, 33, 4096]),
    "gqa5-page16": (2, 10, 2, 128, 16, [777, 1500]),
    "mha-page64": (2, 4, 4, 128, 64, [100, 2000]),
}
QUANTIZED = [f for f in FORMATS if f.quantized]


@pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only (the interpreter cannot run them)")
@pytest.mark.parametrize("split", [1, 4], ids=["one-split", "split-k"])
@pytest.mark.parametrize("shape", list(GLUON_SHAPES))
@pytest.mark.parametrize("fmt", QUANTIZED, ids=[i for f, i in zip(FORMATS, FMT_IDS) if f.quantized])
def test_decode_gluon_kernel(fmt, shape, split):
    """decode_gluon.py meets the fp64 oracle like the Triton kernels (bf16 q; fp16 q at group 5)."""
    from runtime.kernels import decode_gluon
    from runtime.kernels.formats import kernel_format

    batch, heads, kv_heads, head_dim, bs, seq_lens = GLUON_SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"gluon{shape}{fmt.name}".encode()))
    cache, bt, lens = fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    qdtype = torch.float16 if shape == "gqa5-page16" else torch.bfloat16
    q = torch.randn(batch, heads, head_dim, generator=gen).to(qdtype).to(DEV)
    assert decode_gluon.supported(kernel_format(cache), q, bs, heads // kv_heads)
    out = decode_with(q, cache, bt, lens, 0.25, "gluon", splits=split)
    assert_meets_oracle(out, q, cache, bt, lens, qdtype)


RING_FORMATS = [f for f in QUANTIZED if f.dtype == "int4"]


@pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only (the interpreter cannot run them)")
@pytest.mark.parametrize("stages,pairs", [(2, False), (3, False), (4, True), (5, True)])
@pytest.mark.parametrize("shape", list(GLUON_SHAPES))
@pytest.mark.parametrize("fmt", RING_FORMATS, ids=lambda f: f.name)
def test_decode_gluon_ring(fmt, shape, stages, pairs):
    """The int4 shared-memory ring (filled a stage ahead, per-token scales and zero points with the words, by the
    TMA unit on sm_90, by cp.async on sm_8x; `tuning.gluon_stages_for`), a tile or two tiles a step
    (`gluon_attend._attend_pair`), meets the same oracle. The default plan takes it only for splits of >= 1024
    tokens or few programs, so the plans here take it,
    with split-K (tiles past a split's end, an odd number of tiles in a split, pages out of order, lengths
    not a multiple of 16)."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = GLUON_SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"ring{shape}{fmt.name}".encode()))
    cache, bt, lens = fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16).to(DEV)
    out = decode_with(q, cache, bt, lens, 0.25, "gluon", splits=4, stages=stages, pairs=pairs, tma=HOPPER)
    assert_meets_oracle(out, q, cache, bt, lens, torch.bfloat16)


@pytest.mark.skipif(not HOPPER,
                    reason="the TMA unit is sm_90's (Gluon kernels run on the GPU only)")
@pytest.mark.parametrize("stages,pairs", [(2, False), (4, True), (5, True)])
@pytest.mark.parametrize("shape", ["gqa4-page16", "gqa8-page32", "mha-page64"])
@pytest.mark.parametrize("fmt", RING_FORMATS, ids=lambda f: f.name)
def test_decode_gluon_ring_filled_by_tma_matches_cp_async(fmt, shape, stages, pairs):
    """The ring filled by the TMA unit (`DecodePlan.tma`: K and V words, per-token scales and zero points; the sm_90
    default) holds the same bytes as cp.async's: outputs equal bit for bit, with split-K, pages out of
    order, lengths not a multiple of 16 and odd stage counts (a stage's mbarrier phase is its tile index //
    STAGES)."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = GLUON_SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"tma{shape}{fmt.name}".encode()))
    cache, bt, lens = fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16).to(DEV)
    outs = [decode_with(q, cache, bt, lens, 0.25, "gluon", splits=4, stages=stages, pairs=pairs, tma=tma)
            for tma in (False, True)]
    assert torch.equal(outs[1], outs[0])


@pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only (the interpreter cannot run them)")
@pytest.mark.parametrize("fmt", RING_FORMATS, ids=lambda f: f.name)
def test_decode_default_launch_of_few_programs_takes_the_pair_ring(fmt):
    """Few (sequence, KV head) pairs: the default plan takes int4's ring of tiles two a step over short splits
    (`tuning.gluon_plan`: 6 pairs, splits of 256 tokens) and meets the oracle."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = GLUON_SHAPES["gqa8-page32"]
    gen = torch.Generator().manual_seed(zlib.crc32(f"few{fmt.name}".encode()))
    cache, bt, lens = fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16).to(DEV)
    plan = K.decode_plan_for(q, cache, bt)
    assert (plan.kernel, plan.stages, plan.pairs) == ("gluon", 4, True) and plan.splits > 1
    out = K.decode_attention(q, cache, bt, lens, 0.25)
    assert_meets_oracle(out, q, cache, bt, lens, torch.bfloat16)


@pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only (the interpreter cannot run them)")
@pytest.mark.parametrize("chains", [1, 2])
@pytest.mark.parametrize("shape", ["gqa4-page16", "gqa5-page16"])
@pytest.mark.parametrize("fmt", [KVFormat("fp8_e4m3", "per_tensor"), KVFormat("int8", "per_token"),
                                 KVFormat("int4", "per_token", symmetric=False)], ids=["fp8", "int8-tok", "int4-tok-asym"])
def test_decode_gluon_k_chains(fmt, shape, chains):
    """The scores as 1 or 2 independent chains of mma over blocks of k (`gluon_operands._k_operands`; the default
    launch takes 2 for int8 per-token) meet the same oracle: a block of K paired with the wrong block of q fails it
    (bf16 q; fp16 q at group 5)."""
    batch, heads, kv_heads, head_dim, bs, seq_lens = GLUON_SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"chains{shape}{fmt.name}".encode()))
    cache, bt, lens = fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    qdtype = torch.float16 if shape == "gqa5-page16" else torch.bfloat16
    q = torch.randn(batch, heads, head_dim, generator=gen).to(qdtype).to(DEV)
    out = decode_with(q, cache, bt, lens, 0.25, "gluon", splits=4, k_chains=chains)
    assert_meets_oracle(out, q, cache, bt, lens, qdtype)



@pytest.fixture(scope="module")
def gluon_sm90_builds():
    """Every Gluon kernel variant cross-compiled for the H200 (tests/helpers_gluon_compile.py), in a
    process of its own: under TRITON_INTERPRET=1 (set here on CPU machines) Gluon cannot compile."""
    import json
    import subprocess
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "tests.helpers_gluon_compile"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stderr[-3000:]
    return {tuple(r["variant"]): r for r in map(json.loads, run.stdout.splitlines())}


@pytest.mark.parametrize("variant", GLUON_VARIANTS,
                         ids=[f"{name}-stages{s}{'-pairs' if p else ''}-group{g}{'-tma' if t else ''}"
                              for name, g, s, p, t in GLUON_VARIANTS])
def test_gluon_kernel_compiles_for_sm90(gluon_sm90_builds, variant):
    """Cross-compiled for sm_90 (no GPU needed): every format's layout relabelling compiles to
    register renames (`assert_trivial` in `_k_operands` / `_v_operand`; a wrong permutation fails the
    build), K and V touch shared memory only in the int4 ring (4 stages of tiles two a step, or 2 of one, of 1 KB of
    K, 1 KB of V and the tile's per-token scales and zero points, and where the TMA unit fills it an 8-byte mbarrier a
    stage and its scales on 128-byte boundaries), no variant spills inside its tile loop, and with 128 registers the
    static formats do not spill at all (16 programs per SM is what the split rule assumes); for GQA groups 1, 4 and 8
    (fp8 per-token, whose cap depends on the group, for 1-8)."""
    build = gluon_sm90_builds[variant]
    assert "error" not in build, build.get("error")
    name, _, stages, _, tma = variant
    fmt = FORMATS_BY_NAME[name]
    # per-token fp16 scales (and zero points) a tile: 16 of them, or a 128-byte row where TMA copies them
    metas = (2 if fmt.symmetric else 4) * (128 if tma else 16 * 2) if fmt.dynamic else 0
    barrier = 8 if tma else 0
    assert build["shared"] == stages * (2 * 16 * 64 + metas + barrier), \
        "K and V go to registers, int4 tiles through the ring"
    assert build["regs"] <= (build["cap"] or 255)
    assert build["loop_local"] == 0, f"spills in the tile loop: {build}"
    if not fmt.dynamic:
        assert build["cap"] == 128 and build["stack"] == 0, f"static format spills: {build}"


@pytest.mark.skipif(decode_gluon.gluon is None, reason="this Triton has no Gluon (TMA descriptors are Gluon's)")
def test_ring_descriptors_describe_a_tile_a_copy():
    """`gluon_tiles.ring_descriptors`: K / V pages as rows of 16 words, a 16-token tile a box, V 64-byte swizzled;
    per-token scales as rows of 16, a tile's 16 a box; a cache whose rows are not whole and in order gets an error
    that says what to pass instead of a wrong copy."""
    from runtime.kernels.gluon_tiles import TMA_SWIZZLE_V, ring_descriptors

    pages = torch.zeros(6, 2, 16, 16, dtype=torch.int32)
    scales = torch.zeros(6, 2, 16, dtype=torch.float16)
    k, v, ks = ring_descriptors(pages, pages.clone(), (scales,))
    assert (k.shape, k.block_shape, v.block_shape, ks.shape, ks.block_shape) == \
        (torch.Size([192, 16]), [16, 16], [16, 16], torch.Size([12, 16]), [1, 16])
    assert (k.layout.swizzle_byte_width, v.layout.swizzle_byte_width) == (0, TMA_SWIZZLE_V)
    assert (ks.layout.element_bitwidth, k.layout.element_bitwidth) == (16, 32)
    with pytest.raises(ValueError, match="tma=False"):
        ring_descriptors(pages.transpose(1, 2), pages)

