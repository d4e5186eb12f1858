"""The split-K merge's head_dim slice width against the decode launch's time (GPU machine): each shape and format
timed as the benchmarks time it (CUDA graph, L2 emptied) with `split_k.MERGE_VALUES` set to each value given
(0: slices of 32 whatever the splits, the fourteenth session's rule; 256: shipped), alternated. Fifteenth session:
slices of 32 cost Llama-3-8B 128 x 4096 (2 splits, 16384 merge programs) 3-5% (KERNEL_NOTES.md).

    python3 benchmarks/probes/merge_width.py --out DIR
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from alternate import time_settings  # noqa: E402

split_k = importlib.import_module("runtime.kernels.split_k")
SHAPES = [("llama3-8b", 128, 4096), ("llama3-8b", 64, 8192), ("llama3-8b", 16, 32768), ("llama3-8b", 1, 131072),
          ("llama3-70b-tp8", 16, 32768), ("llama3-70b-tp8", 1, 131072), ("llama3-70b-tp8", 128, 4096)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--formats", default="int4,fp8_e4m3,int4-tok")
    ap.add_argument("--values", default="0,256", help="MERGE_VALUES settings to alternate")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    shipped = split_k.MERGE_VALUES
    settings = {v: partial(setattr, split_k, "MERGE_VALUES", int(v)) for v in args.values.split(",")}
    res = time_settings(SHAPES, args.formats.split(","), settings, args.rounds)
    split_k.MERGE_VALUES = shipped
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "merge_width.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
