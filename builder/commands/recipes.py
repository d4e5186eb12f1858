"""`kvq recipes list|show`."""

from __future__ import annotations

import click
import yaml

from recipes import bundled_names, load_recipe


@click.group("recipes")
def command() -> None:
    """List bundled recipes or show one fully resolved."""


@command.command("list")
def list_() -> None:
    """Bundled recipe names with their descriptions."""
    for name in bundled_names():
        r = load_recipe(name)
        click.echo(f"{name:24s} {r.backend:13s} {r.kv_label():24s} {r.description}")


@command.command("show")
@click.argument("recipe")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a field.")
def show(recipe: str, overrides: tuple[str, ...]) -> None:
    """The fully resolved RECIPE (name or YAML path), every field, as YAML."""
    r = load_recipe(recipe, overrides)
    click.echo(yaml.safe_dump(r.model_dump(mode="json"), sort_keys=False).rstrip())
