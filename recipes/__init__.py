"""Recipes: the validated description of one engine build (schema + bundled YAML)."""

from .loader import bundled_names, load_recipe, recipe_digest
from .schema import Recipe

__all__ = ["Recipe", "bundled_names", "load_recipe", "recipe_digest"]
