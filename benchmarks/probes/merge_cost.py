"""What the split-K merge kernel costs a decode launch (GPU machine): each format and shape timed as the
benchmarks time it (CUDA graph, L2 emptied), with `split_k.merge_splits` and with it replaced by a no-op (the
output is then wrong: a probe, not a variant). Thirteenth session: 3.5-4.2 us a launch (KERNEL_NOTES.md).

    python3 benchmarks/probes/merge_cost.py --out DIR
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

import runtime.kernels.split_k as split_k  # noqa: E402
from runtime.kernels import decode_attention_launch, write_kv_launch  # noqa: E402

# the module (the package exports a function of the same name)
decode_attention = importlib.import_module("runtime.kernels.decode_attention")

SHAPES = [("llama3-8b", 16, 32768), ("llama3-8b", 1, 131072), ("llama3-70b-tp8", 16, 32768), ("llama3-70b-tp8", 1, 131072)]


def set_merge(fn) -> None:
    # the Gluon launcher imports merge_splits when it runs, the Triton one at import
    split_k.merge_splits = decode_attention.merge_splits = fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--formats", default="int4,int4-tok,int8,fp8_e4m3")
    args = ap.parse_args()
    real = split_k.merge_splits
    res = {}
    for model, batch, ctx in SHAPES:
        case = kb.Case(model, batch, ctx)
        for name in args.formats.split(","):
            cache = case.cache(kb.FORMATS[name])
            write_kv_launch(cache, case.k, case.v, case.slots)
            fn = partial(decode_attention_launch, case.q, cache, case.block_tables, case.seq_lens, case.sm_scale)
            row = {}
            for mode in ("merge", "no-merge", "merge again", "no-merge again"):
                set_merge(real if mode.startswith("merge") else lambda *a, **k: None)
                row[mode] = median_ms(fn)
            set_merge(real)
            res[f"{model} {batch}x{ctx} {name}"] = row
            print(model, f"{batch}x{ctx}", name, {k: round(v, 4) for k, v in row.items()}, flush=True)
            del cache
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "merge_cost.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
