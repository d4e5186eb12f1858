"""The `search` stage (kv.dtype: auto): a KV format per layer, chosen through the engine.

Between calibrate and build: per-layer sensitivities on calibration data, the choice under the
recipe's budget (accuracy.max_perplexity_increase_pct) or size (kv.target_bits_per_element), then
the choice and every candidate as a uniform format scored on held-out text (accuracy.eval_data).
A choice that misses its perplexity budget on held-out text is recorded as a violation, which
stops kvq-build (AccuracyBudgetError) unless --allow-accuracy-regression.
calibration/budget_search.py holds the method; this file wires it to the recipe and writes:

    kv_format.json      the chosen per-layer formats (what the build stage copies into the engine)
    recipe_kv.yaml      the same choice as a recipe's `kv:` section, to pin it
    search.json         the uniform checks, sensitivities, descent checks, held-out results, the chosen formats
    search.md, search.png   the report: layer x format table, accuracy vs bytes against every uniform format
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml

from runtime.layer_formats import bits_per_element, formats_name, formats_to_json

from .pipeline import Context

CHOICE = "auto"


def _static_scales(ctx: Context, candidates) -> dict:
    """The static candidates' scales, exactly as the build stage will store them."""
    from .engine_build import calibrated_scales

    return {f: calibrated_scales(ctx, f) for f in candidates if f.static}


def _rotation_kwargs(recipe) -> dict[str, Any]:
    """A recipe's KV rotation (kv.rotation, docs/kv-rotation.md), where the schema has one, for load_model:
    the sensitivities must be those of the K/V the engine will store."""
    rotation = getattr(recipe.kv, "kv_rotation", None)
    return {"rotation": rotation()} if rotation is not None else {}


def run_search(ctx: Context, out: Path) -> dict[str, Any]:
    from calibration.budget_search import checks_to_json, search
    from calibration.calibrate import calibration_windows
    from calibration.layer_search import EngineScorer, best_uniform, heldout_change, ladder
    from calibration.loading import is_synthetic, load_model, load_tokenizer
    from calibration.perplexity import EVAL_SEED, eval_windows
    from calibration.progress import work_progress
    from runtime.config import ModelConfig

    r = ctx.recipe
    model_dir = ctx.dirs["convert"]
    cfg = ModelConfig.from_dir(model_dir)
    candidates = r.search.candidates()
    scales = _static_scales(ctx, candidates)
    n, nv = r.search.num_samples, r.search.validation_samples
    drawn, source = calibration_windows(model_dir, cfg, r.calibration.dataset, n + nv, r.search.seq_len,
                                        r.calibration.seed)
    windows, validation = drawn[:n], drawn[n:]  # distinct windows: the choice is verified on unseen data
    model = load_model(model_dir, device=ctx.device, **_rotation_kwargs(r))
    scorer = EngineScorer(model, model_dir, windows, scales)
    validator = EngineScorer(model, model_dir, validation, scales) if nv else None
    max_pct = None if r.kv.target_bits_per_element else r.accuracy.max_perplexity_increase_pct
    with work_progress(ctx.spinner) as bars:
        found = search(scorer, candidates, max_pct=max_pct, target_bits=r.kv.target_bits_per_element,
                       validator=validator, margin=r.search.margin,
                       progress=lambda total: bars.task("layer sensitivity", total, "runs"))
    formats, sens = found.formats, found.sensitivity

    acc = r.accuracy
    window = min(acc.perplexity_tokens, 1024)
    if is_synthetic(model_dir):  # random weights, no tokenizer: held-out random ids of another seed
        g = torch.Generator().manual_seed(EVAL_SEED)
        held_windows = torch.randint(0, cfg.vocab_size, (-(-acc.perplexity_tokens // window), window), generator=g)
    else:
        held_windows = eval_windows(load_tokenizer(model_dir), acc.perplexity_tokens, window, acc.eval_data)
    held = EngineScorer(model, model_dir, held_windows, scales)
    configs = {CHOICE: formats, **{f.name: (f,) * cfg.num_layers for f in candidates}}
    heldout = heldout_change(held, configs)
    result = {
        "mode": "size" if max_pct is None else "budget",
        "max_perplexity_increase_pct": max_pct,
        "target_bits_per_element": r.kv.target_bits_per_element,
        "calibration_data": source, "num_samples": n, "validation_samples": nv, "seq_len": r.search.seq_len,
        "margin": r.search.margin,
        "eval_data": acc.eval_data, "eval_tokens": int(held_windows.numel()),
        "candidates": [f.name for f in ladder(candidates, cfg)],
        "sensitivity": sens.to_dict(),
        "start": found.start and found.start.name,
        "checks": checks_to_json(found.checks, cfg),
        "layer_formats": [f.name for f in formats],
        "kv_format": formats_name(formats),
        "bytes_per_token": heldout[CHOICE]["bytes_per_token"],
        "bits_per_element": bits_per_element(cfg, formats),
        "heldout": heldout,
        "engine_runs": scorer.passes + held.passes + (validator.passes if validator else 0),
    }
    result["uniform"] = {} if max_pct is None else best_uniform(heldout, [f.name for f in candidates], max_pct, CHOICE)
    (out / "kv_format.json").write_text(json.dumps(formats_to_json(formats), indent=2))
    (out / "recipe_kv.yaml").write_text(yaml.safe_dump({"kv": {"layers": layer_ranges_of(formats)}},
                                                       sort_keys=False))
    (out / "search.json").write_text(json.dumps(result, indent=1))
    from .search_report import write_report

    write_report(result, cfg, out)
    change = heldout[CHOICE]["ppl_change_pct"]
    violations = []
    kept = [c for c in result["checks"] if c["kept"]][-1]
    if max_pct is not None and change > max_pct:
        violations.append(
            f"the per-layer KV formats chosen for {r.name} ({result['kv_format']}) raise held-out perplexity by "
            f"{change:+.2f}%, over accuracy.max_perplexity_increase_pct={max_pct:g}% (on {kept['data']} data "
            f"{kept['measured_pct']:+.2f}%). Raise search.num_samples / search.seq_len / "
            "search.validation_samples, lower search.margin so the "
            "sensitivities describe your text, set calibration.dataset to data like accuracy.eval_data, or "
            "loosen the budget.")
    summary = f"{result['kv_format']}: {result['bits_per_element']:.2f} bits/element, held-out ppl {change:+.2f}%"
    u = result["uniform"]
    if u.get("best"):
        summary += f"; {u['saving_pct']:.0f}% fewer bytes than the best uniform format ({u['best']})"
    return {**{k: result[k] for k in ("mode", "kv_format", "layer_formats", "bytes_per_token", "bits_per_element",
                                     "max_perplexity_increase_pct", "target_bits_per_element", "uniform")},
            "heldout_ppl_change_pct": change, "violations": violations, "summary": summary}


def layer_ranges_of(formats) -> dict[str, str]:
    from recipes.kv_section import layer_ranges

    return layer_ranges(formats)
