"""`kvq generate`: one request to a running deployment (HTTP, or gRPC streaming)."""

from __future__ import annotations

import click

from triton_repo.client import GenerateRequest, generate, stream


@click.command("generate")
@click.argument("prompt")
@click.option("--url", default="127.0.0.1:8000", show_default=True, help="HTTP address of the server.")
@click.option(
    "--grpc-url", default="127.0.0.1:8001", show_default=True, help="gRPC address (used with --stream)."
)
@click.option(
    "--stream", "use_stream", is_flag=True, help="Stream over gRPC and print tokens as they arrive."
)
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=None, help="0 or unset: greedy.")
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--stop", "stop_words", multiple=True, help="Stop word (repeatable).")
@click.option("--chat/--no-chat", default=False, show_default=True, help="Apply the model's chat template.")
@click.option("--model", default="ensemble", show_default=True, help="Model to call.")
@click.option("--timeout", type=float, default=300.0, show_default=True)
def command(
    prompt: str,
    url: str,
    grpc_url: str,
    use_stream: bool,
    max_tokens: int,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    stop_words: tuple[str, ...],
    chat: bool,
    model: str,
    timeout: float,
) -> None:
    """Generate text for PROMPT from a kvq / TensorRT-LLM ensemble.

    Example: kvq generate --url 127.0.0.1:8000 --chat "What is the capital of France?"
    """
    req = GenerateRequest(
        prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        random_seed=seed,
        stop_words=list(stop_words),
        apply_chat_template=chat,
    )
    if use_stream:
        for ev in stream(grpc_url, req, model=model, timeout_s=timeout):
            click.echo(ev.text, nl=False)
        click.echo()
    else:
        click.echo(generate(url, req, model=model, timeout_s=timeout))
