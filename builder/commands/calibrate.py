"""`kvq calibrate`: K/V statistics and scales for every static KV format of a model."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from builder.atomic import atomic_dir
from calibration.calibrate import REPORT_FILE, run_calibration
from calibration.files import write_json_atomic
from calibration.policies import DEFAULT_PERCENTILE, POLICIES
from runtime.rotation import ROTATIONS, KVRotation


@click.command("calibrate")
@click.option("--model", "model_dir", required=True, type=click.Path(), help="Converted model directory (kvq convert).")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Output directory (must not exist).")
@click.option("--dataset", default="builtin", show_default=True,
              help="'builtin' (Python stdlib docstrings) or a .txt/.jsonl file or a directory of them.")
@click.option("--num-samples", type=int, default=64, show_default=True)
@click.option("--seq-len", type=int, default=512, show_default=True)
@click.option("--policy", type=click.Choice(POLICIES), default="max", show_default=True)
@click.option("--percentile", type=float, default=DEFAULT_PERCENTILE, show_default=True,
              help="Percentile of |x| for --policy percentile.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--streaming", is_flag=True, help="Layer-streaming: one decoder layer's weights resident at a time.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default=None, help="Model dtype (float32/bfloat16/float16); default: the model's.")
@click.option("--rotation", type=click.Choice(ROTATIONS), default="none", show_default=True,
              help="KV rotation of the engines these scales are for (kv.rotation): statistics of the rotated K/V.")
@click.option("--rotation-seed", type=int, default=0, show_default=True, help="kv.rotation_seed.")
@click.option("--force", is_flag=True, help="Replace an existing output directory once the new one is complete.")
def command(model_dir, out_dir, dataset, num_samples, seq_len, policy, percentile, seed, streaming, device, dtype,
            rotation, rotation_seed, force) -> None:
    """Calibrate KV scales on sample data (writes kv_scales.safetensors, kv_stats.safetensors, calibration.json).

    Example: kvq calibrate --model models/smollm2 --out calib/smollm2 --policy mse
    """
    with atomic_dir(out_dir, overwrite=force) as tmp:
        facts = run_calibration(model_dir, tmp, dataset=dataset, num_samples=num_samples, seq_len=seq_len,
                                policy=policy, seed=seed, streaming=streaming, device=device,
                                percentile=percentile, dtype=dtype, progress=True,
                                rotation=KVRotation(rotation, rotation_seed))
        write_json_atomic(tmp / "manifest.json", {"stage": "calibrate", "model_dir": str(Path(model_dir).resolve()),
                                                  "outputs": facts})
    report = json.loads((Path(out_dir) / REPORT_FILE).read_text())
    table = Table(title=f"KV quantization error, policy {policy} (relative MSE on the calibration data)")
    for col in ("format", "K mean", "K worst", "V mean", "V worst"):
        table.add_column(col, justify="right" if col != "format" else "left")
    for name, f in report["formats"].items():
        cells = []
        for kv in ("k", "v"):
            flat = [x for row in f[f"{kv}_rel_error"] for x in (row if isinstance(row, list) else [row])]
            cells += [f"{sum(flat) / len(flat):.2e}", f"{max(flat):.2e}"]
        table.add_row(name, *cells)
    Console().print(table)
    click.echo(f"{len(report['outlier_channels'])} outlier channels; {report['tokens_per_layer']} tokens per layer; "
               f"{facts['seconds']:.1f} s. Wrote {out_dir}")
