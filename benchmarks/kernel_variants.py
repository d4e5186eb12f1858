"""Side-by-side timing of decode-kernel variants at one shape (GPU machine), for choosing defaults.

    python3 benchmarks/kernel_variants.py --out DIR [--shape 16x32768] [--formats int8,fp8_e4m3]

Each variant is a set of `decode_attention_launch` options (dot dtype, widening path, where
the V scale goes, operand order, tile); every one is timed in the same run as cuDNN SDPA on
dense BF16 KV and checked against an fp32 attention over the dequantized cache. Rows go to
DIR/kernel_variants.jsonl. On CPU (TRITON_INTERPRET=1, tiny --shape) it checks the variants only.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels as kb  # noqa: E402  (benchmarks/kernels.py: shapes, formats, the fp32 reference)
from gpu_timing import FLUSH_MODES, ceilings, median_ms  # noqa: E402

from runtime.kernels import decode_attention_launch, write_kv_launch  # noqa: E402

# name -> launch options. Rounds 1-3 (results/kernel_variants_round*.jsonl) also timed options
# since removed from the kernel: V pages stored dim-major (2-3x slower), an int8 -> fp16
# magic-number widening in PTX (slower than Triton's own), and runs that left V out.
VARIANTS = {
    "default": {},
    "cvt0": dict(cvt_early=False),
    "cvt1": dict(cvt_early=True),
    "bf16dot": dict(dot_fp16=False),
    "f16-cvt0": dict(dot_fp16=True, cvt_early=False),
    "f16-cvt1": dict(dot_fp16=True, cvt_early=True),
    "f16-cvt0-n128": dict(dot_fp16=True, cvt_early=False, block_n=128),
    "f16-cvt0-s3": dict(dot_fp16=True, cvt_early=False, num_stages=3),
    "f16-cvt0-pscale": dict(dot_fp16=True, cvt_early=False, p_scale=True),
    "f16-cvt1-pscale": dict(dot_fp16=True, cvt_early=True, p_scale=True),
    "n64": dict(block_n=64),
    "n64-s3": dict(block_n=64, num_stages=3),
    "n128": dict(block_n=128),
    "swap": dict(swap=True),
    "r128": dict(maxnreg=128),
    "r128-sp8": dict(maxnreg=128, num_splits=8),
    "sp8": dict(num_splits=8),
    "n64-r128": dict(block_n=64, maxnreg=128),
    "n64-r128-sp8": dict(block_n=64, maxnreg=128, num_splits=8),
    "n64-r96": dict(block_n=64, maxnreg=96),
    "n64-r96-sp8": dict(block_n=64, maxnreg=96, num_splits=8),
    "n64-s3-r128": dict(block_n=64, num_stages=3, maxnreg=128),
    "n64-s3-r128-sp8": dict(block_n=64, num_stages=3, maxnreg=128, num_splits=8),
    "swap-f16-cvt0": dict(swap=True, dot_fp16=True, cvt_early=False),
    "swap-f16-cvt1": dict(swap=True, dot_fp16=True, cvt_early=True),
    "swap-f16-n128": dict(swap=True, dot_fp16=True, cvt_early=False, block_n=128),
    "swap-f16-s3": dict(swap=True, dot_fp16=True, cvt_early=False, num_stages=3),
    "swap-f16-pscale": dict(swap=True, dot_fp16=True, cvt_early=False, p_scale=True),
    # the one-softmax-state-per-warp kernel (decode_warps.py): tokens per tile / warps = per warp
    # ("w-": heads on M, said explicitly since the per-warp defaults put heads on N)
    "w-n64": dict(warps=True, heads_n=False, block_n=64),
    "w-n64-s3": dict(warps=True, heads_n=False, block_n=64, num_stages=3),
    "w-n64-r128": dict(warps=True, heads_n=False, block_n=64, maxnreg=128),
    # heads on M without the 8-bit formats' register cap (maxnreg=0): 167 registers, no spills,
    # K and V both through cp.async (SASS)
    "w-n64-nocap": dict(warps=True, heads_n=False, block_n=64, maxnreg=0),
    "w-n64-s3-nocap": dict(warps=True, heads_n=False, block_n=64, num_stages=3, maxnreg=0),
    "w-n64-s4-nocap": dict(warps=True, heads_n=False, block_n=64, num_stages=4, maxnreg=0),
    "w-n128-nocap": dict(warps=True, heads_n=False, block_n=128, maxnreg=0),
    "wN-n64-nocap": dict(warps=True, heads_n=True, block_n=64, maxnreg=0),
    # the same at forced split counts: 167 registers hold 3 programs per SM, not the 4 the
    # default split rule assumes for these formats
    **{f"w-n64{s}-nocap-sp{n}": dict(warps=True, heads_n=False, block_n=64, maxnreg=0, num_splits=n,
                                    **({"num_stages": 3} if s else {}))
       for s in ("", "-s3") for n in (1, 2, 3, 6)},
    **{f"w-n128-nocap-sp{n}": dict(warps=True, heads_n=False, block_n=128, maxnreg=0, num_splits=n) for n in (1, 3)},
    # heads on M at 2-5 stages (with the pages loaded a tile ahead the pipeline really buffers
    # num_stages - 1 tiles; before, every stage count compiled to one buffer) and forced splits
    **{f"w-n64-s{s}{'-sp%d' % n if n else ''}": dict(warps=True, heads_n=False, block_n=64, maxnreg=0,
                                                   num_stages=s, **({"num_splits": n} if n else {}))
       for s in (2, 3, 4, 5) for n in (0, 2, 3, 4, 6, 8, 12)},
    # ... and capped at 128 registers: 4 programs per SM (a 32-56 byte spill; sm_90 compile)
    **{f"w-n64-s{s}-r128{'-sp%d' % n if n else ''}": dict(warps=True, heads_n=False, block_n=64, maxnreg=128,
                                                        num_stages=s, **({"num_splits": n} if n else {}))
       for s in (2, 3) for n in (0, 4)},
    "w-n128": dict(warps=True, heads_n=False, block_n=128),
    "w8-n128": dict(warps=True, heads_n=False, block_n=128, num_warps=8),
    "w-n64-sp8": dict(warps=True, heads_n=False, block_n=64, num_splits=8),
    "wN-n64": dict(warps=True, heads_n=True, block_n=64),
    "wN-n64-s3": dict(warps=True, heads_n=True, block_n=64, num_stages=3),
    "wN-n64-r128": dict(warps=True, heads_n=True, block_n=64, maxnreg=128),
    # one block-table read per token instead of per warp (the fifth session's warp_page off)
    "d-nowp": dict(warp_page=False),
    # block-table entries in the same iteration as their K/V (pages_ahead off: one pipeline buffer)
    "d-nopa": dict(pages_ahead=False),
    # per-token formats on heads on M with this session's pipeline options (p scaled, 153-155 registers)
    "wT-s3": dict(warps=True, heads_n=False, block_n=64, maxnreg=0, num_stages=3, pages_ahead=True, warp_page=True),
    "wT-s3-sp3": dict(warps=True, heads_n=False, block_n=64, maxnreg=0, num_stages=3, pages_ahead=True,
                      warp_page=True, num_splits=3),
    "wN-n64-s3-r128": dict(warps=True, heads_n=True, block_n=64, num_stages=3, maxnreg=128),
    "wN-n64-s4-r128": dict(warps=True, heads_n=True, block_n=64, num_stages=4, maxnreg=128),
    # the heads x tokens kernel at more stages (pages a tile ahead: num_stages - 1 real buffers)
    **{f"c-n{n}-s{s}{'-r128' if r else ''}": dict(warps=False, block_n=n, num_stages=s, maxnreg=r)
       for n in (64, 128) for s in (2, 3, 4) for r in (0, 128)},

    "wN-n128": dict(warps=True, heads_n=True, block_n=128),
    "wN8-n128": dict(warps=True, heads_n=True, block_n=128, num_warps=8),
    "wN-n64-sp8": dict(warps=True, heads_n=True, block_n=64, num_splits=8),
    "wN-n64-sp4": dict(warps=True, heads_n=True, block_n=64, num_splits=4),
    "wN-n64-sp2": dict(warps=True, heads_n=True, block_n=64, num_splits=2),
    "wN-n64-sp1": dict(warps=True, heads_n=True, block_n=64, num_splits=1),
    "sp1": dict(num_splits=1),
    "sp2": dict(num_splits=2),
    # the shipped defaults with a forced split count ("d-": stays on the default kernel)
    "d-sp1": dict(num_splits=1),
    "d-sp2": dict(num_splits=2),
    "d-sp8": dict(num_splits=8),
    "d-sp64": dict(num_splits=64),
    # int8 widened in PTX (widen_ptx.widen_asm; fp16 dots)
    "wN-n64-asm": dict(warps=True, heads_n=True, block_n=64, dot_fp16=True, int8_asm=True),
    "wN-n64-asm-r128": dict(warps=True, heads_n=True, block_n=64, dot_fp16=True, int8_asm=True, maxnreg=128),
    "w-n128-asm": dict(warps=True, heads_n=False, block_n=128, dot_fp16=True, int8_asm=True),
    "wN-n64-asm-sp8": dict(warps=True, heads_n=True, block_n=64, dot_fp16=True, int8_asm=True, num_splits=8),
    "wN-n64-asm-s3-sp8": dict(warps=True, heads_n=True, block_n=64, dot_fp16=True, int8_asm=True, num_stages=3,
                              num_splits=8),
    "wN-n64-r128-sp8": dict(warps=True, heads_n=True, block_n=64, maxnreg=128, num_splits=8),
    "w-n128-r128-sp8": dict(warps=True, heads_n=False, block_n=128, maxnreg=128, num_splits=8),
    "wN-n64-f16-r128-sp8": dict(warps=True, heads_n=True, block_n=64, dot_fp16=True, maxnreg=128, num_splits=8),
    "f16-asm": dict(dot_fp16=True, int8_asm=True, cvt_early=False),
    "f16-asm-cvt1": dict(dot_fp16=True, int8_asm=True, cvt_early=True),
    # one-warp programs (16-token tiles): the warp's softmax state is the program's, no cross-warp
    # merge; 12 fit an SM by registers (168 each), so the split rule counts 12 resident, not 3
    **{f"w1-n16-s{st}{'-sp%d' % n if n else ''}": dict(warps=True, heads_n=False, block_n=16, maxnreg=0,
                                                       num_stages=st, resident_per_sm=12,
                                                       **({"num_splits": n} if n else {}))
       for st in (3, 4, 6) for n in (0, 8, 12, 16, 64, 128, 256)},
    # ... for the per-token formats (heads on M, p scaled, pages a tile ahead, one page per warp)
    **{f"w1T-s{st}": dict(warps=True, heads_n=False, block_n=16, maxnreg=0, num_stages=st, resident_per_sm=12,
                          pages_ahead=True, warp_page=True) for st in (2, 3, 4)},
    # ... and with heads on N (the asymmetric per-token formats' 4-warp layout), uncapped: 167-209 registers
    **{f"w1N-s{st}": dict(warps=True, heads_n=True, block_n=16, maxnreg=0, num_stages=st, resident_per_sm=12,
                          pages_ahead=True, warp_page=True) for st in (2, 3)},
    # the round-9 defaults of fp8 / int8 / int4 per-head (4 warps x 16 tokens, 3 resident per SM)
    "w4-n64-s3": dict(warps=True, heads_n=False, block_n=64, maxnreg=0, num_stages=3, resident_per_sm=3),
    # the Gluon kernel (decode_gluon.py) with the launcher's choices; other "g-..." names are parsed by
    # `gluon_variant` (g-st2-r96-sp20: a 2-stage ring, 96 registers, 20 splits)
    "g": dict(gluon=True),
    "t": dict(gluon=False),
}
GLUON_KEYS = {"st": "gluon_stages", "r": "maxnreg", "sp": "num_splits", "res": "resident_per_sm", "pr": "gluon_pairs",
               "kc": "gluon_k_chains", "tma": "gluon_tma"}


def gluon_variant(name: str) -> dict:
    """Launch options of a Gluon variant named g-<key><int>-...: st (ring stages, 0: registers), r (register
    cap, 0: none), sp (splits), res (programs per SM for the split rule), pr (int4 ring tiles two a step: 1, or
    one: 0), kc (the scores' independent mma chains: 1, 2, 4), tma (the ring's words by TMA: 1, and scales: 2, cp.async: 0);
    skip / noskip (softmax
    rescale)."""
    opts = dict(gluon=True)
    for part in name.split("-")[1:]:
        if part in ("skip", "noskip"):
            opts["gluon_skip_rescale"] = part == "skip"
            continue
        key = part.rstrip("0123456789")
        if key not in GLUON_KEYS or key == part:
            raise ValueError(f"variant {name!r}: {part!r} is not one of {sorted(GLUON_KEYS)} followed by a number")
        value = int(part[len(key):])
        opts[GLUON_KEYS[key]] = bool(value) if key == "pr" else value
    return opts


def variant_options(name: str) -> dict:
    if name not in VARIANTS and name.startswith("g-"):
        return gluon_variant(name)
    # named variants of the query-heads x tokens kernel stay on it whatever the defaults
    opts = VARIANTS[name]
    return opts if name in ("default", "t") or name.startswith(("w", "d-", "g")) else {"warps": False, **opts}


PER_TOKEN_ONLY = {"f16-cvt0-pscale", "f16-cvt1-pscale", "swap-f16-pscale"}


def make_case(args) -> kb.Case:
    """The --model / --shape / --block-size case every mode runs on."""
    batch, ctx = (int(x) for x in args.shape.split("x"))
    kb.BLOCK_SIZE = args.block_size
    return kb.Case(args.model, batch, ctx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="16x32768")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--block-size", type=int, default=kb.BLOCK_SIZE, help="tokens per KV page")
    ap.add_argument("--formats", default="bf16,int8,fp8_e4m3,int4,int8-tok,int4-tok-asym,fp8_e4m3-tok")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile", default="", help="FORMAT:VARIANT: only launch it 3 times (run under ncu)")
    ap.add_argument("--write", action="store_true", help="time the write kernel's variants instead (WRITE_VARIANTS)")
    ap.add_argument("--flush", default=kb.FLUSH, choices=FLUSH_MODES, help="how L2 is emptied before each timed call")
    args = ap.parse_args()
    kb.FLUSH = args.flush
    if args.profile:
        profile(args, *args.profile.split(":"))
        return
    if args.write:
        write_variants(args)
        return
    cpu = not torch.cuda.is_available()
    if cpu:
        kb.DEVICE = "cpu"
    case = make_case(args)
    batch, ctx = case.batch, case.ctx
    sdpa_ms, backend = (float("nan"), "none") if cpu else case.sdpa_ms()
    print(f"{args.model} {batch}x{ctx} page {args.block_size}: SDPA[{backend}] {sdpa_ms:.3f} ms", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "kernel_variants.jsonl", "a") as sink:
        for name in args.formats.split(","):
            fmt = kb.FORMATS[name]
            cache = case.cache(fmt)
            write_kv_launch(cache, case.k, case.v, case.slots)
            ref = case.reference(cache)
            for var in args.variants.split(","):
                opts = variant_options(var)
                if var in PER_TOKEN_ONLY and not fmt.dynamic:
                    continue
                if not fmt.quantized and not var.startswith(("w", "d-", "c-")) and var not in ("default", "swap", "sp8", "n64-s3-r128", "n64-s3-r128-sp8"):
                    continue
                fn = partial(decode_attention_launch, case.q, cache, case.block_tables, case.seq_lens, case.sm_scale, **opts)
                try:
                    o = fn()
                    err = ((o.float() - ref).norm() / ref.norm()).item()
                    ms = float("nan") if cpu else median_ms(fn, flush=kb.FLUSH)
                except Exception as e:  # a variant that does not compile: say so, go on
                    print(f"  {name:14s} {var:16s} {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                kvb = case.kv_bytes(fmt)
                row = {"model": args.model, "batch": batch, "ctx": ctx, "block_size": args.block_size,
                       "format": name, "variant": var,
                       "opts": opts, "ms": ms, "gbps": kvb / ms / 1e6, "sdpa_ms": sdpa_ms,
                       "speedup": sdpa_ms / ms, "relerr_vs_fp32": err, "flush": kb.FLUSH}
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                print(f"  {name:14s} {var:16s} {ms:.4f} ms {row['gbps']:6.0f} GB/s x{row['speedup']:.2f} err={err:.2e}",
                      flush=True)
            del cache
            if not cpu:
                torch.cuda.empty_cache()


# write kernel: launch options; "default" = the launcher's choice (int4: rows over 8 lanes, 16 tokens x 4
# warps, or per-token 4 lanes packed; other formats 16 tokens x 2 warps; GPU arithmetic), "tile" = int4 on
# the [tokens, head_dim] tile of the other formats (the default before the tenth session), "div_rn" = the
# interpreter's arithmetic (a division per value, round by adding 1.5 * 2**23).
# "lN": int4 rows over N lanes (write_kv's int4_lanes: the clamp before the division, word stores;
# other formats ignore it, so there it times the default again); "lNp": and int4_packed (bf16x2 row
# min / max and symmetric clamp; per-token fp16-scale formats with bf16 input, else the same as "lN");
# "rN": int8 per-token formats (fp16 scales, bf16 input) with rows over N lanes as "lNp" does for int4,
# stored as bytes (0: the tile); others ignore it.
# "-tXwY": with X tokens x Y warps per program (lanes x tokens = 32 x warps gives each thread one
# row's 128 / N values, no idle lanes)
WRITE_VARIANTS = {"default": {}, "tile": dict(int4_lanes=0, int4_packed=False),
                  "div_rn": dict(fast=False), "t8w4": dict(block_t=8, num_warps=4),
                  "t16w2": dict(block_t=16, num_warps=2), "t32w4": dict(block_t=32, num_warps=4),
                  "t32w8": dict(block_t=32, num_warps=8), "t64w8": dict(block_t=64, num_warps=8),
                  "l4": dict(int4_lanes=4), "l8": dict(int4_lanes=8), "l2": dict(int4_lanes=2),
                  "l4-div_rn": dict(int4_lanes=4, fast=False),
                  "l4-t32w4": dict(int4_lanes=4, block_t=32, num_warps=4),
                  "l4-t8w1": dict(int4_lanes=4, block_t=8, num_warps=1),
                  "l8-t16w4": dict(int4_lanes=8, block_t=16, num_warps=4),
                  "l8-t8w2": dict(int4_lanes=8, block_t=8, num_warps=2),
                  "l2-t32w2": dict(int4_lanes=2, block_t=32, num_warps=2),
                  "l2-t16w1": dict(int4_lanes=2, block_t=16, num_warps=1),
                  "l4p": dict(int4_lanes=4, int4_packed=True), "l8p": dict(int4_lanes=8, int4_packed=True),
                  "l2p": dict(int4_lanes=2, int4_packed=True),
                  "l2p-t32w2": dict(int4_lanes=2, int4_packed=True, block_t=32, num_warps=2),
                  "l4p-t32w4": dict(int4_lanes=4, int4_packed=True, block_t=32, num_warps=4),
                  "l4p-t8w1": dict(int4_lanes=4, int4_packed=True, block_t=8, num_warps=1),
                  "l8p-t16w4": dict(int4_lanes=8, int4_packed=True, block_t=16, num_warps=4),
                  "r0": dict(byte_rows=0), "r2": dict(byte_rows=2), "r4": dict(byte_rows=4),
                  "r8": dict(byte_rows=8), "r4-t32w4": dict(byte_rows=4, block_t=32, num_warps=4),
                  "r2-t32w2": dict(byte_rows=2, block_t=32, num_warps=2)}


def write_variants(args) -> None:
    """Write-kernel GB/s (bf16 K/V read + cache bytes written) per variant, against the same run's
    device copy; every variant's pages and scales must equal the default launch's, byte for byte.
    --variants picks among WRITE_VARIANTS (the decode default list means all of them). On CPU
    (TRITON_INTERPRET=1, tiny --shape) it only compares the bytes (fast=True variants are GPU-only)."""
    names = list(WRITE_VARIANTS) if args.variants == ",".join(VARIANTS) else args.variants.split(",")
    unknown = [v for v in names if v not in WRITE_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown write variants {unknown}; choose from {', '.join(WRITE_VARIANTS)}")
    cpu = not torch.cuda.is_available()
    if cpu:
        kb.DEVICE = "cpu"
    case = make_case(args)
    batch, ctx = case.batch, case.ctx
    copy = float("nan") if cpu else ceilings()["copy_gbps"]
    print(f"{args.model} {batch}x{ctx}: copy {copy:.0f} GB/s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "write_variants.jsonl", "a") as sink:
        for name in args.formats.split(","):
            fmt = kb.FORMATS[name]
            ref = case.cache(fmt)
            write_kv_launch(ref, case.k, case.v, case.slots)
            moved = case.write_bytes(fmt)
            for var in names:
                opts = WRITE_VARIANTS[var]
                if cpu and opts.get("fast"):
                    continue
                cache = case.cache(fmt)
                fn = partial(write_kv_launch, cache, case.k, case.v, case.slots, **opts)
                fn()
                same = all(torch.equal(getattr(cache, f).reshape(-1).view(torch.uint8),
                                       getattr(ref, f).reshape(-1).view(torch.uint8))
                           for f in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero")
                           if getattr(ref, f) is not None)
                ms = float("nan") if cpu else median_ms(fn, flush=kb.FLUSH)
                row = {"model": args.model, "batch": batch, "ctx": ctx, "format": name, "variant": var, "opts": opts,
                       "ms": ms, "gbps": moved / ms / 1e6, "copy_gbps": copy, "pct_copy": 100 * moved / ms / 1e6 / copy,
                       "bytes_equal_default": same, "flush": kb.FLUSH}
                sink.write(json.dumps(row) + "\n")
                print(f"  {name:14s} {var:10s} {ms:.4f} ms {row['gbps']:6.0f} GB/s {row['pct_copy']:4.0f}% "
                      f"of copy {'same bytes' if same else 'BYTES DIFFER'}", flush=True)
                del cache
            del ref
            if not cpu:
                torch.cuda.empty_cache()


def profile(args, fmt_name: str, variant: str) -> None:
    case = make_case(args)
    cache = case.cache(kb.FORMATS[fmt_name])
    write_kv_launch(cache, case.k, case.v, case.slots)
    opts = variant_options(variant)
    for _ in range(3):
        decode_attention_launch(case.q, cache, case.block_tables, case.seq_lens, case.sm_scale, **opts)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
