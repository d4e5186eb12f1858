"""Where one decode step's time goes, against its byte bound, for each way kvq can run the step.

    python3 -m benchmarks.step_profile --out $OUT                       # H200, Llama-3-8B geometry, ~5 min
    python3 -m benchmarks.step_profile --device cpu --preset tiny --small-preset tiny --out /tmp/p  # CI smoke run

Per KV format and scenario (batch 1 at each --contexts, and the most sequences of --max-ctx tokens the
KV budget holds), every --step mode runs real engine steps (runtime/step_loop.py: schedule, model,
sampling, stop checks, callbacks) on sequences whose K/V fill the pool, interleaved in --rounds:

  legacy  one host round trip per step: the decode CUDA graph returns the logits, the host checks and
          samples them (runtime/cuda_graphs.py, runtime/sampling.py); a CUDA engine's step before bursts and
          fused ops were its defaults;
  burst   --burst greedy steps per host read, the pick and the next inputs on the device
          (runtime/decode_burst.py);
  fused   burst, plus norms / RoPE / SwiGLU as fused Triton kernels (runtime/kernels/small_ops.py): a CUDA
          engine's default step;
  invariant  burst through the batch-invariant mode's ops (runtime/engine_ops.batch_invariant_backend: on CUDA
          its Triton GEMM, attention and small ops), the step of an engine built with batch_invariant: true.

First the --small-preset geometry (SmolLM2-135M) at batch 1 in BF16, whose step is bound by its kernel
launches and the host, not its bytes: its rows count the kernels one captured step launches.

Rows: step ms (wall, per token of every sequence), its GPU part (the captured step replayed alone) and the
host's (the rest), tokens/s, and the bound: weights read once + every sequence's K/V read once + logits,
at --bandwidth-gbs. Then each component (benchmarks/step_components.py) alone, with its own bound; the
components sum to the GPU step up to the gaps between kernels (`unattributed`). Finally greedy tokens of
each mode against legacy's on the same prompts (`tokens_match`); for invariant, whether each prompt's tokens
decoded alone equal its tokens decoded beside the others (the mode's promise; its sums are not legacy's).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.headline import FORMATS, make_engine_dir
from benchmarks.step_components import (
    attention_plans,
    bound_ms,
    components,
    kernels_per_call,
    replay_ms,
    split_sweep,
    time_ms,
)
from benchmarks.step_profile_report import markdown
from runtime.config import PRESETS
from runtime.cuda_graphs import bucket_for
from runtime.decode_burst import DecodeBurst
from runtime.engine import Engine
from runtime.engine_ops import batch_invariant_backend, with_small_ops
from runtime.errors import UnsupportedError
from runtime.kv_format import kv_bytes_per_token
from runtime.sampling import SamplingParams
from runtime.scheduler import Sequence

MODES = ("legacy", "burst", "fused", "invariant")
PRESET_ALIASES = {"tiny": "tiny-llama3"}
GIB = 2**30


def _modes(engine: Engine, args) -> dict:
    """mode -> (the burst the step loop runs, or None; the op set its components use)."""
    out = {"legacy": (None, "legacy")}
    make = lambda backend: DecodeBurst(engine.model, engine.runner.caches, backend, engine.scheduler.max_batch_size,  # noqa: E731
                                       engine.max_seq_len, engine.stats.block_size, args.burst, use_graphs=True)
    if "burst" in args.step:
        out["burst"] = (make(engine.backend), "burst")
    if "fused" in args.step:
        if engine.model.device.type == "cuda":
            out["fused"] = (make(with_small_ops(engine.backend, engine.model, False)), "fused")
        else:
            print("fused: the small-op kernels need CUDA (the CPU runs them only under TRITON_INTERPRET=1 in "
                  "tests); skipped", flush=True)
    if "invariant" in args.step:
        try:
            out["invariant"] = (make(batch_invariant_backend(engine.model)), "invariant")
        except UnsupportedError as e:  # the CPU's GEMMs may not allow the mode: say so, profile the others
            print(f"invariant: {e}; skipped", flush=True)
    return out


def start_sequences(engine: Engine, n: int, ctx: int, new_tokens: int) -> list[Sequence]:
    """n sequences decoding after a ctx-token prompt (K/V random, written through the format's write op),
    straight into the scheduler's running set, as if their prefill had just run."""
    cfg, bs, dev = engine.cfg, engine.stats.block_size, engine.model.device
    ids = torch.randint(3, cfg.vocab_size, (n, ctx + 1), generator=torch.Generator().manual_seed(ctx * 7 + n))
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    seqs = []
    for row in ids.tolist():
        seq = Sequence(next(engine._ids), row[:ctx], sp)
        seq.output_ids.append(row[ctx])
        engine.blocks.allocate(seq.request_id, ctx)  # pages for every token but the newest (the next step's)
        seq.num_computed = seq.prefill_target = ctx
        seqs.append(seq)
    pos = torch.arange(ctx)
    slots = torch.cat([torch.tensor(engine.blocks.block_table(s.request_id))[pos // bs] * bs + pos % bs
                       for s in seqs]).to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    for cache in engine.runner.caches:
        for off in range(0, slots.numel(), 32768):
            sl = slots[off: off + 32768]
            k, v = (torch.randn(sl.numel(), cfg.num_kv_heads, cfg.head_dim, device=dev, generator=g,
                                dtype=engine.model.dtype) for _ in range(2))
            engine.backend.write_kv(cache, k, v, sl)
    engine.scheduler.running.extend(seqs)
    return seqs


def run_steps(engine: Engine, seqs: list[Sequence], tokens: int) -> tuple[float, int]:
    """Engine steps until every sequence has at least `tokens` more (a burst may overshoot): wall ms per token
    of each, and the tokens each got."""
    start = len(seqs[0].output_ids)
    sync(engine)
    t0 = time.perf_counter()
    while len(seqs[0].output_ids) < start + tokens:
        engine.steps.step()
        if seqs[0].finished:
            raise RuntimeError(f"a profiled sequence ended early ({seqs[0].finish_reason}): {seqs[0].error!r}")
    sync(engine)
    done = len(seqs[0].output_ids) - start
    return (time.perf_counter() - t0) * 1e3 / done, done


def tokens_per_mode(args) -> int:
    """Tokens a sequence may take in one mode's warm-up and timed run: each stops after the burst that passes its
    count."""
    return args.warmup + args.tokens + 4 * args.burst


def captured_step(engine: Engine, burst: DecodeBurst | None, n: int, ctx: int):
    """The replay of the captured step of n sequences at ctx tokens (the legacy graph, or the burst's of the
    narrowest block table that holds them); None where none was captured."""
    if engine.model.device.type != "cuda":
        return None
    size = bucket_for(n)
    if burst is None:
        captured = engine.runner.graphs._graphs.get(size) if engine.runner.graphs else None
        return captured.graph.replay if captured else None
    need = -(-(ctx + 1) // engine.stats.block_size)
    fits = sorted((width, b) for (bucket, width), b in burst._buffers.items()
                  if bucket == size and width >= need and b.graph is not None)
    if not fits:
        return None
    buf = fits[0][1]

    def replay():  # the captured step advances the burst's ring row: start each replay at row 0
        buf.counter.zero_()
        buf.graph.replay()
    return replay


def sync(engine: Engine) -> None:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()


def step_bound_ms(engine: Engine, n: int, ctx: int, args) -> float:
    """Weights read once (the embedding table only for the n rows it gathers) -- or the matmuls' FLOPs at --tflops
    where those take longer (bf16 weights from about 184 rows at 790 TFLOP/s and 4300 GB/s: INT4's ~350 requests
    of 8k at the maximum) -- then every sequence's K/V and the logits."""
    cfg, model = engine.cfg, engine.model
    el = model.embed_tokens.element_size()
    weights = model.weight_bytes - (model.embed_tokens.numel() * el if model.lm_head is not model.embed_tokens else 0)
    matmuls = max(weights / (args.bandwidth_gbs * 1e6), 2.0 * n * weights / el / (args.tflops * 1e9))
    rest = n * cfg.hidden_size * el + n * ctx * kv_bytes_per_token(cfg, engine.fmt) + n * cfg.vocab_size * 4
    return matmuls + rest / (args.bandwidth_gbs * 1e6)


def profile_scenario(engine: Engine, modes: dict, label: str, n: int, ctx: int, args) -> list[dict]:
    seqs = start_sequences(engine, n, ctx, args.rounds * len(modes) * tokens_per_mode(args) + 2)
    steps: dict[str, list[float]] = {m: [] for m in modes}
    in_bursts = dict.fromkeys(modes, 0)  # timed steps that ran in bursts: a burst mode should run all
    timed = dict.fromkeys(modes, 0)
    try:
        for _ in range(args.rounds):  # modes interleaved: a drift of the machine lands on all of them
            for mode, (burst, _) in modes.items():
                engine.steps.burst = burst
                run_steps(engine, seqs, args.warmup)  # (a first burst of a width captures its graph)
                before = burst.steps_run if burst is not None else 0
                ms, done = run_steps(engine, seqs, args.tokens)
                steps[mode].append(ms)
                timed[mode] += done
                in_bursts[mode] += (burst.steps_run - before) if burst is not None else 0
        rows = []
        base = {"preset": args.preset, "format": engine.fmt.name, "scenario": label, "batch": n, "context": ctx}
        bound = step_bound_ms(engine, n, ctx, args)
        for mode, (burst, ops_set) in modes.items():
            step = sorted(steps[mode])[len(steps[mode]) // 2]
            replay = captured_step(engine, burst, n, ctx)
            gpu = replay_ms(replay) if replay is not None else None
            small = getattr(burst.backend, "small_ops", None) if burst is not None else None
            comps = components(engine, [engine.blocks.block_table(s.request_id) for s in seqs], ctx, ops_set, small,
                               burst.backend if burst is not None else engine.backend,
                               burst.width_for(n, ctx + 1) if burst is not None else None)
            comp_rows = []
            for c in comps:
                ms = time_ms(c.fn, engine.model.device, args.reps)
                b = bound_ms(c, args.bandwidth_gbs, args.tflops)
                comp_rows.append({**base, "kind": "component", "mode": mode, "component": c.name, "ms": ms,
                                  "bytes": c.bytes, "flops": c.flops, "bound_ms": b, "pct_of_bound": 100 * b / ms})
            gpu_part = gpu if gpu is not None else sum(r["ms"] for r in comp_rows)
            rows.append({**base, "kind": "step", "mode": mode, "step_ms": step, "gpu_step_ms": gpu_part,
                         "gpu_step_measured": gpu is not None, "host_ms": max(0.0, step - gpu_part),
                         "components_ms": sum(r["ms"] for r in comp_rows),
                         "unattributed_ms": gpu_part - sum(r["ms"] for r in comp_rows),
                         "tok_s": n / step * 1e3, "bound_ms": bound, "pct_of_bound": 100 * bound / step,
                         "burst": args.burst if burst is not None else 1,
                         "kernels_per_step": kernels_per_call(replay) if replay is not None else None,
                         "burst_share": in_bursts[mode] / timed[mode]})
            rows += comp_rows
        if n == 1 and engine.backend.name.startswith("triton"):
            rows += [{**base, **r} for r in attention_plans(engine, ctx)]
        if n == 1 and args.split_sweep and engine.backend.name.startswith("triton"):
            rows += [{**base, **r} for r in split_sweep(engine, engine.blocks.block_table(seqs[0].request_id), ctx,
                                                          args.bandwidth_gbs, args.reps)]
        return rows
    finally:
        engine.steps.burst = None
        for seq in seqs:
            if not seq.finished:
                engine.scheduler.finish(seq, "length")


def tokens_match(engine: Engine, modes: dict, args) -> tuple[dict[str, bool], dict[str, str]]:
    """Greedy tokens of each mode on the same prompts (prefill, then decode through the mode) vs legacy's; and
    why a mode failed, if one did (it is then left out of the profile, the others still measured)."""
    g = torch.Generator().manual_seed(1)
    longest = engine.max_seq_len - args.check_tokens - 1
    prompts = [torch.randint(3, engine.cfg.vocab_size, (min(n, longest),), generator=g).tolist() for n in (37, 200)]
    out, errors = {}, {}
    alone: list[list[int]] = []  # the invariant mode's tokens of each prompt decoded by itself
    for mode, (burst, _) in modes.items():
        engine.steps.burst = burst
        runner_ops = engine.runner.backend
        if mode == "invariant":  # its prefill too: a batch-invariant engine runs every step through the mode's ops
            engine.runner.backend = burst.backend
        try:
            out[mode] = [g.token_ids for g in engine.generate(prompts, max_tokens=args.check_tokens, ignore_eos=True)]
            if mode == "invariant":
                alone = [engine.generate([p], max_tokens=args.check_tokens, ignore_eos=True)[0].token_ids
                         for p in prompts]
        except Exception as e:  # noqa: BLE001 - report the mode's failure, measure the others
            errors[mode] = f"{type(e).__name__}: {e}"
            print(f"{engine.fmt.name} {mode} FAILED: {errors[mode]}", flush=True)
        finally:
            engine.runner.backend = runner_ops
        if burst is not None and burst.failure:
            errors.setdefault(mode + " capture", burst.failure)
    engine.steps.burst = None
    return {mode: toks == (alone if mode == "invariant" else out.get("legacy")) for mode, toks in out.items()}, errors


def measure_format(args, name: str, root: Path) -> list[dict]:
    fmt = FORMATS[name]
    room = args.rounds * len(args.step) * tokens_per_mode(args) + args.block + 4
    longest = max(args.contexts + [args.max_ctx, args.engine_len or 0])
    max_seq = min(longest + room, PRESETS[args.preset].max_position_embeddings)
    root.mkdir(parents=True, exist_ok=True)
    d = make_engine_dir(root, name, fmt, args.block, args.max_batch, max_seq, args.preset)
    # the legacy step's engine (no bursts, torch's small ops); the other modes are built beside it (`_modes`)
    engine = Engine.from_dir(d, device=args.device, memory_budget=int(args.kv_gib * GIB), prefix_caching=False,
                             max_seq_len=max_seq, burst_steps=0, fused_ops=False, batch_invariant=False)
    try:
        modes = _modes(engine, args)
        match, errors = tokens_match(engine, modes, args)  # first: a mode that fails here is not profiled
        modes = {m: v for m, v in modes.items() if m in match}
        rows = [{"kind": "error", "format": fmt.name, "mode": m, "error": e} for m, e in errors.items()]
        scenarios = [(f"{args.tag}batch1@{c}", 1, c) for c in args.contexts if c + room <= max_seq]
        if args.max_ctx:
            per_req = math.ceil((args.max_ctx + room) / args.block) + 3  # pages to spare: a burst needs its own
            n = min(args.max_batch, engine.stats.pool_blocks // per_req)
            scenarios.append((f"max@{args.max_ctx}", n, args.max_ctx))
        if args.gemm_sweep and engine.model.device.type == "cuda" and name == args.formats[0]:
            from benchmarks.skinny_gemm_tune import sweep  # the weights are every format's: measured once

            rows += sweep(engine, args.bandwidth_gbs, args.reps)
        for label, n, ctx in scenarios:
            try:
                # the engine's own step loop (started by tokens_match) waits on this lock before any step, so
                # it cannot step the profiled sequences beside this thread
                with engine._run_lock:
                    got = profile_scenario(engine, modes, label, n, ctx, args)
            except Exception as e:  # noqa: BLE001 - keep the other scenarios' numbers
                rows.append({"kind": "error", "format": fmt.name, "scenario": label, "error": f"{type(e).__name__}: {e}"})
                print(f"{fmt.name} {label} FAILED: {rows[-1]['error']}", flush=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            for r in got:
                r["tokens_match"] = match[r["mode"]] if r["kind"] == "step" else None
            rows += got
            print(json.dumps([r for r in got if r["kind"] == "step"]), flush=True)
        return rows
    finally:
        engine.shutdown()


def release_gpu() -> None:
    """The last engine's pool goes back before the next one allocates its own (each takes most of the GPU)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8_e4m3-per_tensor", "int4-per_token-asym", "k8v4"],
                    choices=list(FORMATS))
    ap.add_argument("--small-preset", default="smollm2-135m", help="The launch-bound geometry, batch 1, BF16 KV.")
    ap.add_argument("--small-contexts", nargs="*", type=int, default=[2048], help="Its contexts (none: skip it).")
    ap.add_argument("--step", nargs="+", default=["legacy", "fused"], choices=MODES,
                    help="Step modes, side by side (legacy: the old default, fused: the CUDA default, invariant: "
                         "batch_invariant: true).")
    ap.add_argument("--burst", type=int, default=8, help="Decode steps per host read in the burst modes.")
    ap.add_argument("--contexts", nargs="+", type=int, default=[8192, 32768, 130000], help="Batch-1 contexts.")
    ap.add_argument("--max-ctx", type=int, default=8192, help="Context of the max-concurrency scenario (0: none).")
    ap.add_argument("--engine-len", type=int, default=0,
                    help="The engine's longest sequence, where longer than the contexts (the legacy step pads its block "
                         "tables to it; 0: the longest context).")
    ap.add_argument("--kv-gib", type=float, default=96.0)
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=8, help="Untimed tokens per sequence before each timed run.")
    ap.add_argument("--tokens", type=int, default=24, help="Timed tokens per sequence per mode and round.")
    ap.add_argument("--reps", type=int, default=20, help="Timed replays per component.")
    ap.add_argument("--check-tokens", type=int, default=24, help="Greedy tokens compared between modes.")
    ap.add_argument("--split-sweep", action=argparse.BooleanOptionalAction, default=False,
                    help="Batch-1 attention at split counts around the default plan's (CUDA).")
    ap.add_argument("--gemm-sweep", action=argparse.BooleanOptionalAction, default=False,
                    help="cuBLAS vs the Triton GEMV at M = 1..16 on the model's weights (CUDA); writes gemv_<gpu>.json.")
    ap.add_argument("--bandwidth-gbs", type=float, default=4300.0, help="HBM ceiling (H200: measured copy rate).")
    ap.add_argument("--tflops", type=float, default=790.0, help="bf16 matrix ceiling (H200: measured).")
    ap.add_argument("--time-budget-s", type=float, default=300.0, help="Start no new format after this long.")
    args = ap.parse_args(argv)
    args.preset = PRESET_ALIASES.get(args.preset, args.preset)
    args.tag = ""  # the small geometry's scenarios are named with its preset
    small = PRESET_ALIASES.get(args.small_preset, args.small_preset)
    env = {"preset": args.preset, "small_preset": small if args.small_contexts else None, "torch": torch.__version__,
           "bandwidth_gbs": args.bandwidth_gbs, "tflops": args.tflops, "burst": args.burst, "steps": args.step}
    if torch.device(args.device).type == "cuda":
        from benchmarks.gpu_timing import gpu_env

        env = gpu_env(**env)
    root = Path(tempfile.mkdtemp())
    rows: list[dict] = []
    t0 = time.perf_counter()
    if args.small_contexts:  # first: a few seconds, never cut by the time budget
        small_args = argparse.Namespace(**{**vars(args), "preset": small, "tag": f"{small} ", "contexts": args.small_contexts,
                                           "max_ctx": 0, "engine_len": 0, "gemm_sweep": False, "split_sweep": False})
        rows += measure_format(small_args, "bf16", root / "small")
        release_gpu()
    for name in args.formats:
        if time.perf_counter() - t0 > args.time_budget_s:
            print(f"skipping {name}: time budget of {args.time_budget_s:.0f} s spent", flush=True)
            continue
        rows += measure_format(args, name, root)
        release_gpu()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "step_profile.jsonl", "w") as f:
        for r in [{"kind": "env", **env}] + rows:
            f.write(json.dumps(r) + "\n")
    if any(r["kind"] == "gemm" for r in rows):
        from benchmarks.skinny_gemm_tune import write_tuned

        print(f"tuned GEMV shapes: {write_tuned([r for r in rows if r['kind'] == 'gemm'], args.out)}", flush=True)
    md = markdown(rows, env)
    (args.out / "step_profile.md").write_text(md + "\n")
    print(md)
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
