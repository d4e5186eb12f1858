"""The instructions of a format's decode tile loop on the H200, by opcode, without a GPU: the launch the plan makes at
Llama-3-8B 16 x 32768 (bf16 q) is recorded (tests/helpers_launch_record.py), compiled for sm_90
(tests/helpers_sass_digest.py) and its SASS read with cuobjdump; the tile loop is `helpers_gluon_compile.tile_loop`'s,
its count includes the softmax rescale that a warp-uniform branch usually skips.
Where a tile's instructions go, before any time on a GPU (benchmarks/results/group_decode_h100.md).

    python -m benchmarks.probes.sass_loop --formats int4-g32-asym,int4-tok-asym
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

from benchmarks.kernels import FORMATS


def loop_of(fmt_name: str) -> dict:
    """The decode tile loop of one --formats entry (benchmarks.kernels.FORMATS) as the H200 plan launches it."""
    from tests.helpers_gluon_compile import cuobjdump, tile_loop
    from tests.helpers_mixed_compile import _decode, resources
    from tests.helpers_sass_digest import compile_launch

    launch = next(x for x in _decode(FORMATS[fmt_name], torch.bfloat16) if "merge" not in x["kernel"])
    compiled = compile_launch(launch)
    body = tile_loop(cuobjdump(compiled, "-sass")[0])
    tiles = 2 if launch.get("PAIRS") else 1
    plan = {k: launch[k] for k in ("STAGES", "PAIRS", "TMA", "GROUPS", "DEQUANT") if k in launch}
    return dict(format=fmt_name, kernel=launch["kernel"], plan=plan, **resources(compiled), loop=len(body),
                tiles_a_step=tiles, per_tile=len(body) / tiles,
                opcodes=dict(collections.Counter(body).most_common()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="int4-g32-asym,int4-g64-asym,int4-tok-asym")
    args = ap.parse_args()
    for name in args.formats.split(","):
        print(json.dumps(loop_of(name)), flush=True)


if __name__ == "__main__":
    main()
