"""What the int4 decode kernel's memory access alone can read (GPU machine): its programs, its cp.async ring and
its tiles, without the attention.

`_ring_read` is the Gluon decode kernel's int4 ring loop (`gluon_tiles._allocate_ring`, `_fill_ring`, `_copy_tile`, `_ring_metas`: the same
one-warp programs over the same splits, pages in random order, K and V words and per-token scales copied STAGES - 1
tiles ahead) with the attention replaced by an XOR of the words (and a sum of the scales) and, optionally, SPIN
dependent fmas a tile standing in for the attention's latency. Timed as the benchmarks time the kernels, beside the
real decode launch and a bf16 sum of the same bytes. If the ring alone reads at the same-size sum's rate, what
separates int4 from it is the attention; if not, the access pattern.

    python3 benchmarks/probes/ring_read.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kernels as kb  # noqa: E402
from gpu_timing import median_ms, read_gbps  # noqa: E402

from runtime.kernels import decode_attention_launch, write_kv_launch  # noqa: E402
from runtime.kernels.formats import kernel_format, meta_strides, scale_tensors  # noqa: E402
from runtime.kernels.gluon_operands import K_W4, MMA, V_W4  # noqa: E402
from runtime.kernels.gluon_tiles import _allocate_ring, _copy_tile, _fill_ring, _page, _ring_metas  # noqa: E402
from runtime.kernels.group_io import _program_tokens  # noqa: E402


@gluon.jit
def _ring_read(K, V, KS, VS, BT, SEQ, OUT, tokens_per_split, stride_btb, stride_cb, stride_ch, stride_ct, stride_mb,
               stride_mh, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, SCALE_MODE: gl.constexpr,
               SPIN: gl.constexpr):
    b, kvh, sp, start, end = _program_tokens(SEQ, tokens_per_split)
    tk = gl.arange(0, 16, layout=gl.SliceLayout(1, K_W4))
    koffs = tk[:, None] * stride_ct + gl.arange(0, 16, layout=gl.SliceLayout(0, K_W4))[None, :]
    ts = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    bt_row = BT + b * stride_btb
    k_ring, v_ring, metas = _allocate_ring(K, V, KS, VS, KS, VS, stride_mb, stride_mh, STAGES, SCALE_MODE, False)
    ahead, page = _fill_ring(start, end, bt_row, K, V, k_ring, v_ring, kvh, stride_cb, stride_ch, stride_ct, koffs, metas,
                             STAGES - 1, BLOCK_SIZE, SCALE_MODE, False, True)
    stage = 0
    acc_k = gl.zeros([16, 16], gl.int32, layout=K_W4)
    acc_v = gl.zeros([16, 16], gl.int32, layout=V_W4)
    acc_s = gl.zeros([16, 8], gl.float32, layout=MMA)
    for n0 in range(start, end, 16):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        _copy_tile(ahead, page, K, V, k_ring, v_ring, (stage + STAGES - 1) % STAGES, kvh, stride_cb, stride_ch,
                   stride_ct, koffs, metas, BLOCK_SIZE, SCALE_MODE, False)
        ahead += 16
        page = _page(bt_row, ahead, end, BLOCK_SIZE, True)
        acc_k ^= k_ring.index(stage).load(K_W4)
        acc_v ^= v_ring.index(stage).load(V_W4)
        x = acc_s + 1.0
        if SCALE_MODE == 3:
            ks, vs, _, _ = _ring_metas(n0, end, metas, stage, ts, SCALE_MODE, False)
            x += (ks + vs)[:, None]
        for _ in range(SPIN):  # a dependent chain: the attention's latency without its instructions
            x = x * 0.999 + 1e-3
        acc_s = x
        stage = (stage + 1) % STAGES
    async_copy.wait_group(0)
    total = gl.sum(gl.sum(acc_k, 1), 0) + gl.sum(gl.sum(acc_v, 1), 0) + gl.sum(gl.sum(acc_s, 1), 0).to(gl.int32)
    gl.store(OUT + (b * gl.num_programs(1) + kvh) * gl.num_programs(2) + sp, total)


def ring_read(case: kb.Case, cache, splits: int, stages: int, spin: int, out: torch.Tensor) -> None:
    kf = kernel_format(cache)
    kw, vw = cache.k.view(torch.int32), cache.v.view(torch.int32)
    ks, vs, _, _ = scale_tensors(cache, cache.k)
    _ring_read[(case.batch, case.kv_heads, splits)](
        kw, vw, ks, vs, case.block_tables, case.seq_lens, out, case.ctx // splits, case.block_tables.stride(0),
        kw.stride(0), kw.stride(1), kw.stride(2), *meta_strides(kf, cache),
        BLOCK_SIZE=kb.BLOCK_SIZE, STAGES=stages, SCALE_MODE=kf.scale_mode, SPIN=spin, num_warps=1, maxnreg=128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="16x32768,64x32768")
    ap.add_argument("--stages", default="2,3,4,6")
    ap.add_argument("--spins", default="0,64,128")
    ap.add_argument("--splits", type=int, default=16)
    ap.add_argument("--model", default="llama3-8b", choices=list(kb.GEOMETRIES))
    args = ap.parse_args()
    res = []
    for shape in args.shapes.split(","):
        batch, ctx = map(int, shape.split("x"))
        case = kb.Case(args.model, batch, ctx)
        for name in ("int4", "int4-tok"):
            fmt = kb.FORMATS[name]
            cache = case.cache(fmt)
            write_kv_launch(cache, case.k, case.v, case.slots)
            nbytes = case.kv_bytes(fmt)
            same = read_gbps(nbytes)
            kernel_ms = median_ms(partial(decode_attention_launch, case.q, cache, case.block_tables, case.seq_lens,
                                          case.sm_scale))
            row = dict(model=args.model, shape=shape, format=name, bytes=nbytes, same_size_gbps=same, kernel_ms=kernel_ms,
                       kernel_pct_same=100 * nbytes / kernel_ms / 1e6 / same)
            print(row, flush=True)
            out = torch.empty(case.batch * case.kv_heads * args.splits, dtype=torch.int32, device="cuda")
            for stages in map(int, args.stages.split(",")):
                for spin in map(int, args.spins.split(",")):
                    ms = median_ms(partial(ring_read, case, cache, args.splits, stages, spin, out))
                    r = dict(row, stages=stages, spin=spin, ring_ms=ms, ring_pct_same=100 * nbytes / ms / 1e6 / same)
                    res.append(r)
                    print(f"  {shape} {name} stages {stages} spin {spin}: {ms:.4f} ms, "
                          f"{r['ring_pct_same']:.0f}% of the same-size read (kernel {row['kernel_pct_same']:.0f}%)",
                          flush=True)
            del cache
            torch.cuda.empty_cache()
        del case
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ring_read.jsonl").write_text("".join(json.dumps(r) + "\n" for r in res))


if __name__ == "__main__":
    main()
