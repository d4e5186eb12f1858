"""The host's share of a decode burst at high concurrency: what the step loop does per sequence per burst
(runtime/step_loop.py `_run_burst`, runtime/decode_burst.py `DecodeBurst.run`) with the device's part taken away.

    python3 -m benchmarks.burst_host --out /tmp/burst_host            # CPU, tiny model, ~1 min

At the maximum concurrency of an H200 (Llama-3-8B, 8k contexts: 91 BF16 to 345 INT4 sequences) the host's part of a
burst step is not hidden behind the GPU's. This measures it on the CPU with the tiny preset as a proxy: real
sequences in a real engine's scheduler and block manager, `--ctx`-token contexts (block tables of ctx / block
entries, as 8k contexts in 64-token pages have 128), bursts whose forward is a no-op, so the time left is the
host's: block appends, the burst's inputs (block tables, slots), the read of its tokens, stop checks and token
callbacks. Prints and writes µs per sequence per step at each --batches, with and without a token callback.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.headline import FORMATS, make_engine_dir
from benchmarks.step_profile import start_sequences
from runtime.decode_burst import DecodeBurst
from runtime.engine import Engine


def host_us(engine: Engine, n: int, ctx: int, steps: int, bursts: int, callback: bool) -> dict:
    """Median µs per sequence per step of `bursts` bursts of n sequences, the device's part removed."""
    burst = DecodeBurst(engine.model, engine.runner.caches, engine.backend, n, engine.max_seq_len,
                        engine.stats.block_size, steps, use_graphs=False)
    # the forward and the pick: none (every step picks token 0, finite)
    burst._step = lambda buf: (buf.ring_finite.fill_(True), buf.counter.add_(1))
    engine.steps.burst = burst
    seqs = start_sequences(engine, n, ctx, steps * (bursts + 2))
    got = []
    if callback:  # what a streaming caller hangs on a request (engine.generate's is of this size)
        for s in seqs:
            s.on_token = lambda tok, done, reason, out=got: out.append(tok)
    times = []
    try:
        engine.steps.step()  # the first burst makes its buffers
        for _ in range(bursts):
            t0 = time.perf_counter()
            engine.steps.step()
            times.append((time.perf_counter() - t0) * 1e6 / (n * steps))
        if burst.steps_run < steps * (bursts + 1):
            raise RuntimeError(f"the step loop ran {burst.steps_run} burst steps, not {steps * (bursts + 1)}")
    finally:
        engine.steps.burst = None
        for s in seqs:
            if not s.finished:
                engine.scheduler.finish(s, "length")
    return {"batch": n, "ctx": ctx, "burst": steps, "callback": callback, "us_per_seq_step": statistics.median(times),
            "us_per_burst": statistics.median(times) * n * steps}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", nargs="+", type=int, default=[256, 512])
    ap.add_argument("--ctx", type=int, default=896, help="Context tokens (the tiny preset holds 1024 positions).")
    ap.add_argument("--block", type=int, default=8, help="Page size: ctx / block entries a block table.")
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--bursts", type=int, default=9, help="Timed bursts per point (median).")
    args = ap.parse_args(argv)
    if args.ctx + args.burst * (args.bursts + 1) + 1 >= 1024:
        ap.error(f"--ctx {args.ctx} leaves no room for {args.bursts + 1} bursts of {args.burst} in 1024 positions")
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    n_max = max(args.batches)
    d = make_engine_dir(root, "bf16", FORMATS["bf16"], args.block, n_max, 1024, "tiny-llama3")
    per_seq = -(-(args.ctx + args.burst * (args.bursts + 3)) // args.block) + 1
    engine = Engine.from_dir(d, device="cpu", num_blocks=n_max * per_seq + 16, prefix_caching=False, max_seq_len=1024,
                             burst_steps=0, batch_invariant=False, max_batch_size=n_max)
    rows = []
    try:
        with engine._run_lock:  # the engine's own loop stays off these sequences
            for n in args.batches:
                for callback in (False, True):
                    rows.append(host_us(engine, n, args.ctx, args.burst, args.bursts, callback))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "burst_host.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
