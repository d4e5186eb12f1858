"""Render benchmarks/results/kernel_variants.jsonl (the side-by-side timings behind each plan rule) as Markdown.

    python -m benchmarks.variants_table [--jsonl PATH] [--out PATH]

One table per rule: each line is one group of launches timed side by side in one run (same model, shape and
format), the alternatives in the order measured, the one the rule picks in bold.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from calibration.files import write_text_atomic

RESULTS = Path(__file__).resolve().parent / "results"

LEGEND = (
    "Variant names: `default` the plan of the code that was measured; `g` the Gluon kernel, `t` the Triton "
    "kernels; `stN` a shared-memory ring of N stages (`st0`: tiles loaded into registers), `pr1` / `pr0` ring "
    "tiles two / one a step, `tmaN` what of the ring the TMA unit copies (0 cp.async, 1 K/V words, 2 and the "
    "per-token scales), `spN` N splits, `rN` a register cap of N (`r0` uncapped), `kcN` N mma chains for the "
    "scores, `wW-nN-sS` Triton's per-warp kernel with W warps, N-token tiles, S stages; write kernel: `lN` rows "
    "over N lanes, `p` packed nibbles, `tTwW` T tokens and W warps a program, `rN` byte rows over N lanes. "
    "Times in ms (write kernel: % of copy bandwidth); repeats of one variant are separated by `/`; † L2 emptied "
    "by a write (each call ~8 us slower than with the read; ratios within a line hold)."
)


def load(path: Path) -> tuple[dict, list[dict]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    env = next(r for r in rows if r.get("kind") == "env")
    return env, [r for r in rows if r.get("kind") != "env"]


def _value(row: dict) -> str:
    return f"{row['pct_copy']:.0f}%" if row["kind"] == "write" else f"{row['ms']:.4f}"


def render(env: dict, rows: list[dict]) -> str:
    lines = [
        "# Kernel plan rules: the side-by-side measurements",
        "",
        f"GPU {env['gpu']} ({env['sms']} SMs), driver {env['driver']}, torch {env['torch']}, triton {env['triton']}, "
        f"CUDA {env['cuda']}, Python {env['python']}. {env['timing']}; {env['groups']}. "
        "Rules are named as in runtime/kernels/ (`rule=<name>` in the code); docs/kernels.md gives each one's reason.",
        "",
        LEGEND,
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["rule"], r["group"], r.get("model"), r.get("batch"), r.get("ctx"), r.get("block_size"), r.get("format"))
        groups.setdefault(key, []).append(r)
    rule = None
    for (name, _, model, batch, ctx, page, fmt), members in groups.items():
        if name != rule:
            rule = name
            lines += ["", f"## {name}", "", "| model | batch x ctx (page) | format | alternatives (chosen in bold) |",
                      "|---|---|---|---|"]
        by_variant: dict[str, list[dict]] = {}
        for r in members:
            by_variant.setdefault(r["variant"], []).append(r)
        cells = []
        for variant, same in by_variant.items():
            text = f"{variant} {'/'.join(_value(r) for r in same)}"
            cells.append(f"**{text}**" if same[0]["chosen"] else text)
        where = f"{batch}x{ctx} ({page})" if batch else "16x32768 (16)"
        flush = " †" if members[0].get("flush") == "write" else ""
        lines.append(f"| {model or 'llama3-8b'} | {where} | {fmt or 'int4'}{flush} | {' · '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jsonl", type=Path, default=RESULTS / "kernel_variants.jsonl")
    ap.add_argument("--out", type=Path, default=None, help="default: the JSONL's path with .md")
    args = ap.parse_args()
    env, rows = load(args.jsonl)
    write_text_atomic(args.out or args.jsonl.with_suffix(".md"), render(env, rows))


if __name__ == "__main__":
    main()
