"""The `deploy` stage: a Triton model repository for the built engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .pipeline import Context


def deploy_engine(ctx: Context, out: Path) -> dict[str, Any]:
    d = ctx.recipe.deploy
    settings = {"instance_count": d.instance_count, "max_queue_delay_us": d.max_queue_delay_us,
                "streaming": d.streaming}
    if ctx.recipe.backend == "tensorrt-llm":
        from triton_repo.repo_trtllm import write_trtllm_repository

        build = ctx.manifests["build"]["outputs"]
        manifest = {**build, **build.get("engine", {})}
        return write_trtllm_repository(ctx.dirs["build"], out, manifest,
                                       {**settings, "tokenizer_dir": str(ctx.dirs["convert"])})
    from triton_repo.repo_torch import write_repository

    return write_repository(ctx.dirs["build"], out, settings)
