"""The mixed-format kernels (write_mixed.py, decode_mixed.py; `formats.served_by_mixed`): K and V of their own
formats ("K8V4"), group scales, e8m0 scales. The write's bytes, scales and zero points equal kv_format's exactly
(slots out of order, padding slots skipped, special values); decode meets the relative fp64 oracle of
shared/reference/style.md (pages from randperm, lengths not multiples of the page, head dims that are not powers of
two, split-K on and off); chunked prefill over such a cache equals the reference op."""

from __future__ import annotations

import math
import zlib
from dataclasses import replace

import pytest
import torch

from runtime.kernels.plan import mixed_row_lanes
from runtime.kv_format import KVFormat
from runtime.kv_quant import dynamic_scales, quantize
from tests.helpers_kernels import (
    CUDA,
    DEV,
    K,
    as_bytes,
    assert_meets_oracle,
    decode_with,
    fill_cache,
    kv,
    make_cache,
    oracle,
    relerr,
)
from tests.helpers_mixed_compile import COMPILED_FORMATS

MIXED = [
    KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False),  # K8V4
    KVFormat("fp8_e4m3", "per_token", v_dtype="int4", v_symmetric=False),
    KVFormat("int4", "per_token", False, group_size=16),
    KVFormat("int4", "per_token", False, "float32", 16),
    KVFormat("int4", "per_token", True, "e8m0", 16),
    KVFormat("int8", "per_token", True, "e8m0", 16),
    KVFormat("fp8_e4m3", "per_token", True, "float16", 16),
    KVFormat("fp8_e5m2", "per_token", True, "bfloat16", 16),
    KVFormat("int4", "per_token", False, "float16", 16, "int8", True, 0),  # group-scaled int4 K, per-token int8 V
]
IDS = [f.name for f in MIXED]

# (batch, q heads, kv heads, head_dim, block_size, seq_lens): GQA group 3 over pages of 5 with three groups of 16
# channels in a head_dim of 48; MHA on pages of 16; lengths not multiples of the page
SHAPES = {"gqa3-hd48-page5": (3, 9, 3, 48, 5, [17, 3, 29]), "mha2-hd32-page16": (2, 2, 2, 32, 16, [33, 1]),
          "gqa4-hd128-page16": (2, 8, 2, 128, 16, [37, 5])}
if CUDA:  # real sizes on the GPU machine: Llama-3-8B attention under the default plan's tiles and splits
    SHAPES["llama8b"] = (8, 32, 8, 128, 16, [4000, 1, 17, 2048, 333, 1024, 4096, 77])


SPLIT = MIXED[:2]  # K8V4, KFP8V4
GROUP64 = KVFormat("int4", "per_token", False, group_size=64)
# the Gluon kernel's on the GPU (`decode_gluon.serves_mixed`)
GLUON = SPLIT + [GROUP64, KVFormat("int4", "per_token", True, group_size=64),
                 KVFormat("int8", "per_token", True, group_size=64), KVFormat("int8", "per_token", False, "bfloat16", 64),
                 KVFormat("int4", "per_token", False, group_size=32), KVFormat("int4", "per_token", True, group_size=32),
                 KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False, v_group_size=32)]  # K8V4-g32


def test_the_formats_here_take_the_mixed_kernels():
    """The K/V-split formats (K8V4 also with V in groups of 32), INT4 / INT8 group 64 and INT4 group 32 take the Gluon
    kernel on the H200 (INT4 group scales through the TMA ring, the others from registers); the other group-scale and
    the e8m0 formats, and every format in the interpreter, decode_mixed.py."""
    from runtime.kernels.formats import served_by_mixed
    from runtime.kernels.tuned_file import Device

    assert all(served_by_mixed(f) for f in MIXED)
    assert not served_by_mixed(KVFormat("int4", "per_token", False))  # the tuned int4 kernels keep theirs
    for fmt in GLUON:
        plan = K.decode_plan(fmt, 16, 32, 8, 32768)
        ring = fmt.group_size > 0 and fmt.dtype == "int4"
        assert plan.kernel == "gluon" and plan.tma == ring and bool(plan.stages) == ring and plan.splits > 1
        assert K.decode_plan(fmt, 16, 32, 8, 32768, kernel="triton").kernel == "mixed"
        assert K.decode_plan(fmt, 16, 32, 8, 32768, head_dim=64).kernel == "mixed"  # the Gluon kernel's is 128
        assert K.decode_plan(fmt, 16, 32, 8, 32768, q_dtype=torch.float32).kernel == "mixed"
        assert K.decode_plan(fmt, 4, 32, 8, 4096, Device("interpreter", 4, 0, cuda=False, interpret=True)
                             ).kernel == "mixed"
    for fmt in MIXED[2:] + [KVFormat("int8", "per_token", False, group_size=32)]:
        assert K.decode_plan(fmt, 16, 32, 8, 32768).kernel == "mixed"


def test_the_write_takes_rows_where_they_fit():
    """On the H200 the mixed write keeps whole rows over lanes for fp16 per-token scales from bf16 rows in a head_dim
    of >= 8 columns a lane (a group of g channels over g / 8 lanes, two warps), and the tile for every other case."""
    from runtime.kernels.tuned_file import Device

    k8v4_g32, g64 = GLUON[-1], GROUP64
    assert mixed_row_lanes(k8v4_g32, 128, 4) == (4, 4) and mixed_row_lanes(g64, 128, 4) == (8, 8)
    assert mixed_row_lanes(KVFormat("int4", "per_token", False, group_size=16), 64, 4) == (2, 2)
    for fmt in (k8v4_g32, g64, SPLIT[1]):
        plan = K.write_plan(fmt, 4096, 8)
        assert (plan.lanes, plan.packed, plan.num_warps, plan.fast) == (4, True, 2, True), (fmt.name, plan)
    tile = [K.write_plan(g64, 4096, 8, k_dtype=torch.float16),  # fp16 rows: the words are bf16 pairs
            K.write_plan(KVFormat("int4", "per_token", False, "bfloat16", 64), 4096, 8),  # bf16 scales
            K.write_plan(MIXED[4], 4096, 8),  # e8m0 scales
            K.write_plan(g64, 4096, 8, head_dim=48),  # not a power of two
            K.write_plan(g64, 4096, 8, head_dim=32),  # groups of 64 need 64 columns
            K.write_plan(g64, 4096, 8, Device("interpreter", 4, 0, cuda=False, interpret=True))]
    assert all((p.lanes, p.packed) == (0, False) for p in tile), tile


def test_one_tuned_entry_sends_a_split_format_back_to_the_mixed_kernel(monkeypatch):
    """`gluon: false` in the format's tuned entry (tuned/nvidia_h200.json) is the whole switch back."""
    from runtime.kernels import plan as plans

    real = plans.format_tuned

    def without_gluon(fmt, device):
        tuned = real(fmt, device)
        return replace(tuned, decode=replace(tuned.decode, gluon=False))

    monkeypatch.setattr(plans, "format_tuned", without_gluon)
    for fmt in GLUON:
        assert K.decode_plan(fmt, 16, 32, 8, 32768).kernel == "mixed"


def test_no_kernel_reads_a_non_constexpr_global():
    """The GPU compiler refuses a global read inside a @jit function unless it is a constexpr, a module, a jit
    function or a dtype (triton/compiler/code_generator.py's rule); the interpreter reads any. Every name the kernels
    of runtime/kernels read from their module's globals passes that rule."""
    import ast
    import importlib
    import inspect
    import pkgutil
    import textwrap
    from types import ModuleType

    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITCallable

    import runtime.kernels as package

    def allowed(val) -> bool:
        module = getattr(val, "__module__", "") or ""
        return (isinstance(val, (ModuleType, JITCallable, InterpretedFunction, tl.constexpr, tl.dtype)) or callable(val) and (
            module.startswith(("triton.language", "triton.experimental.gluon.language"))
            or getattr(val, "__triton_builtin__", False)))

    found, bad = 0, []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"runtime.kernels.{info.name}")
        for name, fn in vars(module).items():
            inner = getattr(fn, "fn", None)
            if not isinstance(fn, (JITCallable, InterpretedFunction)) or inner is None \
                    or inner.__module__ != module.__name__:
                continue
            found += 1
            tree = ast.parse(textwrap.dedent(inspect.getsource(inner)))
            local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)} | {
                n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local \
                        and node.id in inner.__globals__ and not allowed(inner.__globals__[node.id]):
                    bad.append(f"{info.name}.{name} reads {node.id} = {inner.__globals__[node.id]!r}")
    assert found > 30, f"found only {found} kernels: the scan is broken"
    assert not bad, "globals to make tl.constexpr(...): " + "; ".join(bad)


def compiled_rows(module: str, *args: str) -> list[dict]:
    """The JSON lines a cross-compiling module prints, run in a process of its own without TRITON_INTERPRET (under
    it nothing compiles)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", module, *args], cwd=Path(__file__).resolve().parents[1], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


@pytest.fixture(scope="module")
def mixed_sm90_builds():
    """The decode and write builds of COMPILED_FORMATS on the H200, cross-compiled for sm_90
    (tests/helpers_mixed_compile.py)."""
    return compiled_rows("tests.helpers_mixed_compile")


@pytest.mark.skipif(CUDA, reason="the GPU runs these builds in the tests above")
@pytest.mark.parametrize("fmt", COMPILED_FORMATS, ids=[f.name for f in COMPILED_FORMATS])
def test_builds_compile_for_sm90(mixed_sm90_builds, fmt):
    """Every kernel the format's decode and write launch on the H200 compiles for sm_90 (the e8m0 write once read a
    non-constexpr global: fine in the interpreter, a NameError on the GPU); the Gluon builds do not spill and stay
    within the register cap the split rule counts on (the plan's cap, `tuning.programs_per_sm`; uncapped: 168 and
    below, 12 programs an SM), with K and V in registers (no shared memory) except where the plan takes the TMA ring."""
    mine = [b for b in mixed_sm90_builds if b["build"].split(" ")[0] == fmt.name]
    assert {"decode", "write"} <= {b["build"].split(" ")[1] for b in mine}, mine
    ring = K.decode_plan(fmt, 16, 32, 8, 32768).stages > 0
    for build in mine:
        assert build["ok"], f"{build['build']}: {build.get('error')}"
        if "gluon" in build["build"]:
            assert build["stack"] == 0 and (build["shared"] > 0) == ring, build
            assert build["regs"] <= (K.decode_plan(fmt, 16, 32, 8, 32768).registers or 168), build
    assert any("gluon" in b["build"] for b in mine) == (fmt in GLUON)


@pytest.mark.skipif(CUDA, reason="the GPU machine measures these kernels instead")
def test_sass_loop_probe_finds_one_step_of_the_tile_loop(mixed_sm90_builds):
    """benchmarks/probes/sass_loop.py (instructions a tile by opcode, from the sm_90 SASS of the H200's launch) finds
    the tile loop: one step's mma and no more, 16 HMMA a 16-token tile (8 m16n8k16 for the scores, 8 for p . V), for
    the group ring's one tile a step and the per-token ring's two. (After the module's sm_90 builds: the group-64
    build comes from Triton's cache.)"""
    probe = compiled_rows("benchmarks.probes.sass_loop", "--formats", "int4-g64-asym,int4-tok-asym")
    rows = {r["format"]: r for r in probe}
    assert [rows[f]["tiles_a_step"] for f in ("int4-g64-asym", "int4-tok-asym")] == [1, 2]
    for row in rows.values():
        assert row["opcodes"]["HMMA"] == 16 * row["tiles_a_step"], row
        assert row["per_tile"] == row["loop"] / row["tiles_a_step"] and row["stack"] == 0


@pytest.mark.parametrize("head_dim", [16, 48, 64])  # 64: the groups as an axis (a power of two)
@pytest.mark.parametrize("fmt", MIXED, ids=IDS)
def test_write_bytes_equal_reference(fmt, head_dim):
    _check_write(fmt, head_dim, None)


# the row layout (`plan.mixed_row_lanes`) where it serves: fp16 scales, a power-of-two head_dim of >= 8 columns a lane
ROWS = [(f, hd) for f in MIXED + GLUON for hd in (16, 32, 64, 128) if mixed_row_lanes(f, hd, 4)]


@pytest.mark.skipif(not CUDA, reason="the rows' bf16x2 instructions run on the GPU only (their sm_90 builds: "
                    "test_builds_compile_for_sm90; the interpreter refuses the plan: test_rows_plan_is_refused_where_it_cannot_run)")
@pytest.mark.parametrize("fmt, head_dim", ROWS, ids=[f"{f.name}-hd{hd}" for f, hd in ROWS])
def test_write_bytes_of_rows_equal_reference(fmt, head_dim):
    plan = K.write_plan(fmt, 23, 3, DEV, head_dim=head_dim)
    lanes = mixed_row_lanes(fmt, head_dim, 4)
    _check_write(fmt, head_dim, replace(plan, lanes=4, packed=True, num_warps=max(1, min(lanes) * plan.block_t // 32)))


def test_rows_plan_is_refused_where_it_cannot_run():
    """A row plan for a format or a device it does not serve fails before launching, naming the field."""
    fmt = KVFormat("int4", "per_token", False, "float32", 16)  # fp32 scales: the rows store fp16 ones
    cache = make_cache(fmt, 2, 4, 1, 64)
    k, v = kv(3, 1, 64, torch.bfloat16, torch.Generator().manual_seed(0))
    plan = replace(K.write_plan(fmt, 3, 1, DEV, head_dim=64), lanes=4, packed=True, fast=CUDA)
    with pytest.raises(ValueError, match="WritePlan.lanes=4: the mixed write's rows need"):
        K.write_kv(cache, k, v, torch.arange(3).to(DEV), plan=plan)


def _check_write(fmt, head_dim, plan):
    gen = torch.Generator().manual_seed(zlib.crc32(fmt.name.encode()))
    kv_heads, bs, nb, tokens = 3, 5, 9, 23
    k, v = kv(tokens, kv_heads, head_dim, torch.bfloat16, gen)
    k[3] = 0.0  # an all-zero token: the scale floor must match too
    k[5, 1, 2] = 3.0e7  # beyond the fp16 scale range: the scale saturates
    v[8, 1] *= 1e-30  # fp32 / bf16 / e8m0 scales below 2**-64: the GPU's reciprocal path scales them up first
    v[4, 0, :2] = -0.0
    v[6, 2, 3] = float("nan")  # stored as 0, and left out of its group's scale
    cache = make_cache(fmt, nb, bs, kv_heads, head_dim)
    before_k, before_v = as_bytes(cache.k).clone(), as_bytes(cache.v).clone()
    slots = torch.randperm(nb * bs, generator=gen)[:tokens]
    slots[7] = -1  # padding: skipped
    K.write_kv(cache, k, v, slots.to(DEV), plan=plan)
    keep = slots >= 0
    blk, off = slots[keep] // bs, slots[keep] % bs
    for name, x, before in (("k", k, before_k), ("v", v, before_v)):
        side = fmt.side(name)
        s_ref, z_ref = dynamic_scales(x[keep].cpu(), side)
        s_got = getattr(cache, f"{name}_scale").cpu()[blk, :, off]
        assert torch.equal(as_bytes(s_got), as_bytes(s_ref)), f"{name} scales differ"
        if z_ref is not None:
            assert torch.equal(getattr(cache, f"{name}_zero").cpu()[blk, :, off], z_ref), f"{name} zero points differ"
        stored = getattr(cache, name).cpu()[blk, :, off]
        q_ref = quantize(x[keep].cpu(), side, s_ref, z_ref)
        assert torch.equal(as_bytes(stored), as_bytes(q_ref)), f"{name}: {(as_bytes(stored) != as_bytes(q_ref)).sum()} " \
            "bytes differ from kv_quant.quantize"
        untouched = torch.ones(nb, bs, dtype=torch.bool)
        untouched[blk, off] = False
        now = as_bytes(getattr(cache, name)).cpu()
        assert torch.equal(now.transpose(1, 2)[untouched], before.cpu().transpose(1, 2)[untouched])


def _decode_case(fmt, shape, splits):
    batch, heads, kv_heads, head_dim, bs, seq_lens = SHAPES[shape]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{shape}{fmt.name}".encode()))
    cache, block_tables, lens = fill_cache(fmt, batch, kv_heads, head_dim, bs, seq_lens, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16).to(DEV)
    sm_scale = 0.25
    plan = K.decode_plan(fmt, batch, heads, kv_heads, block_tables.shape[1] * bs, q.device, head_dim=head_dim,
                         block_size=bs, q_dtype=q.dtype)
    out = K.decode_attention(q, cache, block_tables, lens, sm_scale, plan=replace(plan, splits=splits, block_n=16))
    assert out.dtype == q.dtype and out.shape == q.shape and torch.isfinite(out).all()
    truth, torch_err = oracle(q, cache, block_tables, lens, sm_scale, torch.bfloat16)
    err = relerr(out.cpu(), truth)
    assert err <= 2 * torch_err + 1e-5, f"kernel error {err:.3e} > 2 x PyTorch bf16 error {torch_err:.3e}"


@pytest.mark.parametrize("splits", [1, 3], ids=["one-split", "split-k"])
@pytest.mark.parametrize("fmt", MIXED, ids=IDS)
def test_decode_relative_oracle(fmt, splits):
    _decode_case(fmt, "gqa3-hd48-page5", splits)


OTHER_SHAPES = [(fmt, shape) for shape in ["mha2-hd32-page16", "gqa4-hd128-page16"] + (["llama8b"] if CUDA else [])
                for fmt in MIXED[:3] + [GROUP64] if fmt.group_size <= SHAPES[shape][3]]


@pytest.mark.parametrize(("fmt", "shape"), OTHER_SHAPES, ids=[f"{f.name}-{s}" for f, s in OTHER_SHAPES])
def test_decode_relative_oracle_other_shapes(fmt, shape):
    _decode_case(fmt, shape, 2)


def test_decode_plan_of_another_kernel_is_refused():
    fmt = MIXED[0]
    cache, block_tables, lens = fill_cache(fmt, 1, 1, 16, 5, [7], torch.Generator().manual_seed(0))
    q = torch.randn(1, 1, 16).to(torch.bfloat16).to(DEV)
    warps = K.decode_plan(KVFormat("int8", "per_token"), 1, 1, 1, 16, q.device, head_dim=16, block_size=5)
    with pytest.raises(ValueError, match="runs on the 'mixed' kernel"):
        K.decode_attention(q, cache, block_tables, lens, 0.25, plan=warps)


def test_decode_matches_a_per_token_kernel_on_one_group():
    """group_size = head_dim is one scale per token-head: the mixed kernel's output equals what the tuned int4
    kernel computes from the same stored bytes within the oracle's bound (same math, other kernel)."""
    fmt = KVFormat("int4", "per_token", False, group_size=16)
    gen = torch.Generator().manual_seed(5)
    cache, block_tables, lens = fill_cache(fmt, 2, 2, 16, 5, [9, 14], gen)
    plain = replace(cache, fmt=KVFormat("int4", "per_token", False), k_scale=cache.k_scale[..., 0].contiguous(),
                    v_scale=cache.v_scale[..., 0].contiguous(), k_zero=cache.k_zero[..., 0].contiguous(),
                    v_zero=cache.v_zero[..., 0].contiguous())
    q = torch.randn(2, 4, 16, generator=gen).to(torch.bfloat16).to(DEV)
    a = K.decode_attention(q, cache, block_tables, lens, 0.25)
    b = K.decode_attention(q, plain, block_tables, lens, 0.25)
    truth, torch_err = oracle(q, plain, block_tables, lens, 0.25, torch.bfloat16)
    assert relerr(a.cpu(), truth) <= 2 * torch_err + 1e-5 and relerr(b.cpu(), truth) <= 2 * torch_err + 1e-5
    assert math.isclose(relerr(a.cpu(), b.cpu().double()), 0.0, abs_tol=4 * torch_err)


# (format, q dtype, splits): every format with bf16 q, with and without split-K; fp16 q (the same code in another
# dtype) for one format of each path (K/V split, two groups, four)
GLUON_CASES = ([(f, torch.bfloat16, n) for f in GLUON for n in (1, 5)]
               + [(f, torch.float16, 5) for f in (SPLIT[0], GROUP64, GLUON[-2])])


@pytest.mark.skipif(not CUDA, reason="the Gluon kernel runs on CUDA only (its sm_90 build: test_builds_compile_for_sm90)")
@pytest.mark.parametrize(("fmt", "q_dtype", "splits"), GLUON_CASES,
                         ids=[f"{f.name}-{str(d)[6:]}-splits{n}" for f, d, n in GLUON_CASES])
def test_decode_gluon_mixed_formats_meet_the_oracle(fmt, q_dtype, splits):
    """The Gluon kernel on a K/V-split or group-64 cache: pages from randperm, lengths not multiples of the 16-token tile (a
    partial last page, a sequence of 1), GQA groups of 4 and 8, against the fp64 attention over the stored bytes."""
    for heads, kv_heads, seq_lens in ((32, 8, [1000, 1, 17, 3001]), (16, 2, [4099, 255])):
        gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt.name}{heads}{splits}".encode()))
        cache, block_tables, lens = fill_cache(fmt, len(seq_lens), kv_heads, 128, 16, seq_lens, gen)
        q = torch.randn(len(seq_lens), heads, 128, generator=gen).to(q_dtype).to(DEV)
        out = decode_with(q, cache, block_tables, lens, 0.25, "gluon", splits=splits)
        assert out.dtype == q_dtype and out.shape == q.shape
        assert_meets_oracle(out, q, cache, block_tables, lens, q_dtype)


# the group-scale formats the TMA ring takes: int4 (its pages' rows are the ring's 16 words)
GROUP_RING = [f for f in GLUON if f.group_size and f.dtype == "int4"]
HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not HOPPER, reason="the TMA unit is sm_90's (Gluon kernels run on the GPU only)")
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("fmt", GROUP_RING, ids=[f.name for f in GROUP_RING])
def test_decode_gluon_group_scales_through_the_tma_ring_meet_the_oracle(fmt, stages):
    """INT4 group scales with the tiles (words, scales, zero points) through the TMA ring: pages from randperm, lengths
    not multiples of the tile, pages of 16 and 32 tokens, with and without split-K, against the fp64 attention over
    the stored bytes; and the same output as from registers up to the fp32 sum's order."""
    for (heads, kv_heads, seq_lens), bs, splits in (((32, 8, [1000, 1, 17, 3001]), 16, 5),
                                                    ((16, 2, [4099, 255]), 32, 1)):
        gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt.name}{heads}{stages}".encode()))
        cache, block_tables, lens = fill_cache(fmt, len(seq_lens), kv_heads, 128, bs, seq_lens, gen)
        q = torch.randn(len(seq_lens), heads, 128, generator=gen).to(torch.bfloat16).to(DEV)
        out = decode_with(q, cache, block_tables, lens, 0.25, "gluon", splits=splits, stages=stages, tma=True)
        assert_meets_oracle(out, q, cache, block_tables, lens, torch.bfloat16)
        registers = decode_with(q, cache, block_tables, lens, 0.25, "gluon", splits=splits)
        assert relerr(out.float().cpu(), registers.float().cpu().double()) <= 2.0 ** -8  # bf16 rounding

