"""The H200 headline: an 8B-geometry model with FP16 / FP8 / INT8 / INT4 KV under one memory budget.

Runs on the GPU machine as it is (torch + triton, `runtime` only):

    python3 -m benchmarks.headline --out $OUT

What it measures, per KV format, with kvq's engine and fused Triton kernels:
  * pool: blocks/tokens the one KV budget buys (runtime sizing = the planner's bytes/token);
  * max concurrency: 8k-token requests (8192 prompt + output) the pool holds;
  * decode tokens/s at that concurrency and at the FP16 engine's concurrency (equal load):
    the pool is filled for every sequence through the write kernel (random K/V:
    decode time does not depend on the values), then full-model decode steps
    (all 32 layers, write + paged attention + MLP + LM head) are timed with CUDA events:
    the engine's step (a CUDA graph replay, runtime/cuda_graphs.py) and, beside it, the
    eager step with the host's time to enqueue it, all interleaved;
  * prefill time of one 8192-token request, and the end-to-end estimate for a
    batch of max-concurrency requests (prefill each, then decode OUTPUT tokens);
  * all of it --rounds times (formats in turn each round): medians, and ratios to
    BF16 taken within a round, with their range over rounds.
Prefilling hundreds of 8k requests for real would take minutes of GPU time per
format; the decode phase is where KV capacity and KV bytes decide throughput.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.config import PRESETS
from runtime.engine import Engine
from runtime.kv_format import KVFormat, format_fields, kv_bytes_per_token
from runtime.model import PagedBatch
from runtime.rotation import NO_ROTATION, KVRotation

FORMATS = {
    "bf16": KVFormat("bf16"),
    "fp8_e4m3-per_tensor": KVFormat("fp8_e4m3", "per_tensor"),
    "int8-per_tensor": KVFormat("int8", "per_tensor"),
    "int8-per_token": KVFormat("int8", "per_token"),
    "int4-per_token-asym": KVFormat("int4", "per_token", symmetric=False),
    "fp8_e4m3-per_token": KVFormat("fp8_e4m3", "per_token"),
    # K INT8 / V INT4 asym and the all-INT4 group-64 format (docs/kv-formats.md)
    "k8v4": KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False),
    "int4-per_token-asym-g64": KVFormat("int4", "per_token", symmetric=False, group_size=64),
    # the bundled Llama recipes' K8V4 and INT4 (with kv.rotation: hadamard): V, or K and V, in groups of 32
    "k8v4-g32": KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False, v_group_size=32),
    "int4-per_token-asym-g32": KVFormat("int4", "per_token", symmetric=False, group_size=32),
}
# "<format>+hadamard": the same format with kv.rotation: hadamard (one more small GEMM per layer over q/k)
ROTATED = "+hadamard"
CHOICES = [*FORMATS, *(n + ROTATED for n, f in FORMATS.items() if f.quantized)]
GIB = 2**30


def make_engine_dir(root: Path, name: str, fmt: KVFormat, block: int, max_batch: int, max_seq: int,
                    preset: str, rotation: KVRotation = NO_ROTATION) -> Path:
    cfg = PRESETS[preset]
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict("bfloat16")))
    (d / "synthetic.json").write_text(json.dumps({"seed": 0}))
    kv = format_fields(fmt)
    if rotation.active:
        kv["rotation"] = rotation.to_json(cfg.head_dim)
    (d / "kv_format.json").write_text(json.dumps(kv))
    (d / "engine.json").write_text(json.dumps({"max_batch_size": max_batch, "max_seq_len": max_seq,
                                               "block_size": block, "max_input_len": 8192}))
    if fmt.static:  # |K|,|V| of the random-weight model stay well under 4: scale = 4 / qmax
        s = torch.full((cfg.num_layers,), 4.0 / fmt.qmax)
        save_file({"k_scale": s, "v_scale": s.clone()}, str(d / "kv_scales.safetensors"))
    return d


def fill_pool(engine: Engine, n_seqs: int, ctx: int, chunk: int = 32768) -> tuple[list[list[int]], float]:
    """Allocate n_seqs sequences of ctx(+1) tokens and write random K/V into every layer; returns tables, GB/s."""
    cfg, bs = engine.cfg, engine.stats.block_size
    tables = []
    for s in range(n_seqs):
        engine.blocks.allocate(("bench", s), ctx + 1)
        tables.append(engine.blocks.block_table(("bench", s)))
    dev = engine.model.device
    slots = torch.tensor([t[p // bs] * bs + p % bs for t in tables for p in range(ctx)], dtype=torch.int64,
                         device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    kvh, d = engine.model.num_kv_heads, cfg.head_dim  # this rank's heads under tensor parallelism
    sync(dev)
    t0 = time.perf_counter()
    for layer in engine.runner.caches:
        for off in range(0, slots.numel(), chunk):
            sl = slots[off: off + chunk]
            k = torch.randn(sl.numel(), kvh, d, device=dev, dtype=engine.model.dtype, generator=g)
            v = torch.randn(sl.numel(), kvh, d, device=dev, dtype=engine.model.dtype, generator=g)
            engine.backend.write_kv(layer, k, v, sl)
    sync(dev)
    dt = time.perf_counter() - t0
    moved = slots.numel() * cfg.num_layers * (2 * kvh * d * 2 + kv_bytes_per_token(cfg, engine.fmt) / cfg.num_layers)
    return tables, moved / dt / 1e9


def decode_batch(engine: Engine, tables: list[list[int]], pos: int) -> PagedBatch:
    bs = engine.stats.block_size
    n = len(tables)
    width = max(len(t) for t in tables)
    dev = engine.model.device
    return PagedBatch(
        input_ids=torch.randint(3, engine.cfg.vocab_size, (n,), device=dev),
        positions=torch.full((n,), pos, dtype=torch.int64, device=dev),
        slot_mapping=torch.tensor([t[pos // bs] * bs + pos % bs for t in tables], dtype=torch.int64, device=dev),
        num_decode=n,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
        seq_lens=torch.full((n,), pos + 1, dtype=torch.int32, device=dev),
        cu_seqlens=torch.zeros(1, dtype=torch.int32, device=dev),
        logits_indices=torch.arange(n, dtype=torch.int64, device=dev),
        max_position=pos,
    )


def sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fns, warmup: int = 2, reps: int = 5, host: list | None = None) -> list[float]:
    """Median ms of each fn, their timed runs interleaved (a, b, a, b, ...): a drift of the
    machine during the measurement lands on all of them alike, not on whichever ran last.
    `host`, if given, receives each fn's median host time to enqueue its work: when that is
    as long as the GPU time, the step is bound by Python and launches, not by the GPU."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.synchronize()
    times = [[] for _ in fns]
    enqueue = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            if gpu:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t0 = time.perf_counter()
            fn()
            enqueue[i].append((time.perf_counter() - t0) * 1e3)
            if gpu:
                b.record()
                b.synchronize()
                times[i].append(a.elapsed_time(b))
            else:  # CPU smoke runs: the work is done when fn returns
                times[i].append(enqueue[i][-1])
    if host is not None and gpu:
        host.extend(statistics.median(t) for t in enqueue)
    return [statistics.median(t) for t in times]


def prefill_ms(engine: Engine, ctx: int) -> float:
    bs = engine.stats.block_size
    engine.blocks.allocate("prefill", ctx)
    t = engine.blocks.block_table("prefill")
    dev = engine.model.device
    batch = PagedBatch(
        input_ids=torch.randint(3, engine.cfg.vocab_size, (ctx,), device=dev),
        positions=torch.arange(ctx, device=dev),
        slot_mapping=torch.tensor([t[p // bs] * bs + p % bs for p in range(ctx)], dtype=torch.int64, device=dev),
        num_decode=0, block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=dev),
        cu_seqlens=torch.tensor([0, ctx], dtype=torch.int32, device=dev),
        logits_indices=torch.tensor([ctx - 1], dtype=torch.int64, device=dev),
    )
    (ms,) = time_ms([lambda: engine.model.forward_paged(batch, engine.runner.caches, engine.backend)], 1, 3)
    engine.blocks.free("prefill")
    return ms


def e2e_tok_s(row: dict) -> float:
    """Continuous batching of max_concurrency requests: each prefilled once, then output_len decode steps."""
    seconds = (row["max_concurrency"] * row["prefill_8k_ms"] + row["output_len"] * row["decode_step_ms_max"]) / 1e3
    return row["max_concurrency"] * row["output_len"] / seconds


def measure_format(args, name: str, root: Path, eq: int | None) -> dict:
    """One engine: everything it allocates dies with this frame, so the next format gets the GPU back."""
    cfg = PRESETS[args.preset]
    fmt = FORMATS[name.removesuffix(ROTATED)]
    rotation = KVRotation("hadamard") if name.endswith(ROTATED) else NO_ROTATION
    ctx, out_len = args.prompt, args.output
    d = make_engine_dir(root, name, fmt, args.block, 4096, ctx + out_len + args.block, args.preset, rotation)
    engine = Engine.from_dir(d, device=args.device, memory_budget=int(args.kv_gib * GIB), attention="auto")
    try:
        per_req = math.ceil((ctx + out_len) / args.block)
        max_conc = engine.stats.pool_blocks // per_req
        row = {"format": name, "attention": engine.backend.name, "bytes_per_token": kv_bytes_per_token(cfg, fmt),
               "pool_blocks": engine.stats.pool_blocks, "pool_tokens": engine.stats.pool_tokens,
               "pool_gib": engine.stats.pool_bytes / GIB, "max_concurrency": max_conc}
        pf = prefill_ms(engine, ctx)
        row["prefill_8k_ms"] = pf
        tables, fill_gbs = fill_pool(engine, max_conc, ctx)
        row["write_kernel_fill_GBps"] = fill_gbs
        eq = eq or max_conc  # the first format (bf16) sets the equal-concurrency load
        loads = {"max": max_conc, "equal": min(eq, max_conc)}
        batches = [decode_batch(engine, tables[:n], ctx) for n in loads.values()]
        # the engine's own step (a CUDA graph replay where it has them) and the eager step
        engine_steps = [partial(engine.runner.forward, b) for b in batches]
        eager_steps = [partial(engine.model.forward_paged, b, engine.runner.caches, engine.backend) for b in batches]
        host: list[float] = []
        step_ms = time_ms(engine_steps + eager_steps, reps=args.reps, host=host)
        graphs = engine.runner.graphs
        row["cuda_graphs"] = graphs is not None and graphs.failure is None
        if graphs is not None and graphs.failure is not None:
            print(f"{name}: CUDA graph capture failed, eager steps: {graphs.failure}", flush=True)
        k = len(loads)
        for i, (label, n) in enumerate(loads.items()):
            row[f"decode_step_ms_{label}"] = step_ms[i]
            row[f"decode_step_eager_ms_{label}"] = step_ms[k + i]
            row[f"decode_step_host_ms_{label}"] = host[k + i] if host else None  # eager step's enqueue time
            row[f"decode_tok_s_{label}"] = n / step_ms[i] * 1e3
            row[f"concurrency_{label}"] = n
        row["output_len"] = out_len
        row["e2e_tok_s_est"] = e2e_tok_s(row)
        if torch.cuda.is_available():
            row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        return row
    finally:
        engine.shutdown()


def run(args) -> list[dict]:
    """Every format, `args.rounds` times over (formats in turn each round): raw rows, one per (round, format).

    Each format needs the whole KV budget, so formats cannot share the GPU; repeating the
    sequence shows how much of a ratio is the machine drifting between two engines.
    """
    root = Path(tempfile.mkdtemp())
    rows: list[dict] = []
    t_start = time.perf_counter()
    eq = None
    for rnd in range(args.rounds):
        (root / f"round{rnd}").mkdir()
        for name in args.formats:
            if time.perf_counter() - t_start > args.time_budget_s:
                print(f"skipping {name} (round {rnd}): time budget of {args.time_budget_s:.0f} s spent", flush=True)
                continue
            try:
                row = {"round": rnd, **measure_format(args, name, root / f"round{rnd}", eq)}
                eq = eq or row["max_concurrency"]  # the first format (bf16) sets the equal load
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.progress:
                    with open(args.progress, "a") as f:
                        f.write(json.dumps(row) + "\n")
            except Exception as e:  # keep the other formats' numbers; report the failure
                print(f"{name} FAILED: {type(e).__name__}: {e}", flush=True)
                if not rows:
                    raise
            finally:
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
    return rows


def summarize(raw: list[dict]) -> list[dict]:
    """One row per format: median step and prefill times over rounds, and each throughput ratio to
    the first format (bf16) as the median and range of the per-round ratios (same round, same drift)."""
    base_name = raw[0]["format"]
    base = {r["round"]: r for r in raw if r["format"] == base_name}
    out = []
    for name in dict.fromkeys(r["format"] for r in raw):
        mine = [r for r in raw if r["format"] == name]
        row = dict(mine[0])
        row.pop("round")
        row["rounds"] = len(mine)
        for key in ("prefill_8k_ms", "decode_step_ms_max", "decode_step_ms_equal", "decode_step_eager_ms_max",
                    "decode_step_eager_ms_equal", "decode_step_host_ms_max", "decode_step_host_ms_equal"):
            vals = [r[key] for r in mine if r.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
        for label in ("max", "equal"):
            row[f"decode_tok_s_{label}"] = row[f"concurrency_{label}"] / row[f"decode_step_ms_{label}"] * 1e3
        row["e2e_tok_s_est"] = e2e_tok_s(row)
        for key in ("decode_tok_s_max", "decode_tok_s_equal", "e2e_tok_s_est"):
            ratios = [r[key] / base[r["round"]][key] for r in mine if r["round"] in base]
            row[f"{key}_x_base"] = statistics.median(ratios) if ratios else float("nan")
            row[f"{key}_x_base_range"] = [min(ratios), max(ratios)] if ratios else None
        out.append(row)
    return out


def markdown(rows: list[dict], args) -> str:
    gpu = rows[0].get("gpu") or (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    torch_version = rows[0].get("torch", torch.__version__)

    def ratio(r: dict, key: str) -> str:
        lo_hi = r[f"{key}_x_base_range"]
        spread = f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})" if lo_hi and r["rounds"] > 1 else ""
        return f"{r[f'{key}_x_base']:.2f}{spread}"

    base = rows[0]
    lines = [f"{args.preset} geometry, synthetic bf16 weights, "
             f"{args.prompt}-token prompts + {args.output} output, one KV budget of {args.kv_gib:g} GiB, "
             f"block {args.block}, {gpu}, torch {torch_version}. {base['rounds']} round(s) of every format in "
             f"turn, {args.reps} timed steps each: times are medians over rounds; x FP16 is the median of the "
             "per-round ratios (range over rounds in brackets). Decode steps are the engine's (CUDA graph "
             "replays where it has them); step ms: that step's GPU time, then the eager step's GPU time and, in "
             "brackets, the host's time to enqueue the eager step (Python + launches): where those two are equal "
             "the eager GPU waited on the host.", "",
             "| KV format | KiB/token | pool tokens | max concurrent | x FP16 | decode tok/s @max | x FP16 | "
             "decode tok/s @equal | x FP16 | step ms @max: engine / eager (host) | step ms @equal: engine / eager (host) | "
             "prefill 8k ms | "
             "e2e tok/s est. | x FP16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def step(r: dict, label: str) -> str:
        eager, host = r.get(f"decode_step_eager_ms_{label}"), r.get(f"decode_step_host_ms_{label}")
        return (f"{r[f'decode_step_ms_{label}']:.1f}" + (f" / {eager:.1f}" if eager is not None else "")
                + (f" ({host:.1f})" if host is not None else ""))

    for r in rows:
        lines.append(
            f"| {r['format']} | {r['bytes_per_token'] / 1024:.1f} | {r['pool_tokens']:,} | {r['max_concurrency']} | "
            f"{r['max_concurrency'] / base['max_concurrency']:.2f} | {r['decode_tok_s_max']:.0f} | "
            f"{ratio(r, 'decode_tok_s_max')} | {r['decode_tok_s_equal']:.0f} | {ratio(r, 'decode_tok_s_equal')} | "
            f"{step(r, 'max')} | {step(r, 'equal')} | {r['prefill_8k_ms']:.0f} | {r['e2e_tok_s_est']:.0f} | "
            f"{ratio(r, 'e2e_tok_s_est')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--kv-gib", type=float, default=96.0)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=CHOICES)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--time-budget-s", type=float, default=1e9, help="Start no new format after this long.")
    ap.add_argument("--progress", type=Path, default=None, help="Append each row here as soon as it is measured.")
    ap.add_argument("--rounds", type=int, default=3, help="Measure every format this many times, in turn.")
    ap.add_argument("--reps", type=int, default=10, help="Timed decode steps per measurement (median).")
    ap.add_argument("--markdown", type=Path, default=None,
                    help="Only rebuild headline.md in --out from this headline_rounds.jsonl.")
    args = ap.parse_args()
    if args.markdown:
        raw = [json.loads(line) for line in args.markdown.read_text().splitlines() if line.strip()]
        (args.out / "headline.md").write_text(markdown(summarize(raw), args) + "\n")
        return
    raw = run(args)
    rows = summarize(raw)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for name, data in (("headline.jsonl", rows), ("headline_rounds.jsonl", raw)):
        with open(args.out / name, "w") as f:
            for r in data:
                f.write(json.dumps({**r, "gpu": gpu, "torch": torch.__version__, "preset": args.preset}) + "\n")
    md = markdown(rows, args)
    (args.out / "headline.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
