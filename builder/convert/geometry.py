"""Does the recipe describe the weights it is pointed at?

A recipe that names a preset (`model.preset: llama3-8b`) promises a geometry;
weights of another model under it would build an engine with the wrong name,
scales planned for the wrong shapes and a plan for the wrong model. convert
compares the two before it writes anything. A recipe without a preset takes
its geometry from the weights, and the recipe's own shape rules (tp divides
the heads, max_seq_len fits the positions, ...) are checked against that.
"""

from __future__ import annotations

from recipes import Recipe, bundled_names
from recipes.loader import load_raw
from runtime.config import PRESETS, ModelConfig
from runtime.errors import RecipeError

# ModelConfig field -> the name config.json gives it
GEOMETRY = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
}


def geometry_differences(expected: ModelConfig, found: ModelConfig) -> list[str]:
    return [f"{hf} (model.{name}): preset {getattr(expected, name)}, weights {getattr(found, name)}"
            for name, hf in GEOMETRY.items() if getattr(expected, name) != getattr(found, name)]


def presets_matching(cfg: ModelConfig) -> list[str]:
    return sorted(n for n, p in PRESETS.items() if not geometry_differences(p, cfg))


def recipes_for_preset(preset: str) -> list[str]:
    out = []
    for name in bundled_names():
        try:
            if (load_raw(name).get("model") or {}).get("preset") == preset:
                out.append(name)
        except RecipeError:  # a broken bundled recipe is reported where it is used
            continue
    return out


def check_weights_geometry(recipe: Recipe, cfg: ModelConfig, where: str) -> None:
    """Raise RecipeError when the weights at `where` do not fit `recipe`."""
    preset = recipe.model.preset
    if preset is None:
        try:
            recipe._check_geometry(cfg)
        except ValueError as e:
            raise RecipeError(f"recipe {recipe.name} does not fit the weights at {where} "
                              f"(geometry taken from them):\n  {e}") from None
        return
    diffs = geometry_differences(PRESETS[preset], cfg)
    if not diffs:
        return
    fixes = []
    matching = presets_matching(cfg)
    recipes = [r for p in matching for r in recipes_for_preset(p)]
    if recipes:
        fixes.append(f"use a recipe made for these weights: {', '.join(recipes[:4])}")
    if matching:
        fixes.append(f"keep this recipe with the weights' geometry: --set model.preset={matching[0]}")
    fixes.append("take the geometry from the weights: --set model.preset=null")
    raise RecipeError(
        f"recipe {recipe.name}: the weights at {where} are not the model.preset {preset!r} model:\n  "
        + "\n  ".join(diffs) + "\n  Fix: " + "; or ".join(fixes) + "."
    )
