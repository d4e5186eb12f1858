"""The read-only reduction's bandwidth against the bytes read (GPU machine): what a read of a decode launch's size
can reach. Measured on the H200: ~95% of the 2 GiB figure at 0.54 GB (int4 at Llama-3-8B 16 x 32768), ~84% at
0.13 GB (8-bit at Llama-3-70B TP8 16 x 32768; `results/read_by_size.jsonl`), with a few % of scatter from PyTorch's size-dependent launch shapes
(`gpu_timing.read_gbps` takes the best of three nearby sizes for that reason).

    python -m benchmarks.probes.read_by_size --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.gpu_timing import read_gbps, sum_gbps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    for mib in (16, 32, 64, 128, 256, 512, 528, 544, 560, 1024, 1088, 2048, 4096):
        rows.append(dict(bytes=mib << 20, gbps=sum_gbps(mib << 20), best_of_three=read_gbps(mib << 20)))
        print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "read_by_size.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
