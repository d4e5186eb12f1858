"""The per-layer KV choice under a perplexity budget: verified descent from the best uniform format.

1. Uniform first. Every candidate, as a uniform format, is scored on the verification windows
   (search.validation_samples calibration windows, or the sensitivities' windows when there are none):
   one engine run each. The search starts from the smallest one within margin x budget there, so it can
   only return fewer bytes than that format. When none is within it, the search stops with an
   AccuracyBudgetError naming the budget.
2. Options below the start. A layer may take any pair of a candidate's K side and a candidate's V side
   that the engine stores (a format name it parses: `k.<K>+v.<V>`, or one name when they agree) with
   fewer bytes than the start. A new candidate format needs no code here.
3. Sensitivity of every layer to every option, measured with every other layer in the start format
   (calibration/layer_search.py measure_sensitivity): layers x options engine runs.
4. Descent. Every layer walks down the lower convex hull of its (bytes, sensitivity) options; the steps
   are taken cheapest NLL per byte saved first (ties: the lowest layer), a batch at a time: the steps
   the sensitivities predict fit the room left under margin x budget. Each batch is verified through
   the engine on the verification windows; a batch that breaks margin x budget is undone and retried
   at half its size, a single step that breaks it freezes its layer. The descent stops when no step
   fits. The summed sensitivities only order the steps: every kept step was measured.

Size mode (kv.target_bits_per_element) is the knapsack of layer_search.choose over the candidates.
Deterministic: the same model, windows and settings give the same checks and the same choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from runtime.config import ModelConfig
from runtime.engine_dir import parse_kv_format_name
from runtime.errors import AccuracyBudgetError, KvqError
from runtime.kv_format import KVFormat
from runtime.layer_formats import LayerFormats, bits_per_element, formats_name

from .engine_check import baseline_format
from .layer_search import (
    EngineScorer,
    Sensitivity,
    cheapest_step,
    choose,
    hulls_of,
    ladder,
    measure_sensitivity,
    nll_to_pct,
    pct_to_nll,
)

# The change a choice must stay under on the verification windows, as a fraction of the budget: the held-out
# text is not the calibration data, and on SmolLM2 a choice that just met its budget on calibration windows
# missed it on the held-out split by up to 2x (+0.5% -> +1.01%); the margin keeps room for that difference.
VALIDATION_MARGIN = 0.75

Progress = Callable[[int], Callable[[int], None]]  # number of sensitivity runs -> advance(n)


@dataclass
class Check:
    """One configuration scored on the verification windows: a uniform candidate or a descent batch."""

    kind: str  # "uniform", "descent" or "size"
    label: str
    formats: LayerFormats
    measured_nll: float  # increase over unquantized KV on `data`
    predicted_nll: float | None  # from the sensitivities (None for a uniform candidate)
    data: str  # "validation" or "calibration" (the sensitivities' windows)
    kept: bool  # the start (uniform), a batch that stayed, the size-mode choice


@dataclass
class SearchResult:
    formats: LayerFormats
    sensitivity: Sensitivity
    checks: list[Check] = field(default_factory=list)
    start: KVFormat | None = None  # budget mode: the uniform format the descent started from


def layer_bytes(f: KVFormat, cfg: ModelConfig) -> float:
    """Bytes per token of one layer's K and V in format f."""
    return 2 * cfg.num_kv_heads * f.bytes_per_token_head(cfg.head_dim)


def compose(k: KVFormat, v: KVFormat) -> KVFormat | None:
    """The format storing K as `k` and V as `v` (single-sided formats), or None where the engine has none."""
    try:
        return parse_kv_format_name(k.name if k == v else f"k.{k.name}+v.{v.name}")
    except KvqError:
        return None


def layer_options(candidates: Sequence[KVFormat], start: KVFormat, cfg: ModelConfig) -> tuple[KVFormat, ...]:
    """`start` and every pairing of a candidate's K side with a candidate's V side that has fewer bytes,
    most bytes first (equal sizes by name, so the order does not depend on the candidates' order)."""
    ks = sorted({c.k for c in candidates}, key=lambda f: f.name)
    vs = sorted({c.v for c in candidates}, key=lambda f: f.name)
    below = {f for k in ks for v in vs if (f := compose(k, v)) is not None
             and layer_bytes(f, cfg) < layer_bytes(start, cfg)}
    return (start, *sorted(below, key=lambda f: (-layer_bytes(f, cfg), f.name)))


def _sensitivity(scorer: EngineScorer, options: Sequence[KVFormat], cache: dict | None,
                 progress: Progress | None) -> Sensitivity:
    key = tuple(f.name for f in options)
    if cache is not None and key in cache:
        return cache[key]
    cfg = scorer.model.cfg
    if len(options) < 2:  # nothing below the start: no sensitivity to measure
        base = scorer.nll((baseline_format(scorer.model),) * cfg.num_layers)
        s = Sensitivity(tuple(options), [layer_bytes(options[0], cfg)], base, scorer.nll((options[0],) * cfg.num_layers),
                        [[0.0] for _ in range(cfg.num_layers)])
    else:
        advance = progress(cfg.num_layers * (len(options) - 1)) if progress else None
        s = measure_sensitivity(scorer, options, advance)
    if cache is not None:
        cache[key] = s
    return s


def _steps_label(s: Sensitivity, plan: list[tuple[int, int]]) -> str:
    shown = ", ".join(f"L{i}: {s.candidates[b].name}" for i, b in plan[:4])
    return shown + (f" and {len(plan) - 4} more" if len(plan) > 4 else "")


def descend(verifier: EngineScorer, s: Sensitivity, base_nll: float, start_nll: float, target_nll: float,
            data: str, checks: list[Check]) -> list[int]:
    """Step 4: an option index per layer (0: the start), every kept batch verified within `target_nll`
    (the increase over unquantized KV on the verifier's windows, `base_nll` there; the start measured
    `start_nll`). Appends one Check per engine run to `checks`."""
    n = len(s.sens)
    costs, hulls = hulls_of(s)
    # every layer starts at the start (option 0), even where the hull begins lower (a free option dominates it):
    # every change is verified
    hulls = [h if h[0] == 0 else [0, *h] for h in hulls]
    pos, choice = [0] * n, [0] * n
    done = [len(h) < 2 for h in hulls]
    current, cap = start_nll, None  # cap: the largest batch worth trying after one broke the budget
    while not all(done):
        plan: list[tuple[int, int]] = []
        p, d, predicted = list(pos), list(done), 0.0
        while cap is None or len(plan) < cap:
            step = cheapest_step(s.layer_bytes, costs, hulls, p, d)
            if step is None:
                break
            _, i, a, b = step
            if plan and predicted + costs[i][b] - costs[i][a] > target_nll - current:
                break  # the sensitivities say the next step no longer fits: verify what the batch holds
            plan.append((i, b))
            predicted += costs[i][b] - costs[i][a]
            p[i] += 1
            d[i] = p[i] + 1 >= len(hulls[i])
        trial = list(choice)
        for i, b in plan:
            trial[i] = b
        measured = verifier.nll(s.formats(trial)) - base_nll
        kept = measured <= target_nll
        checks.append(Check("descent", _steps_label(s, plan), s.formats(trial), measured, s.predicted(trial), data,
                            kept))
        if kept:
            choice, pos, done, current = trial, p, d, measured
            cap = None if cap is None else 2 * cap
        elif len(plan) == 1:
            done[plan[0][0]] = True  # undone; its later steps cost at least as much per byte: the layer stays
        else:
            cap = len(plan) // 2
    return choice


def search(scorer: EngineScorer, candidates: Sequence[KVFormat], *, max_pct: float | None = None,
           target_bits: float | None = None, validator: EngineScorer | None = None,
           margin: float = VALIDATION_MARGIN, sensitivities: dict | None = None,
           progress: Progress | None = None) -> SearchResult:
    """The per-layer formats: under a perplexity budget (`max_pct`, steps 1-4 of the module docstring) or
    within a size (`target_bits` per K/V element, layer_search.choose). `sensitivities`: a cache shared by
    searches on the same windows (keyed by the options' names); `progress`: a bar for the sensitivity runs."""
    if (max_pct is None) == (target_bits is None):
        raise ValueError("give exactly one of max_pct and target_bits")
    cfg = scorer.model.cfg
    n = cfg.num_layers
    if target_bits is not None:
        s = _sensitivity(scorer, ladder(candidates, cfg), sensitivities, progress)
        choice = choose(s, max_layer_bytes=target_bits / 8 * 2 * n * cfg.num_kv_heads * cfg.head_dim)
        formats = s.formats(choice)
        check = Check("size", f"within {target_bits:g} bits/element", formats, scorer.nll(formats) - s.base_nll,
                      s.predicted(choice), "calibration", True)
        return SearchResult(formats, s, [check])
    verifier, data = (validator, "validation") if validator is not None else (scorer, "calibration")
    target = pct_to_nll(max_pct) * margin
    base = verifier.nll((baseline_format(verifier.model),) * n)
    checks = []
    for f in ladder(candidates, cfg):
        checks.append(Check("uniform", f"uniform {f.name}", (f,) * n, verifier.nll((f,) * n) - base, None, data,
                            False))
    fitting = [c for c in checks if c.measured_nll <= target]
    if not fitting:
        best = min(checks, key=lambda c: c.measured_nll)
        raise AccuracyBudgetError(
            f"accuracy.max_perplexity_increase_pct={max_pct:g}%: no format of search.formats meets {margin:g} x that "
            f"budget as a uniform format on the {data} windows (the most accurate, {best.formats[0].name}, measured "
            f"{nll_to_pct(best.measured_nll):+.2f}%). Add a more accurate format to search.formats, or raise the "
            "budget or search.margin.")
    start_check = min(fitting, key=lambda c: (layer_bytes(c.formats[0], cfg), c.measured_nll))
    start_check.kept = True
    start = start_check.formats[0]
    s = _sensitivity(scorer, layer_options(candidates, start, cfg), sensitivities, progress)
    choice = descend(verifier, s, base, start_check.measured_nll, target, data, checks)
    return SearchResult(s.formats(choice), s, checks, start)


def checks_to_json(checks: Sequence[Check], cfg: ModelConfig) -> list[dict]:
    """The checks as search.json and the benchmark record them (perplexity changes in %)."""
    return [{"kind": c.kind, "label": c.label, "formats": formats_name(c.formats),
             "bits_per_element": bits_per_element(cfg, c.formats), "measured_pct": nll_to_pct(c.measured_nll),
             "predicted_pct": None if c.predicted_nll is None else nll_to_pct(c.predicted_nll), "data": c.data,
             "kept": c.kept} for c in checks]
