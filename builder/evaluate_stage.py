"""The `evaluate` stage: the engine's KV format against the same model with unquantized KV.

Both backends are evaluated on the embedded runtime (design.md: it is the
reference). A TensorRT-LLM engine is evaluated with TensorRT-LLM's numerics:
one scale per layer, max(k, v), for K and V alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .pipeline import Context


def _engine_spec(ctx: Context) -> Any:
    from calibration.evaluate import EngineKV, engine_kv_from_dir

    name = ctx.recipe.name
    if ctx.recipe.backend != "tensorrt-llm":
        return engine_kv_from_dir(ctx.dirs["build"], name)
    fmt = ctx.recipe.kv_format()
    if not fmt.static:
        return EngineKV(name, fmt, note="tensorrt-llm engine, unquantized KV")
    from .engine_build import calibrated_scales

    k, v = calibrated_scales(ctx, fmt)
    s = torch.maximum(k, v)
    return EngineKV(name, fmt, s, s, note="tensorrt-llm numerics: one scale per layer = max(k, v)")


def evaluate_engine(ctx: Context, out: Path) -> dict[str, Any]:
    from calibration.evaluate import run_evaluation

    r = ctx.recipe
    spec = _engine_spec(ctx)
    if not spec.quantized:  # the baseline itself: nothing to lose, nothing to measure
        return {"summary": f"unquantized KV ({r.kv_label()}): the reference", "violations": []}
    res = run_evaluation(ctx.dirs["convert"], [spec], out_dir=out, settings=r.accuracy,
                         budget=r.accuracy, device=ctx.device, progress=True)
    e = res["engines"][r.name]
    base_pk = res["baseline"]["passkey"]["rate"]
    violations = [v["message"] for v in res.get("violations", [])]
    outputs = {
        "perplexity_baseline": res["baseline"]["perplexity"]["perplexity"],
        "perplexity": e["perplexity"]["perplexity"],
        "perplexity_increase_pct": e["perplexity"]["change_pct"],
        "greedy_agreement": e["greedy"]["agreement"],
        "passkey_rate": e["passkey"]["rate"],
        "passkey_rate_baseline": base_pk,
        "violations": violations,
        "evaluation_path": res.get("path"),
    }
    outputs["summary"] = (f"ppl {outputs['perplexity_increase_pct']:+.2f}%, greedy {outputs['greedy_agreement']:.2f}, "
                          f"passkey {outputs['passkey_rate']:.2f} (base {base_pk:.2f})"
                          + (" — BUDGET BROKEN" if violations else " — within budget"))
    return outputs
