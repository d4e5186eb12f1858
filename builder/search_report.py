"""The search stage's report: search.md (tables) and search.png (sensitivity map, accuracy vs bytes)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

from runtime.config import ModelConfig  # noqa: E402

CHOICE = "auto"


def _pct(nll: float) -> float:
    return math.expm1(nll) * 100.0


def _bits(cfg: ModelConfig, layer_bytes: float) -> float:
    return 8 * layer_bytes / (2 * cfg.num_kv_heads * cfg.head_dim)


def markdown(result: dict[str, Any], cfg: ModelConfig) -> str:
    s = result["sensitivity"]
    cands, held = s["candidates"], result["heldout"]  # cands: the sensitivities' options, the start first
    fp16 = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    goal = (f"smallest cache within +{result['max_perplexity_increase_pct']:g}% perplexity"
            if result["mode"] == "budget" else f"most accurate within {result['target_bits_per_element']:g} bits/element")
    lines = [
        "# Per-layer KV formats", "",
        f"- Goal: {goal}.",
        f"- Chosen: `{result['kv_format']}`: {result['bytes_per_token']:.0f} bytes/token, "
        f"{result['bits_per_element']:.2f} bits/element, {fp16 / result['bytes_per_token']:.2f}x the tokens of FP16 KV.",
        f"- Held-out perplexity ({result['eval_data']}, {result['eval_tokens']} tokens): "
        f"{held[CHOICE]['ppl_change_pct']:+.2f}% against unquantized KV.",
        f"- Sensitivity: {result['num_samples']} x {result['seq_len']} calibration tokens, one engine run per layer "
        f"and option; checks on {result['validation_samples'] or result['num_samples']} x {result['seq_len']} "
        f"{'validation' if result['validation_samples'] else 'calibration'} tokens ({result['engine_runs']} engine "
        "runs in all, held-out ones included).",
    ]
    if result.get("start"):
        lines.append(f"- Start: `{result['start']}`, the smallest candidate within {result['margin']:g} x the budget "
                     "as a uniform format on the check windows; every layer descends from it.")
    u = result.get("uniform") or {}
    if u.get("best"):
        lines.append(f"- Best uniform format within the budget: `{u['best']}` ({u['best_bytes_per_token']:.0f} "
                     f"bytes/token, {u['best_ppl_change_pct']:+.2f}%); the per-layer choice takes "
                     f"{u['saving_pct']:.1f}% fewer bytes.")
    elif u:
        lines.append(f"- {u.get('note')}.")
    lines += ["", "## Every format as a uniform cache (held-out text)", "",
              "| KV | bytes/token | bits/element | ppl change |", "|---|---|---|---|"]
    for name in [CHOICE, *result["candidates"]]:
        h = held[name]
        bits = 8 * h["bytes_per_token"] / (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim)
        label = "**per-layer choice**" if name == CHOICE else f"`{name}`"
        lines.append(f"| {label} | {h['bytes_per_token']:.0f} | {bits:.2f} | {h['ppl_change_pct']:+.2f}% |")
    lines += ["", "## Checks (engine runs on the check windows, in order)", "",
              "| check | bits/element | predicted | measured | data | kept |", "|---|---|---|---|---|---|"]
    for c in result["checks"]:
        p = "—" if c["predicted_pct"] is None else f"{c['predicted_pct']:+.2f}%"
        lines.append(f"| {c['label']} | {c['bits_per_element']:.2f} | {p} | {c['measured_pct']:+.2f}% | {c['data']} | "
                     f"{'yes' if c['kept'] else 'no'} |")
    head = " | ".join(f"{c} ({_bits(cfg, b):.2f} b)" for c, b in zip(cands[1:], s["layer_bytes"][1:]))
    lines += ["", "## Layers: chosen format and sensitivity", "",
              f"Perplexity change with only that layer's K and V in the format (every other layer in `{cands[0]}`).", "",
              f"| layer | format | {head} |", "|---|---|" + "---|" * (len(cands) - 1)]
    for i, (fmt, row) in enumerate(zip(result["layer_formats"], s["sens_nll"])):
        cells = " | ".join(f"{_pct(x):+.2f}%" for x in row[1:])
        lines.append(f"| {i} | `{fmt}` | {cells} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], cfg: ModelConfig, path: Path) -> None:
    s = result["sensitivity"]
    cands, held = s["candidates"], result["heldout"]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, max(4.0, 0.22 * cfg.num_layers + 1.5)))
    if len(cands) > 1:
        grid = [[_pct(x) for x in row[1:]] for row in s["sens_nll"]]
        im = ax0.imshow(grid, aspect="auto", cmap="viridis")
        fig.colorbar(im, ax=ax0, label="ppl change, that layer alone (%)")
        ax0.set_xticks(range(len(cands) - 1), cands[1:], rotation=30, ha="right", fontsize=8)
        ax0.set_yticks(range(0, cfg.num_layers, max(1, cfg.num_layers // 15)))
        ax0.set_ylabel("layer (K and V)")
        for i, name in enumerate(result["layer_formats"]):
            if name in cands[1:]:
                ax0.plot(cands.index(name) - 1, i, "o", color="red", ms=4)
        ax0.set_title(f"sensitivity; red: chosen (else {cands[0]})", fontsize=9)
    else:
        ax0.text(0.5, 0.5, f"every layer in {cands[0]}: no option below it", ha="center", va="center", fontsize=9)
        ax0.set_axis_off()
    for name in result["candidates"]:
        h = held[name]
        ax1.plot(h["bytes_per_token"], h["ppl_change_pct"], "o", color="tab:blue")
        ax1.annotate(name, (h["bytes_per_token"], h["ppl_change_pct"]), fontsize=7, xytext=(3, 3),
                     textcoords="offset points")
    h = held[CHOICE]
    ax1.plot(h["bytes_per_token"], h["ppl_change_pct"], "*", color="red", ms=14, label="per-layer choice")
    if result.get("max_perplexity_increase_pct") is not None:
        ax1.axhline(result["max_perplexity_increase_pct"], color="gray", ls="--", label="budget")
    ax1.set_yscale("symlog", linthresh=1.0)
    ax1.set_xlabel("KV bytes per token")
    ax1.set_ylabel("held-out perplexity change (%)")
    ax1.set_title("accuracy vs bytes", fontsize=9)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(result: dict[str, Any], cfg: ModelConfig, out: Path) -> None:
    (out / "search.md").write_text(markdown(result, cfg))
    plot(result, cfg, out / "search.png")
