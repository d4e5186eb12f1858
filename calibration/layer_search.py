"""Per-layer KV precision: what the search measures and how it chooses by size.

- Scoring, through the engine (Engine.score, the same numerics as serving): the mean negative
  log-likelihood per token of fixed windows with a KV format per layer (EngineScorer). Perplexity is
  exp(NLL), so a perplexity budget of +p% is a NLL budget of log(1 + p/100).
- Sensitivity: with every layer in a reference format (the ladder's top, the option with the most
  bytes), then with exactly one layer i in option f: sens[i][f] = NLL(i in f) - NLL(top). Per-layer NLL
  increases add up to first order.
- Choice by size (kv.target_bits_per_element), a multiple-choice knapsack solved greedily: every layer
  starts at the top and walks down the lower convex hull of its (bytes, sensitivity) options; the step
  taken next is the one that costs the least NLL per byte saved, anywhere in the model (ties: lowest
  layer), until the cache fits. Negative measured sensitivities (noise) count as zero.
- Held-out check: a choice, and every candidate as a uniform format, scored against unquantized KV.

The choice under a perplexity budget (verified descent from the best uniform format) is in
calibration/budget_search.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.config import ModelConfig
from runtime.errors import InputError
from runtime.kv_format import KVFormat, kv_bytes_per_token
from runtime.layer_formats import LayerFormats

from .engine_check import baseline_format, evaluation_engine
from .perplexity import perplexity

Scales = dict[KVFormat, tuple[torch.Tensor, torch.Tensor]]  # static candidate -> k, v [layers(, kv_heads)]


def pct_to_nll(pct: float) -> float:
    return math.log1p(pct / 100.0)


def nll_to_pct(nll: float) -> float:
    return math.expm1(nll) * 100.0


def ladder(candidates: Sequence[KVFormat], cfg: ModelConfig) -> tuple[KVFormat, ...]:
    """Candidates by one layer's bytes per token, most first (stable for equal sizes)."""
    if len(set(candidates)) != len(candidates) or len(candidates) < 2:
        raise InputError("search.formats: list at least two different KV formats.")
    return tuple(sorted(candidates, key=lambda f: -f.bytes_per_token_head(cfg.head_dim)))


@dataclass
class Sensitivity:
    """What step 1 measured: candidates (ladder order), NLL of the baseline and of the top format,
    and sens[layer][candidate] (0 for the top)."""

    candidates: tuple[KVFormat, ...]
    layer_bytes: list[float]  # bytes per token of one layer in each candidate
    base_nll: float
    top_nll: float
    sens: list[list[float]] = field(default_factory=list)

    @property
    def top_offset(self) -> float:
        """NLL the top format itself costs against unquantized KV in the model dtype."""
        return self.top_nll - self.base_nll

    def predicted(self, choice: Sequence[int]) -> float:
        """Predicted NLL increase over the baseline of a choice (candidate index per layer)."""
        return self.top_offset + sum(max(0.0, self.sens[i][j]) for i, j in enumerate(choice))

    def formats(self, choice: Sequence[int]) -> LayerFormats:
        return tuple(self.candidates[j] for j in choice)

    def to_dict(self) -> dict:
        return {"candidates": [f.name for f in self.candidates], "layer_bytes": self.layer_bytes,
                "base_nll": self.base_nll, "top_nll": self.top_nll, "sens_nll": self.sens}

    @classmethod
    def from_dict(cls, d: dict, parse: Callable[[str], KVFormat]) -> "Sensitivity":
        """to_dict's inverse (parse: a format name -> KVFormat)."""
        return cls(tuple(parse(n) for n in d["candidates"]), list(d["layer_bytes"]), d["base_nll"], d["top_nll"],
                   [list(r) for r in d["sens_nll"]])


# ------------------------------------------------------------------ scoring
def layer_scales(formats: LayerFormats, scales: Scales) -> tuple[list | None, list | None]:
    """Each static layer's scales, from its format's calibrated [layers(, kv_heads)] ones (None where dynamic)."""
    if not any(f.static for f in formats):
        return None, None
    missing = sorted({f.name for f in formats if f.static and f not in scales})
    if missing:
        raise InputError(f"{', '.join(missing)} need calibrated scales; run the calibrate stage first.")
    k = [scales[f][0][i] if f.static else None for i, f in enumerate(formats)]
    v = [scales[f][1][i] if f.static else None for i, f in enumerate(formats)]
    return k, v


class EngineScorer:
    """Mean NLL of fixed windows through an engine of the given per-layer formats (one shared model).
    The engine is deterministic for fixed windows, so each configuration runs once (`passes` counts runs)."""

    def __init__(self, model, model_dir: str | Path, windows: torch.Tensor, scales: Scales,
                 batch_invariant: bool = True, attention: str = "auto"):
        self.model, self.model_dir, self.windows, self.scales = model, model_dir, windows, scales
        self.batch_invariant, self.attention = batch_invariant, attention
        self.passes = 0
        self._seen: dict[LayerFormats, float] = {}

    def nll(self, formats: LayerFormats) -> float:
        formats = tuple(formats)
        if formats not in self._seen:
            self._seen[formats] = self._run(formats)
        return self._seen[formats]

    def _run(self, formats: LayerFormats) -> float:
        k, v = layer_scales(formats, self.scales)
        eng = evaluation_engine(self.model, self.model_dir, formats, k, v, longest=int(self.windows.shape[1]),
                                batch=max(1, int(self.windows.shape[0])), batch_invariant=self.batch_invariant,
                                attention=self.attention)
        try:
            self.passes += 1
            return perplexity(eng, self.windows)["nll_per_token"]
        finally:
            eng.shutdown()


def measure_sensitivity(scorer: EngineScorer, candidates: Sequence[KVFormat],
                        advance: Callable[[int], None] | None = None) -> Sensitivity:
    cfg = scorer.model.cfg
    cands = ladder(candidates, cfg)
    n = cfg.num_layers
    base = scorer.nll((baseline_format(scorer.model),) * n)
    top = scorer.nll((cands[0],) * n)
    s = Sensitivity(cands, [2 * cfg.num_kv_heads * f.bytes_per_token_head(cfg.head_dim) for f in cands], base, top)
    for i in range(n):
        row = [0.0]
        for f in cands[1:]:
            formats = tuple(f if j == i else cands[0] for j in range(n))
            row.append(scorer.nll(formats) - top)
            if advance is not None:
                advance(1)
        s.sens.append(row)
    return s


# ------------------------------------------------------------------- choice
def _hull(bytes_: list[float], cost: list[float]) -> list[int]:
    """Indices of the lower convex hull of (bytes, cost), from the most bytes down: the options worth
    stepping through (dominated ones and those above the hull are never the cheapest step)."""
    front: list[int] = []  # bytes strictly falling, cost strictly rising
    for j in sorted(range(len(bytes_)), key=lambda j: (-bytes_[j], cost[j], j)):
        if front and bytes_[j] == bytes_[front[-1]]:
            continue  # as large and no cheaper than the one kept
        while front and cost[front[-1]] >= cost[j]:
            front.pop()  # more bytes for no less cost: dominated
        front.append(j)

    def rate(a: int, b: int) -> float:  # NLL per byte saved going from a to b
        return (cost[b] - cost[a]) / (bytes_[a] - bytes_[b])

    hull: list[int] = []
    for j in front:
        while len(hull) >= 2 and rate(hull[-1], j) <= rate(hull[-2], hull[-1]):
            hull.pop()  # above the chord: stepping past it is cheaper per byte
        hull.append(j)
    return hull


def hulls_of(s: Sensitivity) -> tuple[list[list[float]], list[list[int]]]:
    """Each layer's costs (negative sensitivities, noise, as zero) and the hull of its options."""
    costs = [[max(0.0, c) for c in row] for row in s.sens]
    return costs, [_hull(s.layer_bytes, row) for row in costs]


def cheapest_step(layer_bytes: Sequence[float], costs: list[list[float]], hulls: list[list[int]], pos: list[int],
                  done: list[bool]) -> tuple[float, int, int, int] | None:
    """(NLL per byte saved, layer, from option, to option) of the cheapest next hull step of a layer not
    done (ties: the lowest layer); None when every layer is done."""
    best = None
    for i, (h, p) in enumerate(zip(hulls, pos)):
        if done[i]:
            continue
        a, b = h[p], h[p + 1]
        rate = (costs[i][b] - costs[i][a]) / (layer_bytes[a] - layer_bytes[b])
        if best is None or rate < best[0]:
            best = (rate, i, a, b)
    return best


def choose(s: Sensitivity, *, max_nll: float | None = None, max_layer_bytes: float | None = None) -> list[int]:
    """A candidate index per layer: the smallest cache within a predicted NLL budget (`max_nll`, the
    increase over unquantized KV), or the most accurate within a size (`max_layer_bytes`, bytes per
    token summed over layers). Deterministic: ties go to the lowest layer."""
    if (max_nll is None) == (max_layer_bytes is None):
        raise ValueError("give exactly one of max_nll and max_layer_bytes")
    n = len(s.sens)
    costs, hulls = hulls_of(s)
    pos = [0] * n  # position on each layer's hull
    choice = [h[0] for h in hulls]
    total_cost = s.top_offset + sum(costs[i][choice[i]] for i in range(n))
    total_bytes = sum(s.layer_bytes[j] for j in choice)
    done = [len(h) < 2 for h in hulls]
    while not all(done):
        if max_layer_bytes is not None and total_bytes <= max_layer_bytes:
            break
        _, i, a, b = cheapest_step(s.layer_bytes, costs, hulls, pos, done)
        step = costs[i][b] - costs[i][a]
        if max_nll is not None and total_cost + step > max_nll:
            done[i] = True  # its later steps cost at least as much per byte: the layer stays here
            continue
        pos[i] += 1
        choice[i] = b
        total_cost += step
        total_bytes += s.layer_bytes[b] - s.layer_bytes[a]
        done[i] = pos[i] + 1 >= len(hulls[i])
    if max_layer_bytes is not None and total_bytes > max_layer_bytes:
        smallest = sum(min(s.layer_bytes) for _ in range(n))
        raise InputError(f"kv.target_bits_per_element: no choice of search.formats is that small (the smallest, "
                         f"every layer in {s.candidates[-1].name}, takes {smallest:.0f} bytes per token); raise the "
                         "target or add a smaller format to search.formats.")
    return choice


# --------------------------------------------------------------- held out
def heldout_change(scorer: EngineScorer, configs: dict[str, LayerFormats]) -> dict[str, dict]:
    """Perplexity change (%) against unquantized KV, per named per-layer configuration."""
    n = scorer.model.cfg.num_layers
    base = scorer.nll((baseline_format(scorer.model),) * n)
    out = {}
    for name, formats in configs.items():
        nll = scorer.nll(formats)
        out[name] = {"ppl_change_pct": nll_to_pct(nll - base), "nll_per_token": nll,
                     "bytes_per_token": kv_bytes_per_token(scorer.model.cfg, formats)}
    out["_baseline"] = {"nll_per_token": base, "perplexity": math.exp(base)}
    return out


def best_uniform(held: dict[str, dict], names: Sequence[str], max_pct: float, choice: str) -> dict:
    """The smallest uniform format (of `names`, keys of `held`) within `max_pct` on held-out text,
    and how many fewer bytes the per-layer `choice` takes than it."""
    fitting = [n for n in names if held[n]["ppl_change_pct"] <= max_pct]
    if not fitting:
        return {"best": None, "note": "no uniform candidate meets the budget"}
    best = min(fitting, key=lambda n: (held[n]["bytes_per_token"], held[n]["ppl_change_pct"]))
    ub, mb = held[best]["bytes_per_token"], held[choice]["bytes_per_token"]
    return {"best": best, "best_bytes_per_token": ub, "best_ppl_change_pct": held[best]["ppl_change_pct"],
            "saving_pct": 100.0 * (1 - mb / ub)}
