"""The stage runner: manifests, skip-if-unchanged, atomic output, summary.

Each stage writes one directory holding a `manifest.json`:

    {stage, recipe, recipe_digest, key, key_digest, inputs, versions, outputs, created, seconds}

`key` is everything that decides the stage's result (the recipe sections it
reads plus the digests of the upstream manifests it consumed); a stage whose
directory holds a manifest with the same key digest is skipped. The manifest
is written inside the temporary directory *before* the rename, so a directory
that a later stage can accept is always complete, and an interrupted stage
leaves only a `.NAME.tmp-*` sibling that the next run removes.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from recipes import Recipe, recipe_digest
from runtime.errors import StageError

from .atomic import atomic_dir

MANIFEST = "manifest.json"
_VERSIONED = ("kvq", "torch", "transformers", "safetensors", "numpy", "triton", "tensorrt_llm")


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            continue
    return out


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a stage directory, or None if it has none / it is unreadable."""
    p = Path(path) / MANIFEST
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def require_manifest(path: Path, stage: str) -> dict[str, Any]:
    m = read_manifest(path)
    if m is None or m.get("stage") != stage:
        raise StageError(f"{path} is not a completed `{stage}` output (no valid manifest.json); "
                         f"run the {stage} stage first (kvq-build --recipe ... builds every stage).")
    return m


@dataclass
class Context:
    recipe: Recipe
    work_dir: Path
    device: str = "cpu"
    force: frozenset[str] = frozenset()
    allow_accuracy_regression: bool = False
    console: Console = field(default_factory=lambda: Console(stderr=True))
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    dirs: dict[str, Path] = field(default_factory=dict)
    spinner: bool = True  # off for pipelines nested in a running stage (rich allows one live display)
    # The pipeline runner (builder.run.run_stages), handed in by whoever makes the context: the compare
    # stage runs each variant's pipeline through it, because importing run.py from a stage would close
    # the import cycle run -> stages -> compare -> run.
    run_stages: Callable[..., list[StageResult]] | None = None
    # The final directory of the stage now running: its files are written to a temporary
    # sibling first, so anything recorded for later use (paths, commands) must name this one.
    stage_dir: Path | None = None

    def section_digest(self, *sections: str) -> str:
        return recipe_digest(self.recipe, sections)

    def variant(self, recipe: Recipe) -> Context:
        """A context for another recipe's stages in the same work directory, nested in this run: nothing
        forced, accuracy budgets reported rather than enforced, the same pipeline runner."""
        return Context(recipe, self.work_dir, self.device, frozenset(), True, self.console, spinner=False,
                       run_stages=self.run_stages)


@dataclass
class Stage:
    name: str
    out_dir: Callable[[Context], Path]
    key: Callable[[Context], dict[str, Any]]
    run: Callable[[Context, Path], dict[str, Any]]
    # Returns a reason string when the stage is not needed for this recipe.
    skip_reason: Callable[[Context], str | None] = lambda ctx: None
    # Returns one line for the closing summary from the manifest's outputs.
    summary: Callable[[dict[str, Any]], str] = lambda outputs: ""
    # Human-readable inputs for --dry-run.
    describe: Callable[[Context], str] = lambda ctx: ""
    # Whether a manifest's outputs are a finished result. A stage may record a partial one
    # (a TensorRT-LLM checkpoint whose engine could not be built here); such a directory is
    # kept for the user but redone on the next run instead of counting as up to date.
    done: Callable[[dict[str, Any]], bool] = lambda outputs: True


@dataclass
class StageResult:
    stage: str
    status: str  # ran | up to date | not needed | dry run
    path: Path | None
    line: str = ""
    seconds: float = 0.0


def _clean_stale(out: Path) -> None:
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in out.parent.glob(f".{out.name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def run_stage(stage: Stage, ctx: Context, dry_run: bool = False) -> StageResult:
    reason = stage.skip_reason(ctx)
    if reason:
        return StageResult(stage.name, f"not needed ({reason})", None)
    out = stage.out_dir(ctx)
    key = stage.key(ctx)
    kd = digest(key)
    old = read_manifest(out)
    fresh = (old is not None and old.get("key_digest") == kd and old.get("stage") == stage.name
             and stage.done(old.get("outputs", {})))
    reuse = fresh and stage.name not in ctx.force
    if reuse:  # downstream keys (and a dry run's verdicts) depend on this manifest
        ctx.manifests[stage.name], ctx.dirs[stage.name] = old, out
    if dry_run:
        return StageResult(stage.name, "up to date" if reuse else "would run", out, stage.describe(ctx))
    if reuse:
        return StageResult(stage.name, "up to date", out, stage.summary(old.get("outputs", {})))
    _clean_stale(out)
    t0 = time.perf_counter()
    ctx.console.print(f"[bold]{stage.name}[/bold] → {out}")
    ctx.stage_dir = out
    with atomic_dir(out, overwrite=True) as tmp:
        live = ctx.console.status(f"[bold]{stage.name}[/bold] running…") if ctx.spinner else nullcontext()
        with live:  # a spinner with the stage name on a terminal
            outputs = stage.run(ctx, tmp)
        manifest = {
            "stage": stage.name,
            "recipe": ctx.recipe.name,
            "recipe_digest": recipe_digest(ctx.recipe),
            "key": key,
            "key_digest": kd,
            "inputs": key.get("inputs", {}),
            "versions": package_versions(),
            "outputs": outputs,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.perf_counter() - t0, 2),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    ctx.manifests[stage.name], ctx.dirs[stage.name] = manifest, out
    return StageResult(stage.name, "ran", out, stage.summary(outputs), manifest["seconds"])


def upstream(ctx: Context, *stages: str) -> dict[str, str]:
    """Digests of the upstream manifests a stage consumed (part of its key)."""
    out = {}
    for s in stages:
        m = ctx.manifests.get(s)
        if m is not None:
            out[s] = digest(m)
    return out
