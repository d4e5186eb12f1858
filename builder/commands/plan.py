"""`kvq plan`: KV bytes, per-request memory and concurrency, without weights."""

from __future__ import annotations

import json

import click

from recipes import load_recipe
from runtime.errors import InputError

from ..planner import make_plan, parse_bytes, render_plan


def _contexts(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--context {text!r}: give token counts separated by commas, e.g. 8192,32768.") from None
    if not vals or any(v <= 0 for v in vals):
        raise InputError(f"--context {text!r}: give positive token counts, e.g. 8192,32768,131072.")
    return vals


@click.command("plan")
@click.option("--recipe", required=True, help="Bundled recipe name or YAML path.")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE")
@click.option("--context", default="8192,32768,131072", show_default=True, help="Context lengths (tokens).")
@click.option("--gpu-memory", default="141GB", show_default=True, help="Memory of one GPU (H200: 141GB).")
@click.option("--gpus", type=int, default=None, help="GPUs to spread the model over (sets TP = gpus / PP).")
@click.option("--reserve", default="4GiB", show_default=True, help="Per-GPU memory kept for activations.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def command(recipe, overrides, context, gpu_memory, gpus, reserve, as_json) -> None:
    """KV bytes per token, KV per request, pool tokens and maximum concurrency per KV format."""
    r = load_recipe(recipe, overrides)
    plan = make_plan(r, contexts=_contexts(context), gpu_memory=parse_bytes(gpu_memory), gpus=gpus,
                     reserve=parse_bytes(reserve))
    click.echo(json.dumps(plan.to_dict(), indent=2) if as_json else render_plan(plan))
