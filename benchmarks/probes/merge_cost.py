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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from alternate import time_settings  # noqa: E402

import runtime.kernels.split_k as split_k  # noqa: E402

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
    ap.add_argument("--shapes", default=",".join(f"{m}:{b}x{c}" for m, b, c in SHAPES), help="MODEL:BATCHxCONTEXT,...")
    args = ap.parse_args()
    real = split_k.merge_splits
    settings = {"merge": partial(set_merge, real), "no-merge": partial(set_merge, lambda *a, **k: None)}
    shapes = [(m, *map(int, bc.split("x"))) for m, bc in (s.split(":") for s in args.shapes.split(","))]
    res = time_settings(shapes, args.formats.split(","), settings)
    set_merge(real)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "merge_cost.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
