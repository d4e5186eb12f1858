"""The Markdown of benchmarks/step_profile.py's rows: modes side by side per scenario, then the components."""

from __future__ import annotations


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(rows: list[dict], env: dict) -> str:
    steps = [r for r in rows if r["kind"] == "step"]
    modes = list(dict.fromkeys(r["mode"] for r in steps))
    lines = [f"{env.get('preset')} geometry, synthetic weights, {env.get('gpu', 'cpu')}, torch {env.get('torch')}; "
             f"bound: weights (or their matmuls at {env.get('tflops'):g} TFLOP/s, where slower) + K/V + logits "
             f"read once at {env.get('bandwidth_gbs'):g} GB/s. Step ms is wall time "
             "per token of every sequence through the engine's step loop; GPU is the captured step replayed "
             "alone; host is the rest. x legacy: tokens/s over the legacy step's. Tokens match: greedy tokens "
             "against the legacy step's; invariant: each prompt's tokens alone against beside the others.", ""]
    head = "| KV format | scenario | sequences | " + " | ".join(
        f"{m}: step ms (GPU / host) | {m}: tok/s | {m}: % of bound" for m in modes) + " | bound ms | x legacy | tokens match |"
    lines += [head, "|" + "---|" * (3 * len(modes) + 6)]
    keys = list(dict.fromkeys((r["format"], r["scenario"]) for r in steps))
    for fmt, sc in keys:
        mine = {r["mode"]: r for r in steps if (r["format"], r["scenario"]) == (fmt, sc)}
        cells = []
        for m in modes:
            r = mine.get(m)
            cells += ["-", "-", "-"] if r is None else [
                f"{r['step_ms']:.2f} ({r['gpu_step_ms']:.2f} / {r['host_ms']:.2f})", f"{r['tok_s']:.0f}",
                f"{r['pct_of_bound']:.0f}%"]
        any_row = next(iter(mine.values()))
        legacy = mine.get("legacy")
        gains = " / ".join(f"{mine[m]['tok_s'] / legacy['tok_s']:.2f}" for m in modes if m != "legacy" and m in mine) \
            if legacy else "-"
        match = " / ".join(f"{m}: {'yes' if mine[m].get('tokens_match') else 'NO'}" for m in modes if m != "legacy")
        lines.append(f"| {fmt} | {sc} | {any_row['batch']} | " + " | ".join(cells) +
                     f" | {any_row['bound_ms']:.3g} | {gains} | {match} |")
    lines += _formats_side_by_side(steps, modes)
    comps = [r for r in rows if r["kind"] == "component"]
    if comps:
        lines += _components(comps, steps, keys, modes)
    return _extra_sections(rows, lines)


def _formats_side_by_side(steps: list[dict], modes: list) -> list[str]:
    """tok/s per KV format and its ratio to the first format's (BF16) in the same scenario and mode."""
    formats = list(dict.fromkeys(r["format"] for r in steps))
    if len(formats) < 2:
        return []
    lines = ["", f"Decode tokens/s by KV format, and x {formats[0]} in the same scenario and mode:", "",
             "| scenario | mode | " + " | ".join(formats) + " |", "|" + "---|" * (len(formats) + 2)]
    for sc in dict.fromkeys(r["scenario"] for r in steps):
        for m in modes:
            mine = {r["format"]: r for r in steps if (r["scenario"], r["mode"]) == (sc, m)}
            base = mine.get(formats[0])
            cells = []
            for f in formats:
                r = mine.get(f)
                ratio = f" ({r['tok_s'] / base['tok_s']:.2f}x)" if r and base and f != formats[0] else ""
                cells.append(f"{r['tok_s']:.0f}{ratio}" if r else "-")
            lines.append(f"| {sc} | {m} | " + " | ".join(cells) + " |")
    return lines


def _components(comps: list[dict], steps: list[dict], keys: list, modes: list) -> list[str]:
    lines = ["", "Components, each alone for one step (all layers), GPU ms and % of its own byte/FLOP bound; "
              "`unattributed` is the GPU step minus their sum (the gaps between the step's kernels).", ""]
    names = list(dict.fromkeys(r["component"] for r in comps))
    lines += ["| KV format | scenario | mode | " + " | ".join(names) + " | unattributed |",
              "|" + "---|" * (len(names) + 4)]
    for fmt, sc in keys:
        for m in modes:
            mine = {r["component"]: r for r in comps if (r["format"], r["scenario"], r["mode"]) == (fmt, sc, m)}
            step = next((r for r in steps if (r["format"], r["scenario"], r["mode"]) == (fmt, sc, m)), None)
            if not mine or step is None:
                continue
            cells = [f"{mine[c]['ms']:.3f} ({mine[c]['pct_of_bound']:.0f}%)" if c in mine else "-" for c in names]
            lines.append(f"| {fmt} | {sc} | {m} | " + " | ".join(cells) + f" | {_fmt(step['unattributed_ms'], '.3f')} |")
    return lines


def _batch1_bounds(steps: list[dict]) -> list[str]:
    """Batch-1 steps: GPU and host time, the kernels a captured step launches and the GPU time per kernel, beside
    the byte bound: a step far above its bound with a few microseconds a kernel is bound by launches."""
    mine = [r for r in steps if r["batch"] == 1]
    if not mine:
        return []
    lines = ["", "What bounds a batch-1 step: GPU / host ms, kernels one captured step launches, GPU us per kernel, "
             "and the byte bound.", "",
             "| geometry | KV format | scenario | mode | step ms | GPU ms | host ms | kernels | GPU us / kernel | "
             "bound ms | % of bound |", "|" + "---|" * 11]
    for r in mine:
        k = r.get("kernels_per_step")
        per = f"{1e3 * r['gpu_step_ms'] / k:.1f}" if k else "-"
        lines.append(f"| {r.get('preset', '-')} | {r['format']} | {r['scenario']} | {r['mode']} | {r['step_ms']:.3f} | "
                     f"{r['gpu_step_ms']:.3f} | {r['host_ms']:.3f} | {k if k else '-'} | {per} | "
                     f"{r['bound_ms']:.3g} | {r['pct_of_bound']:.0f}% |")
    return lines


def _plans(rows: list[dict]) -> list[str]:
    plans = [r for r in rows if r["kind"] == "plan"]
    if not plans:
        return []
    lines = ["", "Batch-1 decode-attention plans (runtime/kernels/tuning.py): splits the launch runs, (KV head, split) "
             "programs, SMs with work, programs an SM; block table padded to the engine's longest sequence or fitted.",
             "", "| KV format | scenario | table (tokens) | kernel | splits | ring stages | programs | SMs with work | "
             "programs / SM |", "|" + "---|" * 9]
    for r in plans:
        lines.append(f"| {r['format']} | {r['scenario']} | {r['table']} ({r['width_tokens']}) | {r['kernel']} | "
                     f"{r['splits']} | {r['ring_stages']} | {r['programs']} | {r['sms_with_work']} of {r['sms']} | "
                     f"{r['programs_per_sm']:.1f} |")
    return lines


def _extra_sections(rows: list[dict], lines: list[str]) -> str:
    lines += _batch1_bounds([r for r in rows if r["kind"] == "step"]) + _plans(rows)
    sweep = [r for r in rows if r["kind"] == "splits"]
    if sweep:
        lines += ["", "Batch-1 attention, all layers, by split count (* the default plan's): GPU ms and % of the "
                  "K/V read bound; block table padded to the engine's longest sequence or fitted to this one.", "",
                  "| KV format | scenario | table (tokens) | kernel | splits: ms (% of bound) |", "|---|---|---|---|---|"]
        for key in dict.fromkeys((r["format"], r["scenario"], r["table"]) for r in sweep):
            mine = [r for r in sweep if (r["format"], r["scenario"], r["table"]) == key]
            cells = ", ".join(f"{r['splits']}{'*' if r['default'] else ''}: {r['ms']:.3f} ({r['pct_of_bound']:.0f}%)"
                              for r in mine)
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} ({mine[0]['width_tokens']}) | {mine[0]['kernel']} | {cells} |")
    gemm = [r for r in rows if r["kind"] == "gemm"]
    if gemm:
        ms_values = list(dict.fromkeys(r["m"] for r in gemm))
        lines += ["", "Decode matmuls of one step (every layer's weight) by rows M: cuBLAS ms / the best Triton GEMV "
                  "tile's ms (% of the weight-read bound of the faster).", "",
                  "| weight (N x K) | " + " | ".join(f"M={m}" for m in ms_values) + " |", "|" + "---|" * (len(ms_values) + 1)]
        for w in dict.fromkeys(r["weight"] for r in gemm):
            mine = [r for r in gemm if r["weight"] == w]
            cells = []
            for m in ms_values:
                at = [r for r in mine if r["m"] == m]
                cub = next(r for r in at if r["impl"] == "cublas")
                best = min((r for r in at if r["impl"] != "cublas"), key=lambda r: r["ms"], default=None)
                fast = min([cub] + ([best] if best else []), key=lambda r: r["ms"])
                cells.append(f"{cub['ms']:.3f} / {best['ms'] if best else float('nan'):.3f} "
                             f"({fast['pct_of_bound']:.0f}%)")
            lines.append(f"| {w} ({mine[0]['n']} x {mine[0]['k']}) | " + " | ".join(cells) + " |")
    errors = [r for r in rows if r["kind"] == "error"]
    if errors:
        lines += ["", "Failures (left out above):", ""] + [
            f"- {r['format']} {r.get('mode') or r.get('scenario')}: {r['error']}" for r in errors]
    return "\n".join(lines)
