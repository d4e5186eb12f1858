"""The int4 ring filled by the TMA unit against cp.async (GPU machine): each shape's and format's default launch
with `gluon_tma` 0 (cp.async from every lane), 1 (TMA copies the K / V words) and 2 (and the per-token scales and
zero points; the shipped choice on sm_90, `tuning.gluon_tma_for`). First the outputs, at the shipped plan's stages
and pairing, compared byte for byte (the copy changes where the words come from, not the arithmetic); then each
setting's own default plan (per-head int4 takes tiles two a step only with TMA: `tuning.gluon_pairs_for`) timed side
by side as the benchmarks time it, alternated. Shapes the plan runs from registers time the same launch thrice.

    python3 benchmarks/probes/tma_ring.py --out DIR [--shapes MODEL:BxC,...] [--formats int4,...]
"""

from __future__ import annotations

import argparse
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
from runtime.kernels.formats import kernel_format  # noqa: E402
from runtime.kernels.split_k import sm_count  # noqa: E402
from runtime.kernels.tuning import gluon_plan  # noqa: E402

SHAPES = [("llama3-8b", 16, 32768), ("llama3-8b", 64, 32768), ("llama3-8b", 128, 4096), ("llama3-8b", 1, 32768),
          ("llama3-70b-tp8", 1, 131072), ("llama3-70b-tp8", 128, 32768), ("llama3-70b-tp2", 16, 32768)]
COPIES = (0, 1, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--formats", default="int4,int4-tok,int4-tok-asym")
    ap.add_argument("--shapes", default=",".join(f"{m}:{b}x{c}" for m, b, c in SHAPES), help="MODEL:BATCHxCONTEXT,...")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    shapes = [(m, *map(int, bc.split("x"))) for m, bc in (s.split(":") for s in args.shapes.split(","))]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model, batch, ctx in shapes:
        case = kb.Case(model, batch, ctx)
        for name in args.formats.split(","):
            cache = case.cache(kb.FORMATS[name])
            write_kv_launch(cache, case.k, case.v, case.slots)
            launch = partial(decode_attention_launch, case.q, cache, case.block_tables, case.seq_lens, case.sm_scale)
            _, _, stages, pairs = gluon_plan(kernel_format(cache), batch, case.kv_heads, ctx, sm_count(case.q.device),
                                             group=case.heads // case.kv_heads, tma=2)
            want = launch(gluon_stages=stages, gluon_pairs=pairs, gluon_tma=0)
            equal = {t: bool(torch.equal(launch(gluon_stages=stages, gluon_pairs=pairs, gluon_tma=t), want))
                     for t in COPIES[1:]}
            ms = {f"tma{t}.{r}": median_ms(partial(launch, gluon_tma=t)) for r in range(args.rounds) for t in COPIES}
            row = dict(model=model, batch=batch, ctx=ctx, format=name, stages=stages, pairs=pairs, equal=equal, ms=ms)
            rows.append(row)
            print(model, f"{batch}x{ctx}", name, f"st{stages} pr{int(pairs)}", "equal" if all(equal.values()) else
                  f"DIFFERS {equal}", {k: round(v, 4) for k, v in ms.items()}, flush=True)
            del cache
            torch.cuda.empty_cache()
        del case
    (args.out / "tma_ring.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
