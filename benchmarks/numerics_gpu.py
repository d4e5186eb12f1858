"""Engine numerics on the GPU: batch invariance, its cost, and what write-then-read costs prefill.

Per model (SmolLM2-135M geometry and a Llama-3-8B-geometry model, random weights) and KV format
(bf16, fp8_e4m3 per-tensor, int8 per-token, int4 per-token asym), with the batch-invariant
mode on and off:

* agreement: 64 mixed requests (prompts of 8 to --max-prompt random tokens) generated together,
  each compared with the same request generated alone (greedy): requests identical, tokens equal;
* decode tok/s at maximum concurrency (all requests decoding at once, prompts of --decode-context
  tokens) for the models of --rate-models: the mode's cost;
* with --gemm (default on), the mode's GEMM (runtime/kernels/invariant_gemm.py) against cuBLAS at
  Llama-3-8B's weight shapes and decode row counts, and whether a row alone gets its batch bits;
* with --prefill-cost, prefill time of 8 x 1024-token prompts with write-then-read and, for
  comparison, with the prefill attending to its freshly computed K/V instead (read-back skipped).

    python -m benchmarks.numerics_gpu --out results_dir [--smollm2-dir DIR] [--requests 64]
    python -m benchmarks.numerics_gpu --out /tmp/x --tiny      # CPU check of the script itself
    python -m benchmarks.numerics_gpu --out DIR --gemm-sweep   # only: every GEMM tile config vs cuBLAS, and their bits

Without --smollm2-dir, SmolLM2's geometry runs with random weights (the GPU machine has no
GGUF reader). Rows are written to numerics.jsonl as they are measured (a run cut short keeps
what it has); numerics.md is the table of them, gemm.md the GEMM timings.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from pathlib import Path

import torch

from runtime import model as model_module
from runtime.config import PRESETS
from runtime.engine import Engine
from runtime.errors import KvqError
from runtime.kv_format import KVFormat
from runtime.kv_quant import static_scale_from_amax
from runtime.runner import plan_pool


def formats(device: str) -> dict[str, KVFormat]:
    base = "bf16" if device == "cuda" else "fp32"
    return {base: KVFormat(base), "fp8_e4m3-per_tensor": KVFormat("fp8_e4m3", "per_tensor"),
            "int8-per_token": KVFormat("int8", "per_token"), "int4-per_token-asym": KVFormat("int4", "per_token", False)}


def synthetic_dir(root: Path, preset: str, dtype: str) -> Path:
    d = root / preset
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(PRESETS[preset].to_hf_dict(dtype)))
    (d / "synthetic.json").write_text(json.dumps({"seed": 0}))
    return d


def static_scales(base: Engine, fmt: KVFormat, ids: list[int]):
    """Max-policy per-layer scales from one dense pass (what the calibrate stage's max policy does)."""
    if not fmt.static:
        return None, None
    n = base.cfg.num_layers
    amax = {"k": torch.zeros(n), "v": torch.zeros(n)}

    def observe(i, k, v):
        amax["k"][i], amax["v"][i] = k.abs().max().cpu(), v.abs().max().cpu()

    base.model.forward_dense(torch.tensor(ids, device=base.model.device), observer=observe)
    return static_scale_from_amax(amax["k"], fmt), static_scale_from_amax(amax["v"], fmt)


def engine(base: Engine, fmt: KVFormat, scales, invariant: bool, blocks: int, batch: int, step_tokens: int) -> Engine:
    plan = plan_pool(base.cfg, fmt, 16, num_blocks=blocks)
    return Engine(base.model, fmt, plan, *scales, max_batch_size=batch, max_tokens_per_step=step_tokens,
                  batch_invariant=invariant)


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def decode_rate(eng: Engine, prompts: list[list[int]], n: int) -> float:
    """Decode tok/s with every request decoding in the same steps: from the moment the last
    request has its first token (all prefills done) to the moment the last one finishes."""
    from runtime.sampling import SamplingParams

    sp = SamplingParams(max_tokens=n, ignore_eos=True)
    eng.generate([p[:16] for p in prompts], sp)  # warm-up (CUDA graphs, compiles) on short prompts: cheap prefill
    first: dict[int, float] = {}
    done = threading.Event()
    finished = [0]

    def callback(i: int):
        def on_token(tok, fin, why):
            first.setdefault(i, time.perf_counter())
            if fin:
                finished[0] += 1
                if finished[0] == len(prompts):
                    done.set()
        return on_token

    for i, p in enumerate(prompts):
        eng.submit(p, sp, callback(i))
    done.wait()
    end = time.perf_counter()
    return len(prompts) * (n - 1) / max(end - max(first.values()), 1e-9)


def measure(base: Engine, fmt: KVFormat, scales, invariant: bool, a, prompts: list[list[int]], rate: bool) -> dict:
    longest = max(max(map(len, prompts)), a.decode_context)
    blocks = len(prompts) * -(-(longest + max(a.max_tokens, a.decode_tokens)) // 16) + 16
    # one step holds every prompt's prefill, so all requests decode together afterwards
    eng = engine(base, fmt, scales, invariant, blocks, len(prompts), max(a.step_tokens, 128 * len(prompts)))
    try:
        mixed = [g.token_ids for g in eng.generate(prompts, max_tokens=a.max_tokens, ignore_eos=True)]
        solo = [eng.generate([p], max_tokens=a.max_tokens, ignore_eos=True)[0].token_ids for p in prompts]
        same = sum(m == s for m, s in zip(mixed, solo))
        tokens = sum(x == y for m, s in zip(mixed, solo) for x, y in zip(m, s))
        row = {"requests": len(prompts), "identical_requests": same, "agreement": round(same / len(prompts), 4),
               "token_agreement": round(tokens / sum(map(len, solo)), 4),
               "attention": eng.stats.attention, "cuda_graphs": eng.stats.cuda_graphs}
        if rate:
            vocab = base.cfg.vocab_size
            rng = random.Random(1)
            ctx = [[rng.randrange(3, vocab) for _ in range(a.decode_context)] for _ in prompts]
            row["decode_tokens_per_s"] = round(decode_rate(eng, ctx, a.decode_tokens), 1)
            row["decode_context"] = a.decode_context
        return row
    finally:
        eng.shutdown()


def prefill_cost(base: Engine, fmt: KVFormat, scales, a, rng: random.Random) -> dict:
    """8 x prefill_len prompts, prefill only: write-then-read vs the computed K/V (read-back skipped)."""
    dev = base.model.device.type
    vocab = base.cfg.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(a.prefill_len)] for _ in range(8)]
    eng = engine(base, fmt, scales, False, 8 * -(-(a.prefill_len + 2) // 16) + 8, 8, 8 * a.prefill_len)
    real = model_module.stores_exactly
    variants = (("write_then_read_s", False), ("computed_kv_s", True))
    out = {}
    try:
        # Pass 0 warms both variants (an engine's first prefills compile and allocate); passes 1
        # and 2 time them in turn, the later timing kept.
        for _round in range(3):
            for name, skip in variants:
                model_module.stores_exactly = (lambda f, d: True) if skip else real
                sync(dev)
                t = time.perf_counter()
                for _ in range(a.prefill_reps if _round else 1):
                    eng.generate(prompts, max_tokens=1, ignore_eos=True)
                sync(dev)
                if _round:
                    out[name] = round((time.perf_counter() - t) / a.prefill_reps, 4)
    finally:
        model_module.stores_exactly = real
        eng.shutdown()
    out["prefill_tokens"] = 8 * a.prefill_len
    return out


def write_md(rows: list[dict], path: Path) -> None:
    lines = ["| model | KV | mode | identical / requests | token agreement | decode tok/s | prefill WTR / computed (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "agreement" not in r:
            continue
        pre = f"{r['write_then_read_s']} / {r['computed_kv_s']}" if "write_then_read_s" in r else ""
        lines.append(f"| {r['model']} | {r['kv']} | {'batch-invariant' if r['batch_invariant'] else 'default'} | "
                     f"{r['identical_requests']} / {r['requests']} | {r['token_agreement']} | "
                     f"{r.get('decode_tokens_per_s', '')} | {pre} |")
    costs = {}
    for r in rows:
        if r.get("decode_tokens_per_s"):
            costs.setdefault((r["model"], r["kv"]), {})[r["batch_invariant"]] = r["decode_tokens_per_s"]
    lines += ["", "| model | KV | decode tok/s cost of the mode |", "|---|---|---|"]
    for (m, kv), c in costs.items():
        if True in c and False in c and c[False]:
            lines.append(f"| {m} | {kv} | {100 * (1 - c[True] / c[False]):.1f}% |")
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


# Llama-3-8B's weights [N, K] (fused QKV, O, fused gate/up, down, LM head) and decode row counts
GEMM_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "lm_head": (128256, 4096)}
GEMM_ROWS = (8, 32, 64, 128, 256, 512)


def _time_cuda(fn, reps: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000  # us


def gemm_rows() -> list[dict]:
    """The mode's GEMM against cuBLAS (F.linear) at Llama-3-8B shapes, bf16; and its bits: every row of an
    M-row product equal to the row computed alone."""
    import torch.nn.functional as F

    from runtime.kernels import invariant_gemm

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in GEMM_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5
        x_all = torch.randn(max(GEMM_ROWS), k, device="cuda", dtype=torch.bfloat16, generator=gen)
        alone = torch.cat([invariant_gemm.linear(x_all[i:i + 1], w) for i in range(0, max(GEMM_ROWS), 37)])
        for m in GEMM_ROWS:
            x = x_all[:m]
            ours = _time_cuda(lambda x=x, w=w: invariant_gemm.linear(x, w))
            cublas = _time_cuda(lambda x=x, w=w: F.linear(x, w))
            same = torch.equal(invariant_gemm.linear(x, w)[::37], alone[:len(range(0, m, 37))])
            rows.append({"weight": name, "n": n, "k": k, "m": m, "invariant_us": round(ours, 1),
                         "cublas_us": round(cublas, 1), "ratio": round(ours / cublas, 3), "rows_equal_alone": same})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# (block_m, block_n, block_k, warps, stages): the tiles the sweep times, every one checked for the rule's bits
SWEEP_CONFIGS = [(64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 4),
                 (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3),
                 (128, 128, 64, 4, 4), (64, 256, 64, 8, 4), (128, 64, 64, 4, 4), (128, 64, 128, 4, 3)]
SWEEP_SHAPES = {**GEMM_SHAPES, "smollm2 qkv": (960, 576), "smollm2 o": (576, 576), "smollm2 gate_up": (3072, 576),
                "smollm2 down": (576, 1536), "smollm2 lm_head": (49152, 576)}
SWEEP_ROWS = (1, 16, 64, 96, 128, 179, 256, 337)  # 89 / 179 / 231 / 337: the headline's max-concurrency batches


def tile_key(block_m: int, cfg) -> str:
    """A sweep row's key of a tile: "[block_m, block_n, block_k, warps, stages]", SWEEP_CONFIGS' order."""
    return str([block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages])


def gemm_sweep() -> list[dict]:
    """Every tile config of SWEEP_CONFIGS at SWEEP_SHAPES x SWEEP_ROWS (GPU ms, L2 flushed, graph replays), beside
    cuBLAS, the one config (`gemm_config`) and the rule's choice (`rows_config`); and whether each config gives every
    row the first config's bits, also for products starting at other rows (what lets the rule choose by M)."""
    import torch.nn.functional as F

    from benchmarks.gpu_timing import median_ms
    from runtime.kernels import invariant_gemm

    def run(x, w, cfg):
        bm, bn, bk, warps, stages = cfg
        return invariant_gemm.launch(x, w, invariant_gemm.GemmConfig(bn, bk, warps, stages), bm)

    rows = []
    for name, (n, k) in SWEEP_SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n)
        x = torch.randn(400, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        ref = run(x, w, SWEEP_CONFIGS[0])
        same_bits = all(torch.equal(run(x, w, cfg), ref) and all(
            torch.equal(run(x[i:i + m], w, cfg), ref[i:i + m]) for i, m in ((0, 1), (5, 7), (63, 89), (3, 337)))
            for cfg in SWEEP_CONFIGS)
        one = tile_key(invariant_gemm.BLOCK_M, invariant_gemm.gemm_config(n, k, torch.bfloat16))
        for m in SWEEP_ROWS:
            xm = x[:m].contiguous()
            row = {"weight": name, "n": n, "k": k, "m": m, "cublas_ms": round(median_ms(lambda xm=xm, w=w: F.linear(xm, w)), 4)}
            for cfg in SWEEP_CONFIGS:
                row[str(list(cfg))] = round(median_ms(lambda c=cfg, xm=xm, w=w: run(xm, w, c)), 4)
            row.update(one_config=one, rows_config=tile_key(*invariant_gemm.rows_config(n, k, m)), same_bits=same_bits)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def write_sweep_md(rows: list[dict], path: Path) -> None:
    """The sweep's table: per weight and M, cuBLAS, the one config, the rule's choice and the fastest config."""
    lines = ["| weight | N x K | M | cuBLAS ms | one config ms | rows_config ms (tile) | fastest ms (tile) | "
             "rows_config vs one | same bits, every config |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tiles = {c: r[c] for c in map(str, map(list, SWEEP_CONFIGS))}
        best = min(tiles, key=tiles.get)
        chosen = r[r["rows_config"]] if r["rows_config"] in r else float("nan")
        lines.append(f"| {r['weight']} | {r['n']} x {r['k']} | {r['m']} | {r['cublas_ms']} | {r[r['one_config']]} | "
                     f"{chosen} ({r['rows_config']}) | {tiles[best]} ({best}) | {r[r['one_config']] / chosen:.2f}x | "
                     f"{r['same_bits']} |")
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def write_gemm_md(rows: list[dict], path: Path) -> None:
    lines = ["| weight | N x K | M | invariant GEMM (us) | cuBLAS (us) | ratio | rows = alone |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['weight']} | {r['n']} x {r['k']} | {r['m']} | {r['invariant_us']} | {r['cublas_us']} | {r['ratio']} "
              f"| {r['rows_equal_alone']} |" for r in rows]
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smollm2-dir", help="a converted SmolLM2 directory (real weights)")
    ap.add_argument("--models", default="smollm2,llama3-8b")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=10)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--step-tokens", type=int, default=2048)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--formats", help="comma-separated KV format names (default: all four)")
    ap.add_argument("--modes", default="off,on", help="batch-invariant mode: off, on or both")
    ap.add_argument("--max-prompt", type=int, default=256, help="longest prompt of the agreement requests")
    ap.add_argument("--decode-context", type=int, default=128, help="prompt tokens of the decode-rate requests")
    ap.add_argument("--rate-models", default="llama3-8b", help="models whose decode tok/s is measured")
    ap.add_argument("--gemm", action=argparse.BooleanOptionalAction, default=True, help="time the mode's GEMM (CUDA)")
    ap.add_argument("--prefill-cost", action="store_true", help="time write-then-read prefill (default mode)")
    ap.add_argument("--gemm-sweep", action="store_true", help="only time every GEMM config candidate (CUDA)")
    ap.add_argument("--time-limit-s", type=float, default=220, help="start no new row after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny-llama3 geometry, 6 requests: checks the script")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    if a.tiny:
        a.models, a.requests, a.max_tokens, a.decode_tokens, a.prefill_len, a.prefill_reps = "tiny-llama3", 6, 4, 4, 64, 1
        a.rate_models, a.decode_context, a.prefill_cost = "tiny-llama3", 16, True
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "numerics.jsonl"
    jsonl.write_text("")  # this run's rows only: numerics.md is their table
    rows: list[dict] = []
    dtype = "bfloat16" if dev == "cuda" else "float32"
    started = time.perf_counter()
    if a.gemm_sweep:
        rows = gemm_sweep()
        (out / "invariant_gemm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        write_sweep_md(rows, out / "invariant_gemm.md")
        return
    if a.gemm and dev == "cuda":
        write_gemm_md(gemm_rows(), out / "gemm.md")
    for name in a.models.split(","):
        preset = {"smollm2": "smollm2-135m", "llama3-8b": "llama3-8b"}.get(name, name)
        real = name == "smollm2" and a.smollm2_dir
        d = Path(a.smollm2_dir) if real else synthetic_dir(out / "models", preset, dtype)
        base = Engine.from_dir(d, device=dev, dtype=dtype, num_blocks=4, batch_invariant=False)
        rng = random.Random(0)
        vocab = base.cfg.vocab_size
        lens = [rng.choice([n for n in (8, 16, 33, 64, 100, 200, 350, 512) if n <= a.max_prompt] or [a.max_prompt])
                for _ in range(a.requests)]
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]
        chosen = {k: f for k, f in formats(dev).items() if not a.formats or k in a.formats.split(",")}
        for kv, fmt in chosen.items():
            scales = static_scales(base, fmt, prompts[0] + prompts[1])
            for invariant in [m == "on" for m in a.modes.split(",")]:
                row = {"model": name + ("" if real else " (random weights)"), "kv": kv, "batch_invariant": invariant,
                       "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__}
                t = time.perf_counter()
                if t - started > a.time_limit_s:
                    print(f"time limit: {name} {kv} batch_invariant={invariant} not run", flush=True)
                    continue
                try:
                    row.update(measure(base, fmt, scales, invariant, a, prompts, name in a.rate_models.split(",")))
                    if a.prefill_cost and not invariant and fmt.quantized:
                        row.update(prefill_cost(base, fmt, scales, a, rng))
                except KvqError as e:
                    row["error"] = str(e)
                row["seconds"] = round(time.perf_counter() - t, 1)
                rows.append(row)
                with jsonl.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
                write_md(rows, out / "numerics.md")
        base.shutdown()
        del base
        if dev == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
