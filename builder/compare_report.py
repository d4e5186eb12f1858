"""report.md, report.json and PNG plots for `kvq compare`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

KIB, MIB = 2**10, 2**20

ACCURACY_COLUMNS = (  # (key in the evaluate outputs, column title, format)
    ("perplexity_increase_pct", "ppl Δ %", "{:+.2f}"),
    ("greedy_agreement", "greedy agree", "{:.3f}"),
    ("passkey_rate", "passkey", "{:.2f}"),
    ("passkey_rate_baseline", "passkey (base)", "{:.2f}"),
)


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return spec.format(v)


def _best(rows: list[dict[str, Any]], key: str = "tokens_per_s") -> dict[str, dict[str, Any]]:
    return {r["label"]: max(r["runs"], key=lambda x: x[key]) for r in rows}


def kv_label(r: dict[str, Any]) -> str:
    """The KV format as the tables show it: with its rotation when K/V are rotated before storing."""
    rot = r.get("kv_rotation", "none")  # reports written before rotations existed lack the key
    return r["kv_format"] if rot == "none" else f"{r['kv_format']} + {rot}"


def markdown(report: dict[str, Any]) -> str:
    rows, wl = report["engines"], report["workload"]
    base = rows[0]
    budget = f"{wl['memory_budget'] / MIB:.0f} MiB" if wl["memory_budget"] else "each engine's default"
    lines = [f"# {report['title']}", "",
             f"Device: {report['device']}. Workload: {wl['num_requests']} requests (or the concurrency, if larger) "
             f"of {wl['prompt_len']} prompt + {wl['output_len']} generated tokens, seed {wl['seed']}, greedy, "
             f"EOS ignored; KV pool budget per engine: {budget}.", ""]
    lines += ["## Memory", "",
              "| engine | KV format | KiB/token | pool tokens | max concurrent @ctx | vs baseline | planned pool MiB | "
              "measured pool MiB | planner error | peak memory MiB |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['label']} | {kv_label(r)} | {r['bytes_per_token'] / KIB:.2f} | {r['pool_tokens']:,} | "
            f"{r['max_concurrency']} @{r['context_len']} | {r['pool_tokens'] / base['pool_tokens']:.2f}x | "
            f"{r['planned_pool_bytes'] / MIB:.1f} | {r['measured_pool_bytes'] / MIB:.1f} | "
            f"{r['planner_error_pct']:+.2f}% | {r['peak_memory_bytes'] / MIB:.0f} |")
    lines += ["", "Peak memory: the device's peak allocation on CUDA, the process's resident set on CPU "
              "(weights, pool and everything else).", "", "## Throughput and latency", "",
              "| engine | concurrency | tokens/s | vs baseline @same conc. | TTFT p50 ms | TTFT p99 ms | "
              "ITL p50 ms | ITL p99 ms | mean batch | errors |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    base_tps = {x["concurrency"]: x["tokens_per_s"] for x in base["runs"]}
    for r in rows:
        for x in r["runs"]:
            ref = base_tps.get(x["concurrency"])
            rel = f"{x['tokens_per_s'] / ref:.2f}x" if ref else "-"
            tag = " (max)" if x.get("at_max_concurrency") else ""
            lines.append(
                f"| {r['label']} | {x['concurrency']}{tag} | {x['tokens_per_s']:.1f} | {rel} | "
                f"{x['ttft_p50_ms']:.1f} | {x['ttft_p99_ms']:.1f} | {x['itl_p50_ms']:.1f} | {x['itl_p99_ms']:.1f} | "
                f"{x['mean_batch']:.1f} | {x['errors']} |")
    lines += ["", "## Prefix cache", "", "| engine | prefix caching | hit rate | reused tokens | evictions |",
              "|---|---|---|---|---|"]
    for r in rows:  # reports written before prefix caching existed lack these keys
        on = r.get("prefix_caching")
        lines.append(f"| {r['label']} | {'-' if on is None else 'on' if on else 'off'} | "
                     f"{_fmt(r.get('prefix_hit_rate'), '{:.3f}')} | {_fmt(r.get('reused_tokens'), '{:,}')} | "
                     f"{_fmt(r.get('prefix_evictions'), '{:,}')} |")
    best = _best(rows)
    b0 = best[base["label"]]["tokens_per_s"]
    lines += ["", "At each engine's maximum concurrency: " + "; ".join(
        f"{r['label']} {best[r['label']]['tokens_per_s']:.1f} tok/s ({best[r['label']]['tokens_per_s'] / b0:.2f}x)"
        for r in rows) + "."]
    if any(r.get("accuracy") for r in rows):
        lines += ["", "## Accuracy (vs the same model with unquantized KV)", "",
                  "| engine | " + " | ".join(c[1] for c in ACCURACY_COLUMNS) + " | budget |",
                  "|---|" + "---|" * (len(ACCURACY_COLUMNS) + 1)]
        for r in rows:
            acc = r.get("accuracy") or {}
            cells = [_fmt(acc.get(k), spec) for k, _, spec in ACCURACY_COLUMNS]
            verdict = "-" if not acc else ("pass" if not acc.get("violations") else "FAIL: " + "; ".join(acc["violations"]))
            lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {verdict} |")
    if report.get("triton"):
        lines += ["", "## Through Triton (kvq bench, gRPC streaming, text prompts)", "",
                  "| deployment | concurrency | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |",
                  "|---|---|---|---|---|---|---|---|"]
        for t in report["triton"]:
            for x in t["runs"]:
                lines.append(
                    f"| {t['label']} | {x['concurrency']} | {x['tokens_per_s']:.1f} | {_fmt(x['ttft_ms_p50'], '{:.1f}')} | "
                    f"{_fmt(x['ttft_ms_p99'], '{:.1f}')} | {_fmt(x['itl_ms_p50'], '{:.1f}')} | "
                    f"{_fmt(x['itl_ms_p99'], '{:.1f}')} | {x['errors']} |")
    lines += ["", "Plots: concurrency_vs_context.png, throughput_vs_concurrency.png, accuracy_vs_bytes.png", ""]
    return "\n".join(lines)


def plot_concurrency(report: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    max_ctx = max(r["pool_tokens"] for r in report["engines"])
    ctxs = [2**k for k in range(4, 18) if 2**k <= max_ctx]
    for r in report["engines"]:
        fits = [(c, r["pool_blocks"] // -(-c // r["block_size"])) for c in ctxs]  # whole blocks per request
        fits = [(c, n) for c, n in fits if n > 0]  # a log axis has no zero
        if fits:
            ax.plot(*zip(*fits), marker="o", label=f"{r['label']} ({kv_label(r)})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("context length per request (tokens)")
    ax.set_ylabel("requests that fit in the KV pool")
    ax.set_title("Concurrent requests vs context, same KV budget")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(report: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in report["engines"]:
        xs = [x["concurrency"] for x in r["runs"]]
        ax.plot(xs, [x["tokens_per_s"] for x in r["runs"]], marker="o", label=r["label"])
        mx = [x for x in r["runs"] if x.get("at_max_concurrency")]
        if mx:
            ax.annotate("max", (mx[0]["concurrency"], mx[0]["tokens_per_s"]), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Throughput vs concurrency ({report['device']})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy(report: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pts = []
    for i, r in enumerate(report["engines"]):  # colour i matches the throughput plot's line i
        acc = r.get("accuracy")
        if acc is None:
            continue
        # an evaluated engine without a perplexity change is the unquantized reference: 0 by definition
        pts.append((r["bytes_per_token"] / KIB, acc.get("perplexity_increase_pct", 0.0), r["label"], f"C{i}"))
    for x, y, label, colour in pts:
        ax.scatter([x], [y], color=colour)
        ax.annotate(label, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    if not pts:
        ax.text(0.5, 0.5, "no accuracy results (evaluate stage off)", ha="center", transform=ax.transAxes)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("KV bytes per token (KiB)")
    ax.set_ylabel("perplexity increase vs unquantized KV (%)")
    ax.set_title("Accuracy cost vs KV size")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out_dir / "report.md").write_text(markdown(report))
    plot_concurrency(report, out_dir / "concurrency_vs_context.png")
    plot_throughput(report, out_dir / "throughput_vs_concurrency.png")
    plot_accuracy(report, out_dir / "accuracy_vs_bytes.png")
