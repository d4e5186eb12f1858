"""`kvq deploy`: write a Triton model repository for a built engine."""

from __future__ import annotations

import json
from pathlib import Path

import click

from builder.atomic import atomic_dir
from runtime.errors import InputError
from triton_repo.repo_torch import write_repository
from triton_repo.repo_trtllm import write_trtllm_repository


def _engine_manifest(engine_dir: Path) -> dict:
    path = engine_dir / "manifest.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path} is corrupt ({e}); rebuild the engine with `kvq-build --force`.") from e


@click.command("deploy")
@click.argument("engine_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Model repository to write (must not exist unless --force).",
)
@click.option(
    "--backend",
    type=click.Choice(["auto", "torch", "tensorrt-llm"]),
    default="auto",
    show_default=True,
    help="auto: read it from the engine's manifest.json (torch when absent).",
)
@click.option("--instance-count", type=int, default=None, help="Engine model instances (one engine each).")
@click.option("--max-queue-delay-us", type=int, default=None, help="Triton dynamic-batching queue delay.")
@click.option(
    "--max-batch-size", type=int, default=None, help="Triton max_batch_size (default: the engine's)."
)
@click.option(
    "--streaming/--no-streaming", default=True, show_default=True, help="Offer the `stream` request field."
)
@click.option(
    "--device",
    default=None,
    help="torch engines: device for the engine (default: cuda if present, else cpu).",
)
@click.option(
    "--tokenizer-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="TensorRT-LLM engines: directory with the tokenizer files.",
)
@click.option(
    "--force", is_flag=True, help="Replace an existing repository (only once the new one is complete)."
)
def command(
    engine_dir: Path,
    out_dir: Path,
    backend: str,
    instance_count: int | None,
    max_queue_delay_us: int | None,
    max_batch_size: int | None,
    streaming: bool,
    device: str | None,
    tokenizer_dir: str | None,
    force: bool,
) -> None:
    """Write a Triton model repository (preprocessing -> engine -> postprocessing, ensemble) for ENGINE_DIR.

    Example: kvq deploy kvq-work/engines/smollm2-fp8kv/engine --out repo && kvq serve repo
    """
    if not engine_dir.is_dir():
        raise InputError(
            f"{engine_dir} is not a directory; build an engine first (`kvq-build --recipe NAME`)."
        )
    manifest = _engine_manifest(engine_dir)
    if backend == "auto":
        backend = manifest.get("outputs", {}).get("backend", "torch")
    settings = {
        "instance_count": instance_count,
        "max_queue_delay_us": max_queue_delay_us,
        "max_batch_size": max_batch_size,
        "streaming": streaming,
    }
    with atomic_dir(out_dir, overwrite=force) as tmp:
        if backend == "tensorrt-llm":
            if device:
                raise InputError(
                    "--device applies to torch engines; TensorRT-LLM engines use gpu_device_ids."
                )
            facts = write_trtllm_repository(
                engine_dir, tmp, manifest, {**settings, "tokenizer_dir": tokenizer_dir}
            )
        else:
            if tokenizer_dir:
                raise InputError(
                    "--tokenizer-dir applies to TensorRT-LLM engines; torch engines carry their tokenizer."
                )
            facts = write_repository(engine_dir, tmp, {**settings, "device": device})
        (tmp / "manifest.json").write_text(json.dumps({"stage": "deploy", "outputs": facts}, indent=2))
    click.echo(facts["summary"])
    click.echo(f"wrote {out_dir}; start it with: kvq serve {out_dir}")
