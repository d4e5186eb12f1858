"""Run the OpenAI frontend (uvicorn) beside a Triton server, in a background thread of this process."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from runtime.errors import InputError, ServerError
from runtime.tokenizer import load_fast_tokenizer

from .app import Served, create_app
from .triton_stream import TritonStreams, discover


@dataclass
class OpenAIFrontend:
    """A running frontend; `stop()` ends it (the Triton server is the caller's)."""

    host: str
    port: int
    model_name: str
    _server: object
    _thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=timeout_s)

    def __enter__(self) -> OpenAIFrontend:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_openai_frontend(
    grpc_url: str, port: int, model_name: str, host: str = "127.0.0.1", ready_timeout_s: float = 60.0
) -> OpenAIFrontend:
    """Serve the OpenAI API on host:port for the deployment behind `grpc_url` (which must be ready)."""
    import uvicorn

    if not model_name:
        raise InputError("the served model name is empty; pass --openai-model NAME.")
    model = discover(grpc_url)
    tokenizer = load_fast_tokenizer(model.tokenizer_dir)
    served = Served(model, tokenizer, model_name, TritonStreams(grpc_url, model), int(time.time()))
    config = uvicorn.Config(
        create_app(lambda: served), host=host, port=port, log_level="warning", access_log=False, lifespan="on"
    )
    server = uvicorn.Server(config)
    # Off the main thread uvicorn leaves signals alone: `kvq serve` stops Triton and this server together.
    thread = threading.Thread(target=server.run, name="kvq-openai", daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise ServerError(f"the OpenAI frontend could not start on {host}:{port} (is the port taken?).")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise ServerError(f"the OpenAI frontend did not start within {ready_timeout_s:.0f} s on {host}:{port}.")
        time.sleep(0.05)
    return OpenAIFrontend(host, port, model_name, server, thread)


def main(argv: list[str] | None = None) -> None:
    """`python -m triton_repo.openai_api.runner --grpc-url HOST:PORT --port N --model NAME`: the frontend
    alone, in front of a Triton server that is already running; stops on SIGTERM or Ctrl-C."""
    import argparse
    import signal

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--grpc-url", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with start_openai_frontend(args.grpc_url, args.port, args.model) as fe:
        print(f"openai: {fe.base_url}  (model {fe.model_name!r})", flush=True)
        try:
            while not stop.wait(0.5) and fe._thread.is_alive():
                pass
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
