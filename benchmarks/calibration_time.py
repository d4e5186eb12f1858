"""How long calibrating SmolLM2-135M on 64 x 512 tokens takes (goal: <= 60 s on a CI-class CPU).

Runs the real `calibrate` stage (built-in corpus, `max` policy) in whole-model
and layer-streaming modes and in the requested model dtypes, and records wall
time, process CPU time, the stage's own split (data / forward / scales), the
machine's load average and the thread count: on a shared machine the wall time
says more about the neighbours than about kvq, and the CPU time says how much
work calibration itself did. Rows go to <out>/calibration_time.json.

    python -m benchmarks.calibration_time --model-dir DIR [--dtypes float32,bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from calibration.calibrate import run_calibration
from calibration.files import write_json_atomic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="converted SmolLM2 directory (default: convert the builtin)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="whole,streaming")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="kvq-caltime-"))
    model_dir = Path(args.model_dir) if args.model_dir else work / "model"
    if not args.model_dir:
        from builder.convert import convert_source

        model_dir.mkdir()
        convert_source("smollm2-135m", None, model_dir, "float32")
    rows = []
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            out = Path(tempfile.mkdtemp(dir=work))
            load0, wall0, cpu0 = os.getloadavg()[0], time.perf_counter(), time.process_time()
            facts = run_calibration(model_dir, out, num_samples=args.samples, seq_len=args.seq_len, policy="max",
                                    streaming=mode == "streaming", dtype=dtype)
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            split = json.loads((out / "calibration.json").read_text())["timing_s"]
            row = {"model": "SmolLM2-135M", "samples": args.samples, "seq_len": args.seq_len, "dtype": dtype,
                   "mode": mode, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "stage_split_s": split,
                   "tokens_per_s": round(args.samples * args.seq_len / split["forward"], 1),
                   "loadavg_before": round(load0, 2), "loadavg_after": round(os.getloadavg()[0], 2),
                   "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine(),
                   "torch": torch.__version__, "meets_60s_goal": wall <= 60.0, "seconds_reported": facts["seconds"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(args.out) / "calibration_time.json", rows)


if __name__ == "__main__":
    main()
