"""Run a recipe's stages in order, stop where a stage says so, print the summary."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from recipes import Recipe
from runtime.errors import AccuracyBudgetError, ExternalToolMissing, InputError, StageError

from .pipeline import Context, StageResult, run_stage
from .stages import STAGE_NAMES, STAGES


def resolve_device(device: str) -> str:
    if device != "auto":
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise InputError(f"--device {device}: no CUDA device is visible here; use --device cpu.")
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_weights_exist(recipe: Recipe) -> None:
    """Fail at once, before any stage, when the recipe's weights are not where it says."""
    m = recipe.model
    if m.source not in ("hf", "gguf"):
        return
    p = Path(m.path).expanduser()
    if not p.exists():
        raise InputError(
            f"recipe {recipe.name}: the model weights are not at {p} ({m.source} source).\n"
            f"  Point to them with:  kvq-build --recipe {recipe.name} --set model.path=/path/to/weights\n"
            f"  Memory planning needs no weights:  kvq plan --recipe {recipe.name}"
        )


def _make_context(recipe: Recipe, work_dir: Path, force, device: str, allow: bool, console: Console) -> Context:
    forced = set(force or ())
    if "all" in forced:
        forced = set(STAGE_NAMES)
    unknown = forced - set(STAGE_NAMES)
    if unknown:
        raise StageError(f"--force {', '.join(sorted(unknown))}: unknown stage; stages are {', '.join(STAGE_NAMES)}.")
    return Context(recipe, Path(work_dir).absolute(), device, frozenset(forced), allow, console,
                   run_stages=run_stages)


def run_stages(ctx: Context, until: str | None = None, dry_run: bool = False,
               stop_on_budget: bool = True, results: list[StageResult] | None = None) -> list[StageResult]:
    """Run the stages up to `until` (appending to `results`); raise typed errors where the pipeline must stop."""
    results = [] if results is None else results
    for st in STAGES:
        res = run_stage(st, ctx, dry_run=dry_run)
        results.append(res)
        if dry_run:
            if st.name == until:
                break
            continue
        outputs = ctx.manifests.get(st.name, {}).get("outputs", {})
        if st.name == "build" and outputs.get("backend") == "tensorrt-llm" and not outputs.get("engine_built"):
            cmd = " ".join(outputs.get("trtllm_build_command", []))
            raise ExternalToolMissing(
                f"TensorRT-LLM checkpoint written to {res.path / 'checkpoint'}, but trtllm-build is not "
                f"installed here, so the engine was not built.\n  On a machine with TensorRT-LLM run:\n    {cmd}\n"
                f"  then rerun kvq-build there to evaluate and deploy it."
            )
        if st.name in ("search", "evaluate") and outputs.get("violations") and stop_on_budget \
                and not ctx.allow_accuracy_regression:
            report = "search.json" if st.name == "search" else "accuracy.json"
            raise AccuracyBudgetError(
                f"engine {ctx.recipe.name} breaks its accuracy budget:\n  "
                + "\n  ".join(outputs["violations"])
                + f"\n  Results: {res.path / report}. Pass --allow-accuracy-regression to accept it."
            )
        if st.name == until:
            break
    return results


def summary_table(recipe: Recipe, results: list[StageResult]) -> Table:
    t = Table(title=f"kvq-build {recipe.name}")
    t.add_column("stage")
    t.add_column("status")
    t.add_column("output directory")
    t.add_column("result")
    for r in results:
        t.add_row(r.stage, r.status, str(r.path or "-"), r.line)
    return t


def build_pipeline(recipe: Recipe, work_dir: Path, force=(), until: str | None = None, device: str = "auto",
                   dry_run: bool = False, allow_accuracy_regression: bool = False) -> list[StageResult]:
    console = Console(stderr=False, width=None if Console().is_terminal else 140)
    if not dry_run:
        check_weights_exist(recipe)
    ctx = _make_context(recipe, work_dir, force, resolve_device(device) if not dry_run else device,
                        allow_accuracy_regression, console)
    results: list[StageResult] = []
    try:
        run_stages(ctx, until=until, dry_run=dry_run, results=results)
    finally:
        if dry_run:
            print(dry_run_text(recipe, results))
        elif results:
            console.print(summary_table(recipe, results))
    return results


def dry_run_text(recipe: Recipe, results: list[StageResult]) -> str:
    lines = [f"kvq-build {recipe.name} (dry run): the stages, their inputs and output directories"]
    for r in results:
        lines.append(f"  {r.stage:10s} {r.status}" + (f" -> {r.path}" if r.path else ""))
        if r.line:
            lines.append(f"  {'':10s} inputs: {r.line}")
    return "\n".join(lines)
