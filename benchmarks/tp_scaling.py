"""Tensor-parallel decode: capacity and tokens/s of the embedded engine over 1-8 GPUs of one host.

On the GPU machine (torch + triton; `runtime` only, the planner if recipes' pydantic imports):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python3 -m benchmarks.tp_scaling --preset llama3-70b --tp 2 --out $OUT

Per (tp, KV format), one engine over synthetic BF16 weights (each rank draws its own shard,
no checkpoint), its pool sized by the engine itself from the free GPU memory with the
planner's per-rank bytes per token (`kv_bytes_per_token(cfg, fmt, tp)`), as serving does:

  * pool tokens per rank and the maximum concurrency of 8k requests (prompt + output) it holds,
    beside the planner's prediction for the same tp and memory (`kvq plan`'s make_plan);
  * decode tokens/s at that concurrency: rank 0's pool is filled through the write kernel
    (random K/V; decode time does not depend on the values, the other ranks' pages stay
    zero), then full decode steps through the engine's runner (rank 0 broadcasts the
    batch, every rank replays its CUDA graph, NCCL all-reduces inside it) are timed.

Rows go to `tp_scaling.json` (one per tp and format) and `tp_scaling.md` under --out.
Scaling from tp=1: `--preset llama3-8b --tp 1,2,4,8`. A CPU smoke run (gloo):
`--device cpu --preset tiny-llama3 --tp 1,2 --prompt 48 --output 8 --kv-gib 0.002 --steps 2`.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime import parallel
from runtime.config import PRESETS
from runtime.engine import Engine
from runtime.kv_format import KVFormat, kv_bytes_per_token
from runtime.model import PagedBatch

from .headline import FORMATS as HEADLINE_FORMATS
from .headline import decode_batch, fill_pool, sync

GIB = 2**30
# the headline's formats, and per-head static scales (sliced per rank)
FORMATS = {**HEADLINE_FORMATS, "int8-per_head": KVFormat("int8", "per_head"),
           "fp8_e4m3-per_head": KVFormat("fp8_e4m3", "per_head")}


def make_engine_dir(root: Path, name: str, fmt: KVFormat, args) -> Path:
    cfg = PRESETS[args.preset]
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict("bfloat16")))
    (d / "synthetic.json").write_text(json.dumps({"seed": 0}))
    (d / "kv_format.json").write_text(json.dumps({"dtype": fmt.dtype, "granularity": fmt.granularity,
                                                  "symmetric": fmt.symmetric, "scale_dtype": fmt.scale_dtype}))
    (d / "engine.json").write_text(json.dumps({
        "max_batch_size": args.max_batch, "max_seq_len": args.prompt + args.output + args.block,
        "block_size": args.block, "max_input_len": args.prompt, "gpu_memory_fraction": args.fraction}))
    if fmt.static:  # |K|,|V| of the random-weight model stay well under 4: scale = 4 / qmax
        shape = (cfg.num_layers,) if fmt.granularity == "per_tensor" else (cfg.num_layers, cfg.num_kv_heads)
        s = torch.full(shape, 4.0 / fmt.qmax)
        save_file({"k_scale": s, "v_scale": s.clone()}, str(d / "kv_scales.safetensors"))
    return d


def planner_concurrency(args, fmt: KVFormat, tp: int, gpu_memory: int | None) -> int | None:
    """The planner's maximum concurrency (`kvq plan`'s make_plan) for `gpu_memory` bytes per GPU at
    prompt + output tokens, or None without a GPU or where the planner (recipes: pydantic) does not import."""
    try:
        from builder.planner import make_plan
        from recipes import load_recipe
    except ImportError:
        return None
    if gpu_memory is None:
        return None
    kv = [f"kv.dtype={fmt.dtype}", f"kv.granularity={fmt.granularity}", f"kv.symmetric={str(fmt.symmetric).lower()}"]
    recipe = load_recipe("llama70b-fp8kv", [f"model.preset={args.preset}", "model.dtype=bf16",
                                            f"build.gpu_memory_fraction={args.fraction}", "backend=torch",
                                            *(kv if fmt.quantized else ["kv.dtype=bf16"])])
    ctx = args.prompt + args.output
    plan = make_plan(recipe, contexts=[ctx], gpu_memory=gpu_memory, gpus=tp)
    return next(f.max_concurrency[ctx] for f in plan.formats if f.recipe_format)


def time_step(engine: Engine, batch: PagedBatch, steps: int) -> float:
    """Median seconds of one decode step through the engine's runner (after capture and warm-up)."""
    for _ in range(2):
        engine.runner.forward(batch)
    times = []
    for _ in range(steps):
        sync(engine.model.device)
        t = time.perf_counter()
        engine.runner.forward(batch)
        sync(engine.model.device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(args, root: Path, tp: int, name: str, equal_load: int | None) -> dict:
    """equal_load: tp=1's concurrency for this format, also timed here (the same load on more GPUs)."""
    fmt = FORMATS[name]
    cfg = PRESETS[args.preset]
    d = make_engine_dir(root, f"tp{tp}-{name}", fmt, args)
    budget = None if args.kv_gib is None else int(args.kv_gib * GIB)
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if args.device.startswith("cuda") else None
    t0 = time.perf_counter()
    engine = Engine.from_dir(d, device=args.device, tp=tp, memory_budget=budget, cuda_graphs=not args.eager)
    load_s = time.perf_counter() - t0
    try:
        per_req = math.ceil((args.prompt + args.output) / args.block)
        conc = min(engine.stats.pool_blocks // per_req, args.max_batch)
        row = {"preset": args.preset, "tp": tp, "format": name, "device": torch.cuda.get_device_name(0)
               if engine.model.device.type == "cuda" else "cpu", "load_s": load_s,
               "bytes_per_token_per_rank": kv_bytes_per_token(cfg, fmt, tp),
               "weight_bytes_rank0": engine.stats.weight_bytes, "pool_blocks": engine.stats.pool_blocks,
               "pool_tokens_per_rank": engine.stats.pool_tokens, "pool_gib_per_rank": engine.stats.pool_bytes / GIB,
               "max_concurrency": engine.stats.pool_blocks // per_req, "measured_concurrency": conc,
               "planner_concurrency": planner_concurrency(args, fmt, tp, gpu_memory),
               "cuda_graphs": engine.stats.cuda_graphs}
        tables, _ = fill_pool(engine, conc, args.prompt)
        step = time_step(engine, decode_batch(engine, tables, args.prompt), args.steps)
        row.update(decode_step_ms=step * 1e3, decode_tok_s=conc / step)
        eq = min(equal_load or conc, conc)
        step_eq = step if eq == conc else time_step(engine, decode_batch(engine, tables[:eq], args.prompt), args.steps)
        row.update(equal_load=eq, decode_tok_s_equal_load=eq / step_eq)
        return row
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def render(rows: list[dict]) -> str:
    head = ("| preset | tp | KV format | bytes/token/rank | pool tokens/rank | max concurrency (planner) "
            "| decode tok/s at max | step ms | vs tp=1 | tok/s at tp=1's load | vs tp=1 |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    base = {(r["preset"], r["format"]): r["decode_tok_s"] for r in rows if r["tp"] == 1}
    lines = []
    for r in rows:
        b = base.get((r["preset"], r["format"]))
        speedup = "" if b is None else f"{r['decode_tok_s'] / b:.2f}x"
        speedup_eq = "" if b is None else f"{r['decode_tok_s_equal_load'] / b:.2f}x"
        lines.append(f"| {r['preset']} | {r['tp']} | {r['format']} | {r['bytes_per_token_per_rank']:.0f} | "
                     f"{r['pool_tokens_per_rank']} | {r['max_concurrency']} ({r['planner_concurrency']}) | "
                     f"{r['decode_tok_s']:.0f} | {r['decode_step_ms']:.1f} | "
                     f"{speedup} | {r['decode_tok_s_equal_load']:.0f} | {speedup_eq} |")
    return head + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-70b", choices=sorted(PRESETS))
    ap.add_argument("--tp", default="2", help="comma-separated tensor-parallel sizes, e.g. 1,2,4,8")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt", type=int, default=8192, help="tokens per request in the pool (8k requests)")
    ap.add_argument("--output", type=int, default=128, help="output tokens each request reserves")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=4096, help="decode batch limit (CUDA graph buckets)")
    ap.add_argument("--fraction", type=float, default=0.9, help="gpu_memory_fraction of the engines")
    ap.add_argument("--kv-gib", type=float, default=None, help="fixed KV budget per rank (CPU smoke runs)")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per engine")
    ap.add_argument("--eager", action="store_true", help="decode without CUDA graphs (every rank)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    unknown = set(args.formats.split(",")) - set(FORMATS)
    if unknown:
        ap.error(f"unknown --formats {sorted(unknown)}; choose from {', '.join(FORMATS)}")
    for k in parallel.group.MULTICAST_OFF:
        if os.environ.get(k) != parallel.group.MULTICAST_OFF[k]:
            print(f"note: {k} is not {parallel.group.MULTICAST_OFF[k]}; the ranks set it unless it is set")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in (int(t) for t in args.tp.split(",")):
            for name in args.formats.split(","):
                base = next((r["measured_concurrency"] for r in rows if r["tp"] == 1 and r["format"] == name), None)
                row = measure(args, Path(tmp), tp, name, base)
                rows.append(row)
                print(json.dumps(row), flush=True)
                (args.out / "tp_scaling.json").write_text(json.dumps(rows, indent=1))
    parallel.close_group()
    (args.out / "tp_scaling.md").write_text(render(rows))
    print(render(rows))


if __name__ == "__main__":
    main()
