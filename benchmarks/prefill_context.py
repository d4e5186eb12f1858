"""GPU benchmark of the chunked-prefill kernel against the reference op it replaces.

Run on the GPU machine from the repository root (needs only torch and triton):

    python -m benchmarks.prefill_context --out benchmarks/results          # full grid
    python -m benchmarks.prefill_context --quick --out /tmp/r              # 8192 + 512 only
    python -m benchmarks.prefill_context --tune 32768x512 --out /tmp/r     # + alternative tiles there
    python -m benchmarks.prefill_context --p-scale both --out /tmp/r       # per-token formats both ways

Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128, bf16 q/k/v), page 16, pages
in random order: one chunk of 512 or 2048 tokens continuing a sequence whose first 8192,
32768 or 131072 tokens are in the cache, per KV format. Recorded per row:

* the kernel's median GPU time (CUDA-graph replays, L2 flushed before each call: the launcher
  never syncs with the host, so it captures) and its eager time (launcher included);
* the reference op's eager time (runtime.attention.prefill_context_attention: it syncs to the
  host, gathers and dequantizes the context, then SDPA -- it cannot be captured);
* TFLOP/s of the kernel: 4 x heads x head_dim x (chunk x context + chunk (chunk + 1) / 2)
  (QK^T and PV over the keys each query sees), per median time;
* the error of both against an fp32 attention over the dequantized cache (the first and
  last 64 queries of the chunk, where the causal part is shortest and longest);
* for per-token formats, where V's scales went: on V, dequantized in fp32 in every tile (the
  plan's default here) or on p (PrefillPlan.p_scale); --p-scale both records a row for each.

Rows go to prefill_context.jsonl (first line: the environment), a table to prefill_context.md.
Without CUDA it runs the --quick shape shrunk to 1024 + 48 tokens under the Triton
interpreter and checks the errors only (no timing): a smoke test of this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton decorates the kernels (tests/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks import kernels as kb  # noqa: E402  (the format names)
from runtime import attention as ref_ops  # noqa: E402
from runtime.kernels import prefill_context_attention, prefill_plan  # noqa: E402
from runtime.kv_cache import allocate_layer  # noqa: E402
from runtime.kv_format import KVFormat  # noqa: E402

FORMATS = {name: kb.FORMATS[name] for name in ("bf16", "fp8_e4m3", "int8", "int8-tok", "int4-tok-asym")}
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B
GRID = [(ctx, chunk) for ctx in (8192, 32768, 131072) for chunk in (512, 2048)]
# (block_m, block_n, num_warps, num_stages) tried by --tune besides the defaults
TUNE_TILES = [(128, 64, 8, 3), (128, 32, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2)]
CHECK_ROWS = 64
V_SCALES = {True: "p", False: "V", None: "-"}  # where per-token V scales were applied (None: not per-token)


class Case:
    """One sequence: `ctx` cached tokens, then a chunk of `chunk` tokens (q/k/v bf16)."""

    def __init__(self, ctx: int, chunk: int, device: str, seed: int = 0):
        self.ctx, self.chunk, self.device = ctx, chunk, device
        g = torch.Generator(device=device).manual_seed(seed)
        total = ctx + chunk
        bf = dict(device=device, dtype=torch.bfloat16, generator=g)
        self.k_all = torch.randn(total, KV_HEADS, HEAD_DIM, **bf)
        self.k_all[:, :, 3] += 3.0  # an outlier channel
        self.v_all = torch.randn(total, KV_HEADS, HEAD_DIM, **bf)
        self.q = torch.randn(chunk, HEADS, HEAD_DIM, **bf)
        pages = math.ceil(total / BLOCK_SIZE)
        self.num_blocks = pages
        self.block_tables = torch.randperm(pages, device=device, generator=g).to(torch.int32).view(1, pages)
        t = torch.arange(total, device=device)
        self.slots = self.block_tables[0, t // BLOCK_SIZE].long() * BLOCK_SIZE + t % BLOCK_SIZE
        self.cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
        self.context_lens = torch.tensor([ctx], dtype=torch.int32, device=device)
        self.sm_scale = 1.0 / math.sqrt(HEAD_DIM)

    def cache(self, fmt: KVFormat):
        """The whole sequence written with the reference write (as the engine writes a chunk before attending)."""
        ks = vs = None
        if fmt.static:
            kam, vam = (x.float().abs().amax((0, 2)) for x in (self.k_all, self.v_all))
            if fmt.granularity == "per_tensor":
                kam, vam = kam.max(), vam.max()
            ks, vs = kam / fmt.qmax, vam / fmt.qmax
        cache = allocate_layer(fmt, self.num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, self.device, ks, vs)
        ref_ops.write_kv(cache, self.k_all, self.v_all, self.slots)
        return cache

    def args(self, cache) -> tuple:
        c = self.ctx
        return (self.q, self.k_all[c:], self.v_all[c:], self.cu, cache, self.block_tables, self.context_lens,
                self.sm_scale)

    def flops(self) -> float:
        n = self.chunk
        return 4.0 * HEADS * HEAD_DIM * (n * self.ctx + n * (n + 1) / 2)

    def check_rows(self) -> torch.Tensor:
        n = min(CHECK_ROWS, self.chunk)
        return torch.cat((torch.arange(n), torch.arange(self.chunk - n, self.chunk))).unique().to(self.device)

    def reference(self, cache) -> torch.Tensor:
        """fp32 attention of the check rows: the dequantized context, then the chunk's own K/V, causal."""
        rows = self.check_rows()
        kc, vc = ref_ops.gather_kv(cache, self.block_tables, self.ctx)  # [1, kv_heads, ctx, D] fp32
        keys = torch.cat((kc[0], self.k_all[self.ctx:].float().transpose(0, 1)), 1)  # [kv_heads, L, D]
        vals = torch.cat((vc[0], self.v_all[self.ctx:].float().transpose(0, 1)), 1)
        q = self.q[rows].float().view(len(rows), KV_HEADS, HEADS // KV_HEADS, HEAD_DIM).permute(1, 2, 0, 3)
        s = q @ keys[:, None].transpose(-1, -2) * self.sm_scale  # [kv_heads, group, rows, L]
        visible = torch.arange(keys.shape[1], device=self.device)[None, :] <= self.ctx + rows[:, None]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
        return (p @ vals[:, None]).permute(2, 0, 1, 3).reshape(len(rows), HEADS, HEAD_DIM)


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def plan_for(args: list, tile: tuple | None, p_scale: bool):
    """The default PrefillPlan for these arguments with `tile` (block_m, block_n, num_warps, num_stages; None: the
    default's) and V's scales on p where `p_scale` and the format and q dtype allow it."""
    q, cache = args[0], args[4]
    plan = prefill_plan(cache.fmt, q.device, q_dtype=q.dtype)
    changes = {} if tile is None else dict(zip(("block_m", "block_n", "num_warps", "num_stages"), tile))
    return dataclasses.replace(plan, p_scale=p_scale and plan.p_scale, **changes)


def run_case(case: Case, name: str, tiles: list, rows: list, sink, p_scale: bool = True) -> None:
    from benchmarks.gpu_timing import eager_ms, median_ms

    fmt = FORMATS[name]
    cache = case.cache(fmt)
    args = case.args(cache)
    tried = []
    for tile in tiles:  # None: the default plan's
        plan = plan_for(args, tile, p_scale)
        try:
            ms = median_ms(partial(prefill_context_attention, *args, plan=plan))
        except Exception as e:  # a tile that does not compile (shared memory, registers)
            print(f"  {name} {tile}: {type(e).__name__} {str(e)[:100]}", flush=True)
            continue
        tried.append((ms, tile, plan))
    ms, tile, plan = min(tried, key=lambda x: x[0])
    kernel = partial(prefill_context_attention, *args, plan=plan)
    eager = eager_ms(kernel)
    truth = case.reference(cache)
    pick = case.check_rows()
    err = relerr(kernel()[pick], truth)
    try:  # the reference materializes the dequantized context (and SDPA's mask): GBs at 128k
        ref_ms = eager_ms(partial(ref_ops.prefill_context_attention, *args))
        ref_err = relerr(ref_ops.prefill_context_attention(*args)[pick], truth)
    except torch.cuda.OutOfMemoryError as e:
        print(f"  reference: out of memory ({str(e)[:80]})", flush=True)
        ref_ms = ref_err = float("nan")
        torch.cuda.empty_cache()
    used = {k: getattr(plan, k) for k in ("block_m", "block_n", "num_warps", "num_stages")}
    row = {
        "kind": "prefill_context", "ctx": case.ctx, "chunk": case.chunk, "format": name, "fmt": fmt.name,
        "ms": ms, "tflops": case.flops() / ms / 1e9, "eager_ms": eager, "ref_ms": ref_ms, "speedup": ref_ms / ms,
        "relerr_vs_fp32": err, "ref_relerr_vs_fp32": ref_err, "tiles": used,
        "p_scale": plan.p_scale if fmt.dynamic else None,
        "configs_tried": [[t, round(m, 4)] for m, t, _ in tried] if len(tried) > 1 else None,
        "timing": "kernel: cuda graph, L2 flushed per call; ref: eager (host sync inside)",
        "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
    }
    rows.append(row)
    sink.write(json.dumps(row) + "\n")
    sink.flush()
    print(f"  {name:14s} {V_SCALES[row['p_scale']]} {ms:8.3f} ms {row['tflops']:6.1f} TFLOP/s  ref {ref_ms:8.3f} ms  x{row['speedup']:.1f}  "
          f"err {err:.1e} (ref {ref_err:.1e})  tiles {used}", flush=True)


def markdown(env: dict, rows: list[dict]) -> str:
    from benchmarks.gpu_timing import env_line

    lines = [
        "# Chunked-prefill context attention: kernel vs reference",
        "",
        env_line(env),
        f"Llama-3-8B attention ({HEADS} heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}), page {BLOCK_SIZE}, "
        "pages in random order, one chunk per call, bf16 q/k/v. Kernel: runtime/kernels/prefill_context.py, GPU "
        "time from CUDA-graph replays with L2 flushed before each call ('eager' includes the launcher). "
        "Reference: runtime.attention.prefill_context_attention (gather + dequantize + SDPA), eager -- it syncs "
        "with the host. TFLOP/s counts the keys each query sees (context + causal chunk). Errors: relative, "
        f"against fp32 attention over the dequantized cache, first and last {CHECK_ROWS} queries. V scales "
        "(per-token formats): on V, dequantized in fp32 (the launcher's default) or on p (p_scale).",
        "",
        "| context | chunk | format | V scales | kernel ms | TFLOP/s | eager ms | reference ms | speedup | kernel err | reference err | tiles (m, n, warps, stages) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["tiles"]
        lines.append(
            f"| {r['ctx']} | {r['chunk']} | {r['format']} | {V_SCALES[r['p_scale']]} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['eager_ms']:.3f} | "
            f"{r['ref_ms']:.3f} | {r['speedup']:.1f}x | {r['relerr_vs_fp32']:.1e} | {r['ref_relerr_vs_fp32']:.1e} | "
            f"({t['block_m']}, {t['block_n']}, {t['num_warps']}, {t['num_stages']}) |")
    return "\n".join(lines) + "\n"


def smoke() -> None:
    """No GPU: the --quick shape shrunk, under the interpreter, errors only (per-token formats both ways)."""
    case = Case(1024, 48, "cpu")
    for name, fmt in FORMATS.items():
        cache = case.cache(fmt)
        args = case.args(cache)
        pick = case.check_rows()
        truth = case.reference(cache)
        ref_err = relerr(ref_ops.prefill_context_attention(*args)[pick], truth)
        for p_scale in (True, False) if fmt.dynamic else (True,):
            err = relerr(prefill_context_attention(*args, plan=plan_for(args, None, p_scale))[pick], truth)
            where = V_SCALES[p_scale if fmt.dynamic else None]
            print(f"{name:14s} {where} kernel err {err:.1e}  reference err {ref_err:.1e}", flush=True)
            assert err <= 2 * ref_err + 1e-2, (name, p_scale, err, ref_err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="only 8192 + 512")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--tune", default="", help="CTXxCHUNK whose runs also try TUNE_TILES, e.g. 32768x512")
    ap.add_argument("--p-scale", choices=("on", "off", "both"), default="off",
                    help="per-token formats: V's scales on V in fp32 (off, the default), on p (on), or a row each")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        smoke()
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.gpu_timing import gpu_env

    default = prefill_plan(KVFormat("bf16"), "cuda", q_dtype=torch.bfloat16)
    env = gpu_env(defaults={k: getattr(default, k) for k in ("block_m", "block_n", "num_warps", "num_stages")})
    grid = [(8192, 512)] if args.quick else GRID
    rows: list[dict] = []
    with open(out / "prefill_context.jsonl", "w") as sink:
        sink.write(json.dumps(env) + "\n")
        for ctx, chunk in grid:
            print(f"context {ctx} + chunk {chunk}", flush=True)
            case = Case(ctx, chunk, "cuda")
            tiles = [None] + (TUNE_TILES if args.tune == f"{ctx}x{chunk}" else [])
            for name in args.formats.split(","):
                ways = {"on": (True,), "off": (False,), "both": (True, False)}[args.p_scale]
                for p_scale in ways if FORMATS[name].dynamic else (True,):
                    run_case(case, name, tiles, rows, sink, p_scale)
                    torch.cuda.empty_cache()
            del case
    (out / "prefill_context.md").write_text(markdown(env, rows))
    print(markdown(env, rows))


if __name__ == "__main__":
    main()
