"""The kernels' tuned data (runtime/kernels/tuned/<device>.json): print and check it, or measure it anew on a GPU.

    python -m benchmarks.tune --print                                   # any machine: the table, checked
    python -m benchmarks.tune --out runtime/kernels/tuned/nvidia_h200.json [--model llama3-8b --shape 16x32768]

Measuring starts from the file the device uses now (its own, else the H200's) and, per KV format, tries each
tuned field's candidates in turn (a coordinate search) at one shape: the decode plan's fields of the kernel the
format runs there (Gluon: register caps, mma chains, rescale skipping, int32 offsets; the Triton kernels: tile,
stages, register cap) and the write plan's rows. A candidate replaces the current value where it is faster by more
than --margin (default 1%) in the same run, timed as benchmarks/kernels.py times (CUDA graph, L2 emptied), and
its output must stay within the fp32 reference's tolerance (decode) or equal the current bytes (write). The file
is written whole, atomically, with the device's name. Shape-dependent rules (runtime/kernels/tuning.py) are not
tuned here: benchmarks/kernel_variants.py times plans at other shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from functools import partial
from pathlib import Path

import torch

from benchmarks import kernels as kb
from benchmarks.gpu_timing import median_ms
from runtime.kernels import decode_attention, decode_plan_for, write_kv, write_plan
from runtime.kernels.tuned_file import DEVICE_H200, TunedFile, device_of, tuned_for_device

# decode field -> (the DecodePlan field it sets, candidates), for the kernel the format runs
GLUON_FIELDS = {"registers": ("registers", (0, 120, 128)), "ring_registers": ("registers", (0, 120, 128)),
                "k_chains": ("k_chains", (1, 2)), "skip_rescale": ("skip_rescale", (False, True)),
                "offsets32": ("offsets32", (False, True))}
TRITON_FIELDS = {"block_n": ("block_n", (16, 64, 128)), "num_stages": ("num_stages", (2, 3, 4)),
                 "tile_registers": ("registers", (0, 128))}
WRITE_FIELDS = {"lanes": (0, 2, 4, 8), "packed": (False, True)}


def print_table(tuned: TunedFile) -> None:
    print(f"{tuned.device}: {len(tuned.formats)} formats; prefill tiles {tuned.prefill}")
    for name, entry in tuned.formats.items():
        d, w = entry.decode, entry.write
        kernel = "gluon" if d.gluon else "warps" if d.warps else "tiles"
        print(f"  {name:22s} {kernel:5s} regs={d.registers}/{d.ring_registers} kc={d.k_chains} "
              f"skip={int(d.skip_rescale)} off32={int(d.offsets32)} | triton n={d.block_n} stages={d.num_stages} "
              f"regs={d.tile_registers} res={d.resident_per_sm} fp16={int(d.dot_fp16)} pscale={int(d.p_scale)} "
              f"headsN={int(d.heads_n)} asm={int(d.int8_asm)} | write lanes={w.lanes} packed={int(w.packed)}")


def _timed(fn, check) -> float | None:
    """fn's median time, or None where it fails or `check` rejects its output."""
    try:
        if not check(fn()):
            return None
        return median_ms(fn, flush=kb.FLUSH)
    except Exception as e:  # a candidate that does not fit or compile
        print(f"    {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None


def tune_decode(case: kb.Case, cache, entry: dict, margin: float) -> dict:
    ref = case.reference(cache)
    ok = lambda out: ((out.float() - ref).norm() / ref.norm()).item() < 0.02  # noqa: E731  (quantized: ~1e-2)
    base = decode_plan_for(case.q, cache, case.block_tables)
    fields = GLUON_FIELDS if base.kernel == "gluon" else TRITON_FIELDS
    if base.kernel == "gluon":  # the cap the plan took is one of the two
        fields = {k: v for k, v in fields.items() if k != ("ring_registers" if not base.stages else "registers")}
    plan = base
    best = _timed(partial(decode_attention, case.q, cache, case.block_tables, case.seq_lens, case.sm_scale,
                          plan=plan), ok)
    for field, (plan_field, candidates) in fields.items():
        for value in candidates:
            plan_value = (value or None) if plan_field == "registers" else value  # a cap of 0: none
            trial = dataclasses.replace(plan, **{plan_field: plan_value})
            ms = _timed(partial(decode_attention, case.q, cache, case.block_tables, case.seq_lens, case.sm_scale,
                                plan=trial), ok)
            print(f"    decode {field}={value}: {ms}", flush=True)
            if ms is not None and best is not None and ms < best * (1 - margin):
                best, plan, entry["decode"][field] = ms, trial, value
    return entry


def tune_write(case: kb.Case, fmt, entry: dict, margin: float) -> dict:
    ref = case.cache(fmt)
    write_kv(ref, case.k, case.v, case.slots)
    plan = write_plan(fmt, case.k.shape[0], case.kv_heads, case.k.device, head_dim=case.head_dim,
                      k_dtype=case.k.dtype)

    def run(p):
        cache = case.cache(fmt)
        return partial(write_kv, cache, case.k, case.v, case.slots, plan=p), cache

    def same(cache):
        return all(torch.equal(getattr(cache, f).view(torch.uint8), getattr(ref, f).view(torch.uint8))
                   for f in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero") if getattr(ref, f) is not None)

    fn, cache = run(plan)
    best = _timed(fn, lambda _: same(cache))
    for field, candidates in WRITE_FIELDS.items():
        for value in candidates:
            trial = dataclasses.replace(plan, **{field: value})
            fn, cache = run(trial)
            ms = _timed(fn, lambda _, c=cache: same(c))
            print(f"    write {field}={value}: {ms}", flush=True)
            if ms is not None and best is not None and ms < best * (1 - margin):
                best, plan, entry["write"][field] = ms, trial, value
    return entry


def write_atomically(path: Path, data: dict) -> None:
    TunedFile.from_dict(data)  # what is written must load
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--print", action="store_true", help="print the tuned data the GPU here (else the H200) uses")
    ap.add_argument("--out", default="", help="measure and write this file (GPU)")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--shape", default="16x32768")
    ap.add_argument("--formats", default=",".join(kb.FORMATS), help="benchmarks/kernels.py format names")
    ap.add_argument("--margin", type=float, default=0.01)
    args = ap.parse_args()
    device = device_of("cuda") if torch.cuda.is_available() else DEVICE_H200
    current = tuned_for_device(device)
    if args.print or not args.out:
        print_table(current)
        return
    if not torch.cuda.is_available():
        raise SystemExit("measuring the tuned data needs a GPU; --print checks and prints it anywhere")
    data = current.to_dict()
    data["device"] = device.name
    batch, ctx = (int(x) for x in args.shape.split("x"))
    case = kb.Case(args.model, batch, ctx)
    for name in args.formats.split(","):
        fmt = kb.FORMATS[name]
        print(f"{fmt.name} at {args.model} {args.shape}", flush=True)
        cache = case.cache(fmt)
        write_kv(cache, case.k, case.v, case.slots)
        entry = tune_decode(case, cache, data["formats"][fmt.name], args.margin)
        data["formats"][fmt.name] = tune_write(case, fmt, entry, args.margin)
        del cache
        torch.cuda.empty_cache()
    write_atomically(Path(args.out), data)
    print_table(TunedFile.from_dict(data))


if __name__ == "__main__":
    main()
