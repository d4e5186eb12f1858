"""`kvq convert`: turn a weight source into an engine-ready model directory."""

from __future__ import annotations

import json

import click

from builder.atomic import atomic_dir
from builder.convert import SOURCE_KINDS, convert_source
from builder.convert.writer import WEIGHT_DTYPES
from calibration.files import write_json_atomic


@click.command("convert")
@click.option("--source", required=True, help=f"Weight source: {', '.join(SOURCE_KINDS)}.")
@click.option("--path", "path", type=click.Path(), default=None,
              help="HF model directory (source hf) or .gguf file (source gguf).")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Output directory (must not exist).")
@click.option("--dtype", type=click.Choice(list(WEIGHT_DTYPES)), default="bf16", show_default=True,
              help="Weight dtype of the converted model.")
@click.option("--seed", type=int, default=0, show_default=True, help="Weight seed for synthetic:<preset>.")
@click.option("--force", is_flag=True, help="Replace an existing output directory (only once the new one is complete).")
def command(source: str, path: str | None, out_dir: str, dtype: str, seed: int, force: bool) -> None:
    """Convert weights (HF, GGUF, builtin SmolLM2, synthetic) into a kvq model directory.

    Example: kvq convert --source smollm2-135m --out models/smollm2 --dtype bf16
    """
    with atomic_dir(out_dir, overwrite=force) as tmp:
        facts = convert_source(source, path, tmp, dtype, seed=seed)
        write_json_atomic(tmp / "manifest.json", {"stage": "convert", "outputs": facts})
    click.echo(json.dumps(facts, indent=2))
    click.echo(f"wrote {out_dir}")
