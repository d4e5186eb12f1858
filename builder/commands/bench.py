"""`kvq bench`: concurrent streaming load against a running deployment."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from runtime.errors import InputError, ServerError
from triton_repo.bench import DEFAULT_PROMPTS, openai_model_name, run_bench

_ROWS = (
    ("requests", "requests", "{:d}"),
    ("completed", "completed", "{:d}"),
    ("errors", "errors", "{:d}"),
    ("concurrency", "concurrency", "{:d}"),
    ("wall_s", "wall time (s)", "{:.2f}"),
    ("output_tokens", "output tokens", "{:d}"),
    ("responses", "streamed responses", "{:d}"),
    ("tokens_per_s", "throughput (tok/s)", "{:.1f}"),
    ("requests_per_s", "requests/s", "{:.2f}"),
    ("ttft_ms_p50", "TTFT p50 (ms)", "{:.1f}"),
    ("ttft_ms_p99", "TTFT p99 (ms)", "{:.1f}"),
    ("itl_ms_p50", "ITL p50 (ms)", "{:.1f}"),
    ("itl_ms_p99", "ITL p99 (ms)", "{:.1f}"),
)


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


@click.command("bench")
@click.option("--url", default=None, help="gRPC address of the server (kvq serve prints it).")
@click.option(
    "--openai",
    "openai_url",
    default=None,
    help="Drive the OpenAI endpoint instead: its base URL, e.g. http://127.0.0.1:9000/v1 (kvq serve --openai-port).",
)
@click.option("--concurrency", type=int, default=4, show_default=True, help="Requests in flight.")
@click.option("--requests", "num_requests", type=int, default=16, show_default=True, help="Requests in all.")
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--prompt", "prompts", multiple=True, help="Prompt (repeatable); default: a built-in set.")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Apply the model's chat template.")
@click.option("--model", default=None, help="Default: ensemble (gRPC), the served model (--openai).")
@click.option(
    "--processes",
    type=int,
    default=1,
    show_default=True,
    help="Client processes the streams are spread over (one Python client saturates a core at a few "
    "thousand responses a second).",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the summary and per-request rows here.",
)
def command(
    url: str | None,
    openai_url: str | None,
    concurrency: int,
    num_requests: int,
    max_tokens: int,
    prompts: tuple[str, ...],
    chat: bool,
    model: str | None,
    processes: int,
    json_out: Path | None,
) -> None:
    """Throughput, time to first token and inter-token latency under N concurrent streams.

    Example: kvq bench --url 127.0.0.1:8001 --concurrency 8 --requests 32 --json bench.json
    """
    if (url is None) == (openai_url is None):
        raise InputError("pass exactly one of --url (gRPC) and --openai (the OpenAI endpoint's base URL).")
    if openai_url is not None:
        model = model or openai_model_name(openai_url)
    url = url or openai_url
    model = model or "ensemble"
    result = run_bench(
        url,
        concurrency,
        num_requests,
        max_tokens=max_tokens,
        prompts=prompts or DEFAULT_PROMPTS,
        model=model,
        apply_chat_template=chat,
        openai=openai_url is not None,
        processes=processes,
    )
    s = result["summary"]
    table = Table(title=f"kvq bench: {url} ({model})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, label, fmt in _ROWS:
        table.add_row(label, "-" if s[key] is None else fmt.format(s[key]))
    Console().print(table)
    for msg in s["error_messages"]:
        click.echo(f"error: {msg}", err=True)
    click.echo(json.dumps(s))
    if json_out is not None:
        _write_json_atomic(json_out, result)
    if s["errors"]:
        raise ServerError(f"{s['errors']} of {s['requests']} requests failed (messages above).")
