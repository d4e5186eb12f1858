"""Readable tables of accuracy results: Markdown for files, rows for the CLI."""

from __future__ import annotations

from typing import Any

from runtime.kv_format import KVFormat

HEADER = ("engine", "KV format", "perplexity", "Δ ppl", "greedy agree", "top-1 agree [95% CI]", "engine greedy", "passkey",
          "passkey vs base", "digit logp", "attn err (max)", "budget")


def _fmt_name(r: dict) -> str:
    f = r.get("kv_format", {})
    if "layers" in f:  # a format per layer (runtime/layer_formats.py): its note names the layer runs
        return r.get("note") or "per layer"
    if f.get("v_dtype") is not None or f.get("group_size"):  # split / group formats: their KVFormat name
        name = KVFormat(**f).name
    else:
        name = f.get("dtype", "?")
        if f.get("dtype") not in ("fp32", "fp16", "bf16"):
            name += f" {f.get('granularity', '')}" + ("" if f.get("symmetric", True) else " asym")
    rot = r.get("kv_rotation", "none")  # results written before rotations existed lack the key
    return name if rot == "none" else f"{name} + {rot}"


def rows(results: dict[str, Any]) -> list[tuple[str, ...]]:
    base = results["baseline"]
    bad = {}
    for v in results.get("violations", []):
        bad.setdefault(v["engine"], []).append(v["metric"])
    bp = base["passkey"]
    out = [("baseline", base["kv"], f"{base['perplexity']['perplexity']:.4f}", "—", "100%", "100%", "—",
            f"{bp['found']}/{bp['trials']}", "1.00x", f"{_mean_logp(bp):.3f}", "—", "—")]
    for name, r in results["engines"].items():
        if "perplexity" not in r:
            out.append((name, _fmt_name(r), "(baseline)", *[""] * (len(HEADER) - 3)))
            continue
        p = r["passkey"]
        rel = "n/a" if p.get("rate_relative") is None else f"{p['rate_relative']:.2f}x"
        verdict = "—" if "violations" not in results else ("FAIL: " + ", ".join(bad[name]) if name in bad else "pass")
        out.append((
            name, _fmt_name(r), f"{r['perplexity']['perplexity']:.4f}", f"{r['perplexity']['change_pct']:+.2f}%",
            f"{r['greedy']['agreement']:.1%}", _top1(r), _engine_greedy(r), f"{p['found']}/{p['trials']}", rel,
            f"{_mean_logp(p):.3f}",
            f"{r['attention_error']['max']:.4f} (L{r['attention_error']['worst_layer']})", verdict,
        ))
    return out


def _top1(r: dict) -> str:
    t = r.get("top1")  # results written before the metric existed lack the key
    return "—" if t is None else f"{t['agreement']:.1%} [{t['ci95'][0]:.1%}, {t['ci95'][1]:.1%}]"


def _engine_greedy(r: dict) -> str:
    g = r.get("engine_greedy")
    return "—" if g is None else f"{g['position_match']:.0%} ({g['identical_prompts']}/{g['prompts']} same)"


def _mean_logp(p: dict) -> float:
    by = p["by_length"].values()
    return sum(b["mean_logprob"] * b["trials"] for b in by) / max(1, sum(b["trials"] for b in by))


def markdown_table(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
        *("| " + " | ".join(r) + " |" for r in rows(results)),
        "",
        f"Path: {results['path']} ({results['model_dtype']} model on {results['device']}, attention "
        f"{results.get('attention', '?')}, batch-invariant mode {'on' if results.get('batch_invariant') else 'off'}). "
        f"Perplexity: {results['baseline']['perplexity']['tokens_scored']} held-out tokens in windows of "
        f"{results['baseline']['perplexity']['window_len']}. Greedy: {s['greedy_prompts']} prompts x "
        f"{s['greedy_tokens']} tokens, teacher-forced on the baseline's tokens; top-1 agree: the engine's most likely "
        f"token equals the baseline's, at every scored position of the held-out text (Wilson 95% interval); "
        f"engine greedy: free-running "
        f"generation through the paged engine, positions equal to the baseline. Passkey: {s['passkey_trials']} "
        f"trials at each of {s['passkey_lengths']} tokens; digit logp = mean log-probability of the true digits.",
    ]
    by_len = [f"{n}: {b['found']}/{b['trials']}" for n, b in results["baseline"]["passkey"]["by_length"].items()]
    lines.append(f"Baseline passkey by length: {', '.join(by_len)}.")
    for v in results.get("violations", []):
        lines.append(f"- {v['message']}")
    return "\n".join(lines) + "\n"
