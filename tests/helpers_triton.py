"""One real deployment for every test that talks to Triton: SmolLM2 with FP8 (per-token) KV,
`kvq deploy`, then `kvq serve` (the real tritonserver) in a subprocess.

Session-scoped fixtures (registered in conftest.py), so test_triton_server.py and
test_bad_requests.py share one server start. Expected outputs come from our engine called
directly, one prompt at a time (sequential greedy), never from the server. The server runs
with sampling's fault-injection seed set, so a test can make one request fail inside a
running batch (runtime/sampling.py, FAULT_SEED_ENV).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.sampling import FAULT_SEED_ENV
from triton_repo import client, protocol
from triton_repo.server import free_port

ENGINE_JSON = {
    "max_batch_size": 8,
    "max_input_len": 64,
    "max_seq_len": 128,
    "block_size": 16,
    "gpu_memory_fraction": 0.9,
}
FP8_PER_TOKEN = {"dtype": "fp8_e4m3", "granularity": "per_token", "symmetric": True, "scale_dtype": "float16"}
PROMPTS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 plus 2?",
    "Say hello in Spanish.",
    "What animal says moo?",
    "Name a planet.",
    "What is water made of?",
    "Give me a fruit.",
]
MAX_TOKENS = 12
# The request of TensorRT-LLM's documentation (its prompt, plain text, 20 tokens).
DOCS_PROMPT, DOCS_MAX_TOKENS = "What is machine learning?", 20
FAULT_SEED = 4242
OPENAI_MODEL = "smollm2-fp8"  # the name `kvq serve --openai-model` gives the OpenAI endpoint (test_openai.py)


@pytest.fixture(scope="session")
def triton_engine_dir(tmp_path_factory) -> Path:
    """SmolLM2 converted by kvq's builtin converter, plus the build stage's two files (docs/interfaces.md)."""
    from builder.convert import convert_source

    d = tmp_path_factory.mktemp("smollm2-fp8kv")
    convert_source("smollm2-135m", None, d, "float32")
    (d / "kv_format.json").write_text(json.dumps(FP8_PER_TOKEN))
    (d / "engine.json").write_text(json.dumps(ENGINE_JSON))
    return d


@pytest.fixture(scope="session")
def triton_reference(triton_engine_dir):
    """Sequential greedy outputs of the engine itself (one request at a time), and its tokenizer."""
    from runtime.engine import Engine

    engine = Engine.from_dir(triton_engine_dir, device="cpu")
    try:
        ids = [protocol.encode_prompt(engine.tokenizer, p, chat=True) for p in PROMPTS]
        texts = [engine.generate([i], max_tokens=MAX_TOKENS)[0].text for i in ids]
        docs_ids = protocol.encode_prompt(engine.tokenizer, DOCS_PROMPT, chat=False)
        docs = engine.generate([docs_ids], max_tokens=DOCS_MAX_TOKENS, logprobs=True)[0]
        assert max(engine.stats.step_batch_sizes) == 1  # really sequential
    finally:
        engine.shutdown()
    return {
        "texts": dict(zip(PROMPTS, texts, strict=True)),
        "tokenizer": engine.tokenizer,
        "docs": docs,
        "docs_prompt_ids": docs_ids,
    }


@pytest.fixture(scope="session")
def triton_repo_dir(triton_engine_dir, tmp_path_factory) -> Path:
    from click.testing import CliRunner

    from builder.cli import cli

    out = tmp_path_factory.mktemp("deploy") / "repo"
    r = CliRunner().invoke(
        cli,
        ["deploy", str(triton_engine_dir), "--out", str(out), "--device", "cpu", "--max-queue-delay-us", "500"],
    )
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="session")
def triton_served(triton_repo_dir, triton_reference):
    """`kvq serve REPO --openai-port N` in a subprocess; teardown sends SIGTERM and checks that nothing is
    left running."""
    repo = triton_repo_dir
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port(), "openai": free_port()}
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "kvq"),
            "serve",
            str(repo),
            "--http-port",
            str(ports["http"]),
            "--grpc-port",
            str(ports["grpc"]),
            "--metrics-port",
            str(ports["metrics"]),
            "--openai-port",
            str(ports["openai"]),
            "--openai-model",
            OPENAI_MODEL,
            "--log-dir",
            str(repo.parent),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", FAULT_SEED_ENV: str(FAULT_SEED)},
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not any(ln.startswith("openai:") for ln in lines):  # printed after Triton's "ready:"
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("kvq serve did not become ready:\n" + "".join(lines))
        time.sleep(0.5)
    server_pid = int(re.search(r"tritonserver pid (\d+)", "".join(lines)).group(1))
    yield {
        "http": f"127.0.0.1:{ports['http']}",
        "grpc": f"127.0.0.1:{ports['grpc']}",
        "metrics": f"http://127.0.0.1:{ports['metrics']}/metrics",
        "openai": f"http://127.0.0.1:{ports['openai']}/v1",
        "lines": lines,
    }
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, "".join(lines)
    reader.join(timeout=5)
    assert "tritonserver stopped" in "".join(lines)
    # neither the server nor a stub of its group is left; a SIGKILLed stub is gone only once it is reaped,
    # which its new parent (init) does in its own time on a loaded machine
    deadline = time.monotonic() + 30
    while True:
        try:
            os.killpg(server_pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"a process of tritonserver's group {server_pid} outlived kvq serve by 30 s")
        time.sleep(0.2)


def wait_idle(metrics_url: str, timeout_s: float = 120) -> dict:
    """Metrics once the engine has stopped generating (two equal reads a second apart)."""
    last = client.engine_metrics(metrics_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = client.engine_metrics(metrics_url)
        if now["generated_tokens"] == last["generated_tokens"]:
            return now
        last = now
    pytest.fail("the engine kept generating: a request is wedged")
