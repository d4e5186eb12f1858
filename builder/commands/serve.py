"""`kvq serve`: run tritonserver on a model repository until Ctrl-C / SIGTERM.

With --openai-port the same process also serves the OpenAI API (FastAPI) in
front of Triton; both stop together.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import click

from runtime.errors import ServerError
from triton_repo.pbtxt import validate_repository
from triton_repo.server import start_server


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop()


@click.command("serve")
@click.argument("repo", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--http-port", type=int, default=None, help="Default: a free port.")
@click.option("--grpc-port", type=int, default=None, help="Default: a free port.")
@click.option("--metrics-port", type=int, default=None, help="Default: a free port.")
@click.option(
    "--ready-timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for readiness."
)
@click.option(
    "--openai-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Also serve the OpenAI API (/v1/completions, /v1/chat/completions) on 127.0.0.1:PORT.",
)
@click.option(
    "--openai-model",
    default=None,
    help="Model name the OpenAI API answers to (default: the repository directory's name).",
)
@click.option("--verbose", is_flag=True, help="Verbose server log (printed when loading fails).")
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the server's log directory goes (default: the system temp dir).",
)
def command(
    repo: Path,
    http_port: int | None,
    grpc_port: int | None,
    metrics_port: int | None,
    ready_timeout: float,
    openai_port: int | None,
    openai_model: str | None,
    verbose: bool,
    log_dir: Path | None,
) -> None:
    """Start the Triton Inference Server on 127.0.0.1 for REPO; stop with Ctrl-C or SIGTERM.

    Example: kvq serve repo --http-port 8000 --grpc-port 8001 --openai-port 9000
    """
    validate_repository(repo)
    # SIGTERM must unwind like Ctrl-C so the finally below stops the server and its stubs.
    signal.signal(signal.SIGTERM, _raise_stop)
    server = frontend = None
    try:
        click.echo(f"starting tritonserver for {repo} ...")
        server = start_server(
            repo,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            ready_timeout_s=ready_timeout,
            log_verbose=1 if verbose else 0,
            log_dir=log_dir,
        )
        click.echo(
            f"ready: http {server.http_url}  grpc {server.grpc_url}  metrics {server.metrics_url}  "
            f"(tritonserver pid {server.process.pid}, log {server.log_path})",
        )
        if openai_port is not None:
            from triton_repo.openai_api.runner import start_openai_frontend

            frontend = start_openai_frontend(server.grpc_url, openai_port, openai_model or repo.resolve().name)
            click.echo(f"openai: {frontend.base_url}  (model {frontend.model_name!r})")
        click.echo(f'try: kvq generate --url {server.http_url} "What is the capital of France?"')
        while server.process.poll() is None:
            time.sleep(0.5)
        raise ServerError(
            f"tritonserver exited on its own (code {server.process.returncode}); its last lines:\n"
            f"{server.crash_report()}\nFull log: {server.log_path}"
        )
    except (_Stop, KeyboardInterrupt):
        click.echo("stopping tritonserver ...")
    finally:
        if frontend is not None:
            frontend.stop()
        if server is not None:
            code = server.stop()
            click.echo(f"tritonserver stopped (exit code {code})")
