"""The stages of `kvq-build`: convert → calibrate → search → build → evaluate → deploy → compare.

Directory layout under the work dir (models are shared by every recipe that
uses the same weights, so the four SmolLM2 recipes convert and calibrate once):

    models/<model key>/convert/
    models/<model key>/calibrate-<calibration key>/
    engines/<recipe>/search/  engine/  evaluate/  triton_repo/   (search: kv.dtype auto only)
    compare/<recipe>/
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.errors import StageError

from .pipeline import Context, Stage, upstream

STAGE_NAMES = ("convert", "calibrate", "search", "build", "evaluate", "deploy", "compare")


def _model_dir(ctx: Context) -> Path:
    return ctx.work_dir / "models" / ctx.section_digest("model")


def _engine_root(ctx: Context) -> Path:
    return ctx.work_dir / "engines" / ctx.recipe.name


def _model_source(ctx: Context) -> dict[str, Any]:
    m = ctx.recipe.model
    return {"source": m.source, "path": m.path, "preset": m.preset, "dtype": m.dtype}


# ------------------------------------------------------------------ convert
def _convert_run(ctx: Context, tmp: Path) -> dict[str, Any]:
    from .convert import convert_source
    from .convert.geometry import check_weights_geometry

    m = ctx.recipe.model
    source = {"builtin": m.preset, "synthetic": f"synthetic:{m.preset}"}.get(m.source, m.source)
    path = str(Path(m.path).expanduser()) if m.path else None
    return convert_source(source, path, tmp, m.dtype,
                          check=lambda cfg, where: check_weights_geometry(ctx.recipe, cfg, where))


CONVERT = Stage(
    "convert",
    out_dir=lambda ctx: _model_dir(ctx) / "convert",
    key=lambda ctx: {"model": _model_source(ctx), "inputs": {"source": _model_source(ctx)}},
    run=_convert_run,
    summary=lambda o: f"{o.get('num_tensors', '?')} tensors, {o.get('weight_bytes', 0) / 2**20:.0f} MiB {o.get('dtype', '')}",
    describe=lambda ctx: "{source} {x} ({dtype})".format(
        x=ctx.recipe.model.path or ctx.recipe.model.preset, **_model_source(ctx)),
)


# ---------------------------------------------------------------- calibrate
def _needs_calibration(ctx: Context) -> str | None:
    r = ctx.recipe
    if r.formats_needing_calibration():
        return None
    if r.model.source == "synthetic":
        return "synthetic weights, dynamic scales"
    return f"{r.kv_label()} computes its scales when tokens are written"


def _calibrate_run(ctx: Context, tmp: Path) -> dict[str, Any]:
    from calibration.calibrate import run_calibration

    c = ctx.recipe.calibration
    return run_calibration(
        model_dir=ctx.dirs["convert"], out_dir=tmp, dataset=c.dataset, num_samples=c.num_samples,
        seq_len=c.seq_len, policy=c.policy, seed=c.seed, streaming=c.streaming, device=ctx.device,
        percentile=c.percentile, progress=True, rotation=ctx.recipe.kv.kv_rotation(),
    )


def _calibrate_dir(ctx: Context) -> Path:
    """Rotated K/V have other statistics: their calibration lives beside the unrotated one."""
    rot = ctx.recipe.kv.kv_rotation()
    suffix = f"-{rot.name}" if rot.active else ""
    return _model_dir(ctx) / f"calibrate-{ctx.section_digest('calibration')}{suffix}"


def _calibrate_key(ctx: Context) -> dict[str, Any]:
    key = {"calibration": ctx.recipe.calibration.model_dump(mode="json"), "inputs": upstream(ctx, "convert")}
    rot = ctx.recipe.kv.kv_rotation()
    if rot.active:  # absent when unrotated, so earlier calibrations still match
        key["kv_rotation"] = rot.name
    return key


CALIBRATE = Stage(
    "calibrate",
    out_dir=_calibrate_dir,
    key=_calibrate_key,
    run=_calibrate_run,
    skip_reason=_needs_calibration,
    summary=lambda o: f"{o.get('num_samples', '?')} samples x {o.get('seq_len', '?')} tokens"
    + (f", {o['seconds']:.1f} s" if "seconds" in o else ""),
    describe=lambda ctx: "converted weights; {dataset} data, {num_samples} x {seq_len} tokens, policy {policy}".format(
        **ctx.recipe.calibration.model_dump()),
)


# ------------------------------------------------------------------- search
def _search_run(ctx: Context, tmp: Path) -> dict[str, Any]:
    from .search_stage import run_search

    return run_search(ctx, tmp)


def _describe_search(ctx: Context) -> str:
    r = ctx.recipe
    checks = (f"{r.search.validation_samples} x {r.search.seq_len} more" if r.search.validation_samples
              else "the same")
    how = ("every layer x format scored" if r.kv.target_bits_per_element else
           f"every format as a uniform cache checked on {checks} tokens, then a descent from the smallest that fits, "
           "every step checked there; every layer x option below it scored")
    return (f"converted weights + calibrated scales; {r.kv_label()} from {', '.join(r.search.formats)}: {how} "
            f"through the engine on {r.search.num_samples} x {r.search.seq_len} {r.calibration.dataset} tokens, "
            f"verified on {r.accuracy.perplexity_tokens} held-out tokens ({r.accuracy.eval_data})")


SEARCH = Stage(
    "search",
    out_dir=lambda ctx: _engine_root(ctx) / "search",
    key=lambda ctx: {
        "kv": ctx.recipe.kv.model_dump(mode="json"),
        "search": ctx.recipe.search.model_dump(mode="json"),
        "budget": ctx.recipe.accuracy.max_perplexity_increase_pct,
        "eval": {k: getattr(ctx.recipe.accuracy, k) for k in ("eval_data", "perplexity_tokens")},
        "calibration": {k: getattr(ctx.recipe.calibration, k) for k in ("dataset", "seed", "policy")},
        "device": ctx.device,
        "inputs": upstream(ctx, "convert", "calibrate"),
    },
    run=_search_run,
    skip_reason=lambda ctx: None if ctx.recipe.kv.dtype == "auto" else "kv.dtype is not auto",
    summary=lambda o: o.get("summary", ""),
    describe=_describe_search,
)


# -------------------------------------------------------------------- build
def _build_run(ctx: Context, tmp: Path) -> dict[str, Any]:
    from .engine_build import build_engine

    return build_engine(ctx, tmp)


def _describe_build(ctx: Context) -> str:
    text = f"converted weights + calibrated scales; {ctx.recipe.backend} engine, KV {ctx.recipe.kv_label()}"
    if ctx.recipe.backend == "tensorrt-llm":
        import shlex

        from .engine_build import trtllm_build_params
        from .trtllm.build_cmd import trtllm_build_command

        out = _engine_root(ctx) / "engine"
        cmd = trtllm_build_command(out / "checkpoint", out / "trt_engine", trtllm_build_params(ctx))
        text += f"; then: {shlex.join(cmd)}"
    return text


BUILD = Stage(
    "build",
    out_dir=lambda ctx: _engine_root(ctx) / "engine",
    key=lambda ctx: {
        "backend": ctx.recipe.backend,
        "kv": ctx.recipe.kv.model_dump(mode="json"),
        "build": ctx.recipe.build.model_dump(mode="json"),
        "policy": ctx.recipe.calibration.policy,
        "inputs": upstream(ctx, "convert", "calibrate", "search"),
    },
    run=_build_run,
    summary=lambda o: o.get("summary", ""),
    describe=lambda ctx: _describe_build(ctx),
    # A TensorRT-LLM checkpoint without its engine (trtllm-build was missing) is not a build.
    done=lambda o: o.get("backend") != "tensorrt-llm" or bool(o.get("engine_built")),
)


# ----------------------------------------------------------------- evaluate
def _evaluate_run(ctx: Context, tmp: Path) -> dict[str, Any]:
    from .evaluate_stage import evaluate_engine

    return evaluate_engine(ctx, tmp)


EVALUATE = Stage(
    "evaluate",
    out_dir=lambda ctx: _engine_root(ctx) / "evaluate",
    key=lambda ctx: {"accuracy": ctx.recipe.accuracy.model_dump(mode="json"),
                     "inputs": upstream(ctx, "convert", "build")},
    run=_evaluate_run,
    skip_reason=lambda ctx: None if ctx.recipe.accuracy.enabled else "accuracy.enabled is false",
    summary=lambda o: o.get("summary", ""),
    describe=lambda ctx: "engine vs the same model with unquantized KV; held-out text, passkey "
    f"{ctx.recipe.accuracy.passkey_lengths}",
)


# ------------------------------------------------------------------- deploy
def _deploy_run(ctx: Context, tmp: Path) -> dict[str, Any]:
    from .deploy_stage import deploy_engine

    return deploy_engine(ctx, tmp)


DEPLOY = Stage(
    "deploy",
    out_dir=lambda ctx: _engine_root(ctx) / "triton_repo",
    key=lambda ctx: {"deploy": ctx.recipe.deploy.model_dump(mode="json"), "inputs": upstream(ctx, "build")},
    run=_deploy_run,
    skip_reason=lambda ctx: None if ctx.recipe.deploy.enabled else "deploy.enabled is false",
    summary=lambda o: o.get("summary", ""),
    describe=lambda ctx: "engine; Triton model repository (preprocessing, engine, postprocessing, ensemble)",
)


# ------------------------------------------------------------------ compare
def _compare_run(ctx: Context, tmp: Path) -> dict[str, Any]:
    from .compare import compare_recipe

    return compare_recipe(ctx, tmp)


COMPARE = Stage(
    "compare",
    out_dir=lambda ctx: ctx.work_dir / "compare" / ctx.recipe.name,
    key=lambda ctx: {"compare": ctx.recipe.compare.model_dump(mode="json"), "device": ctx.device,
                     "inputs": upstream(ctx, "build", "evaluate")},
    run=_compare_run,
    skip_reason=lambda ctx: None if ctx.recipe.compare.enabled and ctx.recipe.compare.variants
    else "no compare.variants",
    summary=lambda o: o.get("summary", ""),
    describe=lambda ctx: "engines of " + ", ".join(ctx.recipe.compare.variants),
)

STAGES = (CONVERT, CALIBRATE, SEARCH, BUILD, EVALUATE, DEPLOY, COMPARE)


def stage(name: str) -> Stage:
    for s in STAGES:
        if s.name == name:
            return s
    raise StageError(f"unknown stage {name!r}; stages are {', '.join(STAGE_NAMES)}.")
