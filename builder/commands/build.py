"""`kvq-build --recipe NAME` (also `kvq build`): the whole pipeline."""

from __future__ import annotations

from pathlib import Path

import click

from recipes import load_recipe

from ..run import build_pipeline
from ..stages import STAGE_NAMES


@click.command("build")
@click.option("--recipe", required=True, help="Bundled recipe name (kvq recipes list) or a YAML path.")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a recipe field.")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("kvq-work"),
              show_default=True, help="Where every stage writes its directory.")
@click.option("--force", "force", multiple=True, is_flag=False, flag_value="all", metavar="[STAGE]",
              help="Redo STAGE even if up to date (repeatable); --force alone redoes every stage.")
@click.option("--until", type=click.Choice(STAGE_NAMES), default=None, help="Stop after this stage.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto.")
@click.option("--dry-run", is_flag=True, help="List the stages with their inputs and output directories.")
@click.option("--allow-accuracy-regression", is_flag=True,
              help="Exit 0 even when an engine breaks the recipe's accuracy budget.")
def command(recipe, overrides, work_dir, force, until, device, dry_run, allow_accuracy_regression) -> None:
    """Convert, calibrate, build, evaluate, deploy and compare, as the recipe says."""
    r = load_recipe(recipe, overrides)
    build_pipeline(r, work_dir, force=force, until=until, device=device, dry_run=dry_run,
                   allow_accuracy_regression=allow_accuracy_regression)
