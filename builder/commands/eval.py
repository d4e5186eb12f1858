"""`kvq eval`: accuracy of quantized-KV engines against the same model with unquantized KV."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from builder.atomic import atomic_dir
from calibration.budget import enforce_budget
from calibration.calibrate import scales_for
from calibration.evaluate import EngineKV, EvalSettings, engine_kv_from_dir, run_evaluation
from calibration.report import HEADER, rows
from runtime.errors import InputError
from runtime.kv_format import KVFormat


def _format_specs(formats: tuple[str, ...], calib_dir: str | None) -> list[EngineKV]:
    specs = []
    for text in formats:
        dtype, _, gran = text.partition(":")
        fmt = KVFormat(dtype, gran or "per_tensor")
        if fmt.static and calib_dir is None:
            raise InputError(f"--format {text} needs calibrated scales: add --calib DIR (from `kvq calibrate`).")
        k, v = scales_for(calib_dir, fmt) if fmt.static else (None, None)
        specs.append(EngineKV(fmt.name, fmt, k, v))
    return specs


def _lengths(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 32:
        raise InputError(f"--passkey-lengths {text!r}: give token counts >= 32 separated by commas, e.g. 256,1024.")
    return vals


@click.command("eval")
@click.option("--model", "model_dir", required=True, type=click.Path(), help="Converted model directory.")
@click.option("--engine", "engines", multiple=True, type=click.Path(), help="Engine directory (repeatable).")
@click.option("--format", "formats", multiple=True, metavar="DTYPE[:GRANULARITY]",
              help="KV format to evaluate without an engine, e.g. int8:per_head (repeatable; static ones need --calib).")
@click.option("--calib", "calib_dir", type=click.Path(), default=None, help="Calibration directory for --format.")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Output directory (must not exist).")
@click.option("--ppl-tokens", type=int, default=1024, show_default=True)
@click.option("--eval-data", default="builtin", show_default=True,
              help="Held-out text for perplexity: 'builtin' or your own .txt/.jsonl file or directory.")
@click.option("--greedy-prompts", type=int, default=4, show_default=True)
@click.option("--greedy-tokens", type=int, default=32, show_default=True)
@click.option("--passkey-lengths", default="256,1024", show_default=True)
@click.option("--passkey-trials", type=int, default=20, show_default=True)
@click.option("--max-ppl-increase", type=float, default=None, help="Budget: max perplexity increase in percent.")
@click.option("--min-passkey-relative", type=float, default=None, help="Budget: min passkey rate / baseline rate.")
@click.option("--min-greedy-agreement", type=float, default=None, help="Budget: min greedy-token agreement (0-1).")
@click.option("--allow-accuracy-regression", is_flag=True, help="Exit 0 even when an engine breaks the budget.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing output directory once the new one is complete.")
def command(model_dir, engines, formats, calib_dir, out_dir, ppl_tokens, eval_data, greedy_prompts, greedy_tokens,
            passkey_lengths, passkey_trials, max_ppl_increase, min_passkey_relative, min_greedy_agreement,
            allow_accuracy_regression, device, force) -> None:
    """Perplexity change, greedy agreement, passkey retrieval and attention error vs unquantized KV.

    Example: kvq eval --model models/smollm2 --calib calib/smollm2 --format int8:per_head --format int4:per_token --out eval/
    """
    specs = [engine_kv_from_dir(e) for e in engines] + _format_specs(formats, calib_dir)
    if not specs:
        raise InputError("nothing to evaluate: give --engine DIR or --format DTYPE[:GRANULARITY].")
    settings = EvalSettings(perplexity_tokens=ppl_tokens, greedy_prompts=greedy_prompts, greedy_tokens=greedy_tokens,
                            passkey_lengths=_lengths(passkey_lengths), passkey_trials=passkey_trials,
                            eval_data=eval_data)
    budget = {"max_perplexity_increase_pct": max_ppl_increase, "min_passkey_rate_relative": min_passkey_relative,
              "min_greedy_agreement": min_greedy_agreement}
    with atomic_dir(out_dir, overwrite=force) as tmp:
        results = run_evaluation(model_dir, specs, tmp, settings, budget=budget, device=device, progress=True)
    table = Table(title=f"Accuracy vs unquantized KV ({results['path']})")
    for col in HEADER:
        table.add_column(col)
    for r in rows(results):
        table.add_row(*r)
    Console().print(table)
    click.echo(f"wrote {Path(out_dir) / 'accuracy.json'} and accuracy.md")
    for v in enforce_budget(results, budget, allow_accuracy_regression):
        click.secho(f"warning (allowed): {v.message}", fg="yellow", err=True)
