"""What the per-token formats' scale reads cost the decode launch, and whether their layout matters (GPU machine).

Per-token formats keep a tile's 16 scales (and zero points) per (page, KV head) in tensors of their own,
[blocks, kv_heads, block_size]: 32-byte pieces, one per tensor, in pages of random order. Each format and
shape is timed as the benchmarks time it (CUDA graph, L2 emptied) three ways, alternated:

* separate: the cache as allocated (the shipped layout);
* interleaved: one tensor [blocks, kv_heads, n, block_size] holding the n = 2 (4 with zero points) rows of a
  page, the cache's scale tensors views of it (the kernel takes their strides): one 64 / 128-byte piece a
  tile. The output must equal the separate layout's, bit for bit;
* shared (a probe, output wrong): every page reads block 0's scales (block stride 0), which stay in L2: the
  launch without the scales' DRAM traffic.

    python3 benchmarks/probes/scale_layout.py --out DIR
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kernels as kb  # noqa: E402
from gpu_timing import median_ms  # noqa: E402

from runtime.kernels import decode_attention_launch, write_kv_launch  # noqa: E402

# the module (the package exports a function of the same name)
decode_attention = importlib.import_module("runtime.kernels.decode_attention")
formats = importlib.import_module("runtime.kernels.formats")

SHAPES = [("llama3-8b", 16, 32768), ("llama3-8b", 128, 4096), ("llama3-70b-tp8", 16, 32768)]
NAMES = ("k_scale", "v_scale", "k_zero", "v_zero")


def interleave(cache) -> None:
    """Move the cache's per-token scales / zero points into one [blocks, kv_heads, n, block_size] tensor."""
    parts = [getattr(cache, n) for n in NAMES if getattr(cache, n) is not None]
    meta = torch.stack(parts, 2).contiguous()
    for i, name in enumerate(n for n in NAMES if getattr(cache, n) is not None):
        setattr(cache, name, meta[:, :, i])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--formats", default="int4-tok,int4-tok-asym,int8-tok,int8-tok-asym")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    shipped, check = decode_attention.meta_strides, formats._check_scales
    formats._check_scales = lambda cache, mode: None  # the shipped check wants contiguous scale tensors
    strides = {
        "separate": shipped,
        "interleaved": lambda kf, c: tuple(c.k_scale.stride()[:2]),
        "shared": lambda kf, c: (0, shipped(kf, c)[1]),
    }
    res = {}
    for model, batch, ctx in SHAPES:
        case = kb.Case(model, batch, ctx)
        for name in args.formats.split(","):
            caches = {}
            for layout in ("separate", "interleaved", "shared"):
                cache = case.cache(kb.FORMATS[name])
                write_kv_launch(cache, case.k, case.v, case.slots)
                if layout == "interleaved":
                    interleave(cache)
                caches[layout] = cache
            outs, row = {}, {}
            for r in range(args.rounds):
                for layout, cache in caches.items():
                    decode_attention.meta_strides = strides[layout]
                    fn = partial(decode_attention_launch, case.q, cache, case.block_tables, case.seq_lens, case.sm_scale)
                    outs[layout] = fn().clone()
                    row[f"{layout} {r}"] = median_ms(fn)
            decode_attention.meta_strides = shipped
            row["interleaved equals separate"] = bool(torch.equal(outs["interleaved"], outs["separate"]))
            res[f"{model} {batch}x{ctx} {name}"] = row
            print(model, f"{batch}x{ctx}", name, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
                  flush=True)
            del caches, outs
            torch.cuda.empty_cache()
        del case
    formats._check_scales = check
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale_layout.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
