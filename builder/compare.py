"""`kvq compare`: engines side by side on memory, throughput and accuracy.

Every engine gets the same KV memory budget and the same workload (prompt and
output lengths, seeded prompts, concurrency levels). Memory numbers put the
planner's prediction (runtime.kv_format.kv_bytes_per_token, the one function)
next to what the engine actually allocated.
"""

from __future__ import annotations

import gc
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from recipes import Recipe, load_recipe
from runtime.errors import StageError
from runtime.kv_format import kv_bytes_per_token, residual_bytes
from runtime.runner import plan_pool

from .loadgen import random_prompts, run_closed_loop
from .pipeline import Context, read_manifest
from .planner import parse_bytes


@dataclass
class Workload:
    prompt_len: int
    output_len: int
    concurrency: list[int]
    num_requests: int
    seed: int
    memory_budget: int | None  # bytes of KV pool per engine; None = the engine's own sizing

    @classmethod
    def from_recipe(cls, r: Recipe) -> "Workload":
        c = r.compare
        budget = parse_bytes(c.memory_budget) if c.memory_budget else None
        return cls(c.prompt_len, c.output_len, sorted(set(c.concurrency)), c.num_requests, c.seed, budget)


@dataclass
class EngineUnderTest:
    label: str
    engine_dir: Path
    accuracy: dict[str, Any] | None = None


def _peak_memory_bytes(device: str) -> int:
    """CUDA: peak allocated device memory. CPU: the process's resident set after the runs."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    import psutil

    return int(psutil.Process().memory_info().rss)


def measure_engine(eut: EngineUnderTest, wl: Workload, device: str) -> dict[str, Any]:
    from runtime.engine import Engine, SamplingParams

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    ctx_len = wl.prompt_len + wl.output_len
    # seq_tokens: per-channel keys keep fp16 residual blocks for the requests of this length that fit, not more
    engine = Engine.from_dir(eut.engine_dir, device=device, memory_budget=wl.memory_budget, seq_tokens=ctx_len)
    cfg, fmt = engine.cfg, engine.formats  # one KVFormat per layer
    try:
        bpt = kv_bytes_per_token(cfg, fmt)
        block = engine.stats.block_size
        blocks = engine.stats.pool_blocks
        # The runtime's own sizing rule (plan_pool, on the planner's bytes/token) predicts the pool;
        # `measured` is what the engine really allocated.
        seqs = engine.scheduler.max_batch_size
        pplan = plan_pool(cfg, fmt, block, memory_budget=wl.memory_budget, max_num_seqs=seqs,
                          seq_tokens=ctx_len) if wl.memory_budget else None
        planned_blocks = pplan.num_blocks if pplan else blocks
        measured = engine.stats.pool_allocated_bytes  # summed over the tensors really allocated
        # per-channel keys' fp16 residual blocks are part of the pool (0 for other formats)
        planned = planned_blocks * block * bpt + residual_bytes(cfg, fmt, pplan.residual_slots if pplan else seqs)
        per_request_blocks = math.ceil(ctx_len / block)
        max_conc = max(1, min(engine.scheduler.max_batch_size, blocks // per_request_blocks))
        vocab = cfg.vocab_size
        avoid = {t for t in (cfg.bos_token_id, cfg.eos_token_id) if t is not None}
        sampling = SamplingParams(max_tokens=wl.output_len, temperature=0.0, ignore_eos=True)
        runs = []
        levels = sorted({c for c in wl.concurrency if c <= max_conc} | {max_conc})
        # warm-up: one short request so lazy initialisation stays out of the numbers
        run_closed_loop(engine, random_prompts(1, min(wl.prompt_len, 16), vocab, wl.seed + 1, avoid),
                        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), 1)
        for c in levels:
            n = max(wl.num_requests, c)
            # other prompts at each level: the prefix cache must not serve one level's prompts to the next
            prompts = random_prompts(n, wl.prompt_len, vocab, wl.seed + 7919 * c, avoid)
            res = run_closed_loop(engine, prompts, sampling, c)
            res["at_max_concurrency"] = c == max_conc
            runs.append(res)
        return {
            "label": eut.label,
            "engine_dir": str(eut.engine_dir),
            "kv_format": engine.stats.kv_format,
            "kv_rotation": engine.stats.kv_rotation,
            "bytes_per_token": bpt,
            "block_size": block,
            "pool_blocks": blocks,
            "pool_tokens": blocks * block,
            "planned_pool_blocks": planned_blocks,
            "planned_pool_bytes": planned,
            "measured_pool_bytes": measured,
            "planner_error_pct": 100 * (measured - planned) / planned if planned else float("nan"),
            "max_concurrency": max_conc,
            "context_len": ctx_len,
            "peak_memory_bytes": _peak_memory_bytes(device),
            "runs": runs,
            "accuracy": eut.accuracy,
            # the prefix cache over all runs (random prompts share little; docs/prefix_caching.md)
            "prefix_caching": engine.stats.prefix_caching,
            "prefix_hit_rate": engine.stats.prefix_hit_rate,
            "reused_tokens": engine.stats.reused_tokens,
            "prefix_evictions": engine.stats.evictions,
        }
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def measure_triton(label: str, grpc_url: str, wl: Workload) -> dict[str, Any]:
    """The same concurrency levels through a running Triton deployment (kvq bench)."""
    from triton_repo.bench import run_bench

    runs = [run_bench(grpc_url, c, max(wl.num_requests, c), max_tokens=wl.output_len)["summary"]
            for c in wl.concurrency]
    return {"label": label, "url": grpc_url, "runs": runs}


def compare_engines(engines: list[EngineUnderTest], wl: Workload, device: str, out_dir: Path,
                    title: str, triton: list[tuple[str, str]] = ()) -> dict[str, Any]:
    from .compare_report import write_report

    rows = [measure_engine(e, wl, device) for e in engines]
    report = {"title": title, "device": device, "workload": asdict(wl), "engines": rows,
              "triton": [measure_triton(label, url, wl) for label, url in triton]}
    write_report(report, out_dir)
    base = rows[0]
    best = {r["label"]: max(x["tokens_per_s"] for x in r["runs"]) for r in rows}
    summary = ", ".join(f"{r['label']}: {r['max_concurrency']} req, {best[r['label']]:.1f} tok/s" for r in rows)
    return {"report": str(out_dir / "report.md"), "engines": [r["label"] for r in rows],
            "baseline": base["label"], "summary": summary}


def compare_recipe(ctx: Context, out: Path) -> dict[str, Any]:
    """Build every variant named by the recipe (sharing converted weights and calibration), then compare."""
    engines = []
    for name in ctx.recipe.compare.variants:
        if name == ctx.recipe.name:
            sub = ctx
        else:
            if ctx.run_stages is None:
                raise StageError("compare: this context has no pipeline runner to build the variants with; "
                                 "run the compare stage through kvq-build (builder.run.build_pipeline).")
            sub = ctx.variant(load_recipe(name))
            ctx.run_stages(sub, until="evaluate", stop_on_budget=False)
        if "build" not in sub.dirs:
            raise StageError(f"compare: variant {name} has no built engine.")
        ev = sub.manifests.get("evaluate", {}).get("outputs")
        engines.append(EngineUnderTest(name, sub.dirs["build"], ev))
    return compare_engines(engines, Workload.from_recipe(ctx.recipe), ctx.device, out,
                           f"kvq compare — {ctx.recipe.name}")


def engines_from_dirs(dirs: list[Path]) -> list[EngineUnderTest]:
    out = []
    for d in dirs:
        m = read_manifest(d)
        label = (m or {}).get("recipe") or d.name
        ev_dir = d.parent / "evaluate"
        ev = (read_manifest(ev_dir) or {}).get("outputs") if ev_dir.is_dir() else None
        out.append(EngineUnderTest(label, d, ev))
    return out
