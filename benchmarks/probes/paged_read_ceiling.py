"""Read bandwidth of chunks in random order (a paged KV cache's access pattern) against the same chunks in order
and the contiguous read ceiling (GPU machine). Measured on the H200: 1 KB chunks (an int4 page of 16 tokens, one
KV head) read at 4308 GB/s against 4272 contiguous, so the page size does not cap int4 decode (docs/kernels.md).

    python -m benchmarks.probes.paged_read_ceiling --out DIR
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.gpu_timing import ceilings, median_ms


@triton.jit
def _gather_xor(X, ORDER, OUT, CHUNK_WORDS: tl.constexpr, PER_PROG: tl.constexpr, NW: tl.constexpr):
    """XOR of PER_PROG chunks (ORDER's entries, CHUNK_WORDS int32 each), four chunks' loads in flight at a time."""
    pid = tl.program_id(0)
    acc = tl.zeros([NW], dtype=tl.int32)
    for i in range(0, PER_PROG, 4):
        for u in tl.static_range(4):
            c = tl.load(ORDER + pid * PER_PROG + i + u).to(tl.int64)
            for j in tl.static_range(CHUNK_WORDS // NW):
                acc ^= tl.load(X + c * CHUNK_WORDS + j * NW + tl.arange(0, NW))
    tl.store(OUT + pid * NW + tl.arange(0, NW), acc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    n = 2 << 30
    x = torch.empty(n // 4, dtype=torch.int32, device="cuda").random_()
    res = {"ceilings": ceilings()}
    per_prog = 64
    for chunk in (512, 1024, 2048, 4096, 8192):
        words, chunks = chunk // 4, n // chunk
        for order in ("random", "linear"):
            idx = torch.randperm(chunks, device="cuda") if order == "random" else torch.arange(chunks, device="cuda")
            idx = idx.to(torch.int32)
            for warps in (1, 4):
                nw = min(words, 128 * warps)
                progs = chunks // per_prog
                out = torch.empty(progs * nw, dtype=torch.int32, device="cuda")
                ms = median_ms(partial(_gather_xor[(progs,)], x, idx, out, words, per_prog, nw, num_warps=warps))
                res[f"{chunk}-{order}-w{warps}"] = n / ms / 1e6
                print(f"{chunk:5d} B {order:6s} {warps} warp(s): {n / ms / 1e6:.0f} GB/s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paged_read_ceiling.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
