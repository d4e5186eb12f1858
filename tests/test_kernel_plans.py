"""The default plans launch exactly what the kernels launched before the plan API (commit 6941f60, whose launches
tests/helpers_launch_record.py recorded into tests/data/kernel_launches_6941f60.json.gz): for every KV format x
Llama-3-8B / 70B TP8 / 70B TP2 / SmolLM2 geometry x batch 1-128 x context 1k-128k (pages of 16, and of 64 at a few
shapes), on the H200 (its device properties) and in the interpreter, the same kernels with the same grids, scalar
arguments, constexprs and launch options; likewise for the write and prefill-context kernels. Same launches, same
measured speed."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from tests.helpers_launch_record import launches_of

RECORD = Path(__file__).parent / "data" / "kernel_launches_6941f60.json.gz"
# every STRIDE-th recorded case, and all of benchmarks/kernels.py's grid (KVQ_PLAN_STRIDE=1: all 22610, ~4 minutes
# on one core)
STRIDE = int(os.environ.get("KVQ_PLAN_STRIDE", "8"))
# Switches the kernels no longer take (paths no plan selected), with the value every recorded launch gave them
REMOVED = {
    "_decode_kernel": {"V_T": False, "CVT_EARLY": False, "SWAP": False, "KIND": 0, "SCALE_MODE": 0, "ASYM": False,
                       "ASM_LO": "", "ASM_HI": "", "DOT_F16": False, "P_SCALE": False},
}
# Constexprs whose codes changed: the TMA unit fills the ring (True) or not, where 2 said so (1 is gone)
RENAMED = {"_decode_kernel_gluon": {"TMA": {2: True, 0: False}}}


def _as_now(launch: dict) -> dict:
    launch = dict(launch)
    for key, value in REMOVED.get(launch["kernel"], {}).items():
        assert launch.pop(key) == value, f"{launch['kernel']} was launched with {key} != {value!r}"
    for key, codes in RENAMED.get(launch["kernel"], {}).items():
        launch[key] = codes[launch[key]]
    return launch


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    return json.load(gzip.open(RECORD))


@pytest.mark.parametrize("op", ["decode", "write", "prefill"])
def test_default_plans_launch_what_the_tuned_launchers_did(recorded, op):
    from tests.helpers_sass_digest import selected

    rows = [r for i, r in enumerate(recorded) if r["op"] == op and (i % STRIDE == 0 or selected(r))]
    assert len(rows) > 100
    mismatches = []
    for row in rows:
        args = tuple(row["args"])
        try:
            now = launches_of(op, args)
        except Exception as e:  # noqa: BLE001 - compared with what the old launcher did
            now = type(e).__name__
        want = [_as_now(launch) for launch in row["launches"]] if "launches" in row else row["error"]
        if now != want:
            mismatches.append((args, want, now))
    assert not mismatches, f"{len(mismatches)} of {len(rows)} {op} cases differ; first: {mismatches[0]}"
