"""Find, inherit, override and validate recipes.

A recipe is a bundled name (recipes/bundled/NAME.yaml, found through the
package, so it works after a non-editable install) or a path to a YAML file.
`extends: OTHER` deep-merges the recipe over OTHER (names or paths relative
to the extending file); `--set a.b=value` overrides are applied last, with
the value parsed as YAML (so numbers, booleans and lists work).
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from runtime.errors import RecipeError

from .schema import Recipe

BUNDLED = "bundled"


def bundled_names() -> list[str]:
    root = resources.files(__package__) / BUNDLED
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def _read_yaml(text: str, where: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"{where}: not valid YAML{at} ({getattr(e, 'problem', None) or e}); fix the syntax.") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe must be a YAML mapping of sections, got {type(data).__name__}.")
    return data


def _locate(ref: str, base: Path | None) -> tuple[str, str]:
    """Return (identity, text) of a recipe reference: a bundled name or a file path."""
    looks_like_path = ref.endswith((".yaml", ".yml")) or "/" in ref or ref.startswith(".")
    if looks_like_path:
        p = Path(ref).expanduser()
        if not p.is_absolute() and base is not None:
            p = base / p
        if not p.is_file():
            raise RecipeError(f"recipe file {p} does not exist; give a path to a YAML file or a bundled name "
                              f"(`kvq recipes list`).")
        try:
            return str(p.resolve()), p.read_text()
        except OSError as e:
            raise RecipeError(f"recipe file {p} cannot be read ({e}).") from None
    res = resources.files(__package__) / BUNDLED / f"{ref}.yaml"
    if not res.is_file():
        close = [n for n in bundled_names() if ref.split("-")[0] in n][:6] or bundled_names()[:6]
        raise RecipeError(f"unknown recipe {ref!r}; run `kvq recipes list` (e.g. {', '.join(close)}) "
                          f"or pass a path to a YAML file.")
    return f"bundled:{ref}", res.read_text()


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_raw(ref: str, base: Path | None = None, _chain: tuple[str, ...] = ()) -> dict[str, Any]:
    """The merged recipe dict, with `extends` resolved (not yet validated)."""
    ident, text = _locate(ref, base)
    if ident in _chain:
        cycle = " -> ".join([*_chain, ident])
        raise RecipeError(f"`extends` cycle: {cycle}; remove one of the extends.")
    data = _read_yaml(text, ident)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise RecipeError(f"{ident}: `extends` must name one recipe, got {parent!r}.")
    here = Path(ident).parent if not ident.startswith("bundled:") else None
    merged = _merge(load_raw(parent, here, (*_chain, ident)), data)
    merged.pop("extends", None)
    return merged


def apply_set(data: dict[str, Any], assignment: str) -> dict[str, Any]:
    """Apply one `key.path=value` override (value parsed as YAML)."""
    if "=" not in assignment:
        raise RecipeError(f"--set {assignment!r}: expected KEY.PATH=VALUE, e.g. --set kv.dtype=int8.")
    key, _, raw = assignment.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise RecipeError(f"--set {assignment!r}: the key is empty; e.g. --set build.max_batch_size=16.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise RecipeError(f"--set {key}: value {raw!r} is not valid YAML ({e}).") from None
    out = json.loads(json.dumps(data))  # deep copy of plain data
    node = out
    for i, p in enumerate(parts[:-1]):
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise RecipeError(f"--set {key}: {'.'.join(parts[: i + 1])} is a value, not a section.")
        node = nxt
    node[parts[-1]] = value
    return out


def _format_validation(err: ValidationError, ident: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(recipe)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling (`kvq recipes show NAME` lists every field)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"].startswith("literal_error"):
            msg = f"{msg} (got {e.get('input')!r})"
        lines.append(f"  {loc}: {msg}")
    return f"recipe {ident} is invalid:\n" + "\n".join(lines)


def load_recipe(ref: str, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Resolve a recipe name or path, apply `--set` overrides, validate."""
    data = load_raw(ref)
    for a in overrides:
        data = apply_set(data, a)
    data.setdefault("name", Path(ref).stem if ref.endswith((".yaml", ".yml")) else ref)
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_validation(e, ref)) from None


def recipe_digest(recipe: Recipe, sections: tuple[str, ...] | None = None) -> str:
    """Stable short digest of the resolved recipe (or of some of its sections)."""
    d = recipe.model_dump(mode="json")
    if sections is not None:
        d = {k: d[k] for k in sections}
    blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
