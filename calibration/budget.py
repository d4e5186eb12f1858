"""Turn accuracy results into pass/fail against the recipe's accuracy budget.

The budget names three limits (recipes.schema.AccuracySection):
`max_perplexity_increase_pct`, `min_passkey_rate_relative` (engine passkey
rate / baseline rate) and `min_greedy_agreement`. `check_budget` returns one
`Violation` per broken limit, each with a message that says which engine,
which metric, by how much, and what to do about it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Violation:
    engine: str
    metric: str
    value: float
    limit: float
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


def _get(budget: Any, name: str) -> float | None:
    v = budget.get(name) if isinstance(budget, Mapping) else getattr(budget, name, None)
    return None if v is None else float(v)


def check_engine(name: str, r: Mapping[str, Any], budget: Any) -> list[Violation]:
    out: list[Violation] = []
    hint = (
        "try a finer granularity (per_head / per_token), another scale policy (--policy mse), "
        "or pass --allow-accuracy-regression to keep it anyway."
    )
    limit = _get(budget, "max_perplexity_increase_pct")
    ppl = r.get("perplexity")
    if limit is not None and ppl and ppl.get("change_pct") is not None:
        v = float(ppl["change_pct"])
        if v > limit:
            out.append(Violation(name, "perplexity_change_pct", v, limit,
                                 f"{name}: perplexity {v:+.2f}% vs unquantized KV exceeds the budget "
                                 f"+{limit:.2f}% by {v - limit:.2f} points; {hint}"))
    limit = _get(budget, "min_greedy_agreement")
    g = r.get("greedy")
    if limit is not None and g and g.get("agreement") is not None:
        v = float(g["agreement"])
        if v < limit:
            out.append(Violation(name, "greedy_agreement", v, limit,
                                 f"{name}: greedy-token agreement {v:.1%} is below the budget {limit:.1%} "
                                 f"by {limit - v:.1%}; {hint}"))
    limit = _get(budget, "min_passkey_rate_relative")
    p = r.get("passkey")
    if limit is not None and p and p.get("rate_relative") is not None:
        v = float(p["rate_relative"])
        if v < limit:
            out.append(Violation(name, "passkey_rate_relative", v, limit,
                                 f"{name}: passkey retrieval at {v:.2f}x the baseline rate is below the "
                                 f"budget {limit:.2f}x (short by {limit - v:.2f}); {hint}"))
    return out


def check_budget(results: Mapping[str, Any], budget: Any) -> list[Violation]:
    """Violations for every engine in `results["engines"]` (an accuracy.json dict)."""
    out: list[Violation] = []
    for name, r in results.get("engines", {}).items():
        out.extend(check_engine(name, r, budget))
    return out


def enforce_budget(results: Mapping[str, Any], budget: Any, allow_regression: bool = False) -> list[Violation]:
    """Raise AccuracyBudgetError listing every violation, unless `allow_regression`.

    Returns the violations (empty when every engine is within budget), so the
    caller can still print them as warnings when regressions are allowed.
    """
    from runtime.errors import AccuracyBudgetError

    violations = check_budget(results, budget)
    if violations and not allow_regression:
        lines = "\n  ".join(v.message for v in violations)
        raise AccuracyBudgetError(
            f"{len(violations)} accuracy budget violation(s):\n  {lines}\n"
            "Re-run with --allow-accuracy-regression to accept these engines."
        )
    return violations
