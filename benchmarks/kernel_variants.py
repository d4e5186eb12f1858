"""Side-by-side timing of kernel plans at one shape (GPU machine), for choosing defaults.

    python -m benchmarks.kernel_variants --out DIR [--shape 16x32768] [--formats int8,fp8_e4m3] \
        --variants "default;splits=8;kernel=triton;kernel=gluon,stages=4,pairs=1,tma=1"
    python -m benchmarks.kernel_variants --write --out DIR --variants "default;lanes=0,packed=0"

A variant is the default plan (runtime.kernels.decode_plan / write_plan) changed with `dataclasses.replace`:
`field=value` pairs of DecodePlan (or, with --write, WritePlan) fields separated by commas, variants by `;`;
`kernel=gluon` / `kernel=triton` start from that kernel family's plan instead of the default one. Every decode
variant is timed in the same run as cuDNN SDPA on dense BF16 KV and checked against an fp32 attention over the
dequantized cache; every write variant's bytes must equal the default plan's. Rows go to
DIR/kernel_variants.jsonl (DIR/write_variants.jsonl). On CPU (TRITON_INTERPRET=1, tiny --shape) it checks the
variants only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from functools import partial
from pathlib import Path

import torch

from benchmarks import kernels as kb
from benchmarks.gpu_timing import FLUSH_MODES, ceilings, median_ms
from runtime.kernels import DecodePlan, WritePlan, decode_attention, decode_plan, write_kv, write_plan


def parse_variant(text: str, plan_type: type) -> tuple[str | None, dict]:
    """'kernel=gluon,stages=4,pairs=1' -> ("gluon", {"stages": 4, "pairs": True}) for DecodePlan; 'default' -> {}."""
    family, changes = None, {}
    types = {f.name: f.type for f in dataclasses.fields(plan_type)}
    for part in filter(None, text.split(",")):
        if part == "default":
            continue
        key, _, value = part.partition("=")
        if key == "kernel" and value in ("gluon", "triton"):
            family = value
        elif key not in types:
            raise SystemExit(f"variant {text!r}: {key!r} is not a {plan_type.__name__} field "
                             f"({', '.join(types)})")
        elif "bool" in str(types[key]):
            changes[key] = value in ("1", "true", "True")
        elif value in ("None", "none"):
            changes[key] = None
        else:
            changes[key] = value if key == "kernel" else int(value)
    return family, changes


def decode_variant(case: kb.Case, cache, text: str) -> DecodePlan:
    family, changes = parse_variant(text, DecodePlan)
    plan = decode_plan(cache.fmt, case.batch, case.heads, case.kv_heads, case.block_tables.shape[1] * kb.BLOCK_SIZE,
                       case.q.device, head_dim=case.head_dim, block_size=kb.BLOCK_SIZE, q_dtype=case.q.dtype,
                       kernel=family)
    return dataclasses.replace(plan, **changes)


def make_case(args) -> kb.Case:
    """The --model / --shape / --block-size case every mode runs on."""
    batch, ctx = (int(x) for x in args.shape.split("x"))
    kb.BLOCK_SIZE = args.block_size
    if not torch.cuda.is_available():
        kb.DEVICE = "cpu"
    return kb.Case(args.model, batch, ctx)


def decode_variants(args) -> None:
    cpu = not torch.cuda.is_available()
    case = make_case(args)
    sdpa_ms, backend = (float("nan"), "none") if cpu else case.sdpa_ms()
    print(f"{args.model} {args.shape} page {args.block_size}: SDPA[{backend}] {sdpa_ms:.3f} ms", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "kernel_variants.jsonl", "a") as sink:
        for name in args.formats.split(","):
            fmt = kb.FORMATS[name]
            cache = case.cache(fmt)
            write_kv(cache, case.k, case.v, case.slots)
            ref = case.reference(cache)
            for var in args.variants.split(";"):
                plan = decode_variant(case, cache, var)
                fn = partial(decode_attention, case.q, cache, case.block_tables, case.seq_lens, case.sm_scale,
                             plan=plan)
                try:
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    ms = float("nan") if cpu else median_ms(fn, flush=kb.FLUSH)
                except Exception as e:  # a plan that does not fit or compile: say so, go on
                    print(f"  {name:14s} {var:24s} {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                kvb = case.kv_bytes(fmt)
                row = {"model": args.model, "batch": case.batch, "ctx": case.ctx, "block_size": args.block_size,
                       "format": name, "variant": var, "plan": dataclasses.asdict(plan), "ms": ms,
                       "gbps": kvb / ms / 1e6, "sdpa_ms": sdpa_ms, "speedup": sdpa_ms / ms, "relerr_vs_fp32": err,
                       "flush": kb.FLUSH}
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                print(f"  {name:14s} {var:24s} {ms:.4f} ms {row['gbps']:6.0f} GB/s x{row['speedup']:.2f} "
                      f"err={err:.2e} {kb.plan_text(plan)}", flush=True)
            del cache
            if not cpu:
                torch.cuda.empty_cache()


def write_variants(args) -> None:
    """Write-kernel GB/s (bf16 K/V read + cache bytes written) per variant, against the same run's device copy;
    every variant's pages and scales must equal the default plan's, byte for byte."""
    cpu = not torch.cuda.is_available()
    case = make_case(args)
    copy = float("nan") if cpu else ceilings()["copy_gbps"]
    print(f"{args.model} {args.shape}: copy {copy:.0f} GB/s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "write_variants.jsonl", "a") as sink:
        for name in args.formats.split(","):
            fmt = kb.FORMATS[name]
            ref = case.cache(fmt)
            write_kv(ref, case.k, case.v, case.slots)
            moved = case.write_bytes(fmt)
            default = write_plan(fmt, case.k.shape[0], case.kv_heads, case.k.device, head_dim=case.head_dim,
                                 k_dtype=case.k.dtype)
            for var in args.variants.split(";"):
                _, changes = parse_variant(var, WritePlan)
                plan = dataclasses.replace(default, **changes)
                cache = case.cache(fmt)
                fn = partial(write_kv, cache, case.k, case.v, case.slots, plan=plan)
                try:
                    fn()
                except ValueError as e:  # a plan that does not fit this format
                    print(f"  {name:14s} {var:24s} {e}", flush=True)
                    continue
                same = all(torch.equal(getattr(cache, f).reshape(-1).view(torch.uint8),
                                       getattr(ref, f).reshape(-1).view(torch.uint8))
                           for f in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero") if getattr(ref, f) is not None)
                ms = float("nan") if cpu else median_ms(fn, flush=kb.FLUSH)
                row = {"model": args.model, "batch": case.batch, "ctx": case.ctx, "format": name, "variant": var,
                       "plan": dataclasses.asdict(plan), "ms": ms, "gbps": moved / ms / 1e6, "copy_gbps": copy,
                       "pct_copy": 100 * moved / ms / 1e6 / copy, "bytes_equal_default": same, "flush": kb.FLUSH}
                sink.write(json.dumps(row) + "\n")
                print(f"  {name:14s} {var:24s} {ms:.4f} ms {row['gbps']:6.0f} GB/s {row['pct_copy']:4.0f}% "
                      f"of copy {'same bytes' if same else 'BYTES DIFFER'}", flush=True)
                del cache
            del ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="16x32768")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--block-size", type=int, default=kb.BLOCK_SIZE, help="tokens per KV page")
    ap.add_argument("--formats", default="bf16,int8,fp8_e4m3,int4,int8-tok,int4-tok-asym,fp8_e4m3-tok")
    ap.add_argument("--variants", default="default", help="';'-separated plan changes (module docstring)")
    ap.add_argument("--write", action="store_true", help="vary the write kernel's plan instead")
    ap.add_argument("--flush", default=kb.FLUSH, choices=FLUSH_MODES, help="how L2 is emptied before each timed call")
    args = ap.parse_args()
    kb.FLUSH = args.flush
    (write_variants if args.write else decode_variants)(args)


if __name__ == "__main__":
    main()
