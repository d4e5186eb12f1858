"""The real deployment: SmolLM2 with FP8 (per-token) KV, `kvq deploy`, `kvq serve`, the real tritonserver.

One server (started through the `kvq serve` CLI, stopped with SIGTERM) serves
every test in this module. Expected outputs come from our engine called
directly, one prompt at a time (sequential greedy), never from the server.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import helpers_triton
import numpy as np
import pytest
from click.testing import CliRunner

from builder.cli import cli
from runtime.errors import ExternalToolMissing, RequestError, ServerError
from triton_repo import client, protocol
from triton_repo.bench import run_bench
from triton_repo.server import free_port, start_server

pytestmark = pytest.mark.slow

ENGINE_JSON, PROMPTS, MAX_TOKENS = helpers_triton.ENGINE_JSON, helpers_triton.PROMPTS, helpers_triton.MAX_TOKENS


@pytest.fixture
def engine_dir(triton_engine_dir):
    return triton_engine_dir


@pytest.fixture
def reference(triton_reference):
    return triton_reference


@pytest.fixture
def served(triton_served):
    return triton_served


def _ready(url: str) -> bool:
    with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=5) as r:
        return r.status == 200


def _chat(prompt: str, **kw) -> client.GenerateRequest:
    return client.GenerateRequest(
        prompt, max_tokens=kw.pop("max_tokens", MAX_TOKENS), apply_chat_template=True, **kw
    )


# --------------------------------------------------------------- outputs
def test_http_greedy_text_equals_the_engine(served, reference):
    for prompt in PROMPTS[:3]:
        assert client.generate(served["http"], _chat(prompt)) == reference["texts"][prompt]
    assert "Paris" in reference["texts"][PROMPTS[0]]


def test_grpc_stream_delivers_the_same_text_in_increments(served, reference):
    events = list(client.stream(served["grpc"], _chat(PROMPTS[0])))
    pieces = [e.text for e in events if e.text]
    assert len(pieces) >= 3, pieces
    assert "".join(pieces) == reference["texts"][PROMPTS[0]]
    assert events[-1].final and [e.t for e in events] == sorted(e.t for e in events)


def test_32_concurrent_streams_match_sequential_greedy_and_are_batched(served, reference):
    before = client.engine_metrics(served["metrics"])["steps_by_batch_size"]
    results: list = [None] * 32

    def run(i: int) -> None:
        try:
            results[i] = "".join(
                e.text for e in client.stream(served["grpc"], _chat(PROMPTS[i % len(PROMPTS)]))
            )
        except Exception as e:  # recorded and asserted below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    errors = [r for r in results if not isinstance(r, str)]
    assert not errors, errors[:3]
    for i, text in enumerate(results):
        assert text == reference["texts"][PROMPTS[i % len(PROMPTS)]], i
    after = client.engine_metrics(served["metrics"])["steps_by_batch_size"]
    ran = {b: after.get(b, 0) - before.get(b, 0) for b in after if after.get(b, 0) > before.get(b, 0)}
    print(f"\nengine steps by batch size for 32 concurrent streams: {dict(sorted(ran.items()))}")
    assert max(ran) == ENGINE_JSON["max_batch_size"]  # the engine filled its batch
    assert sum(b * n for b, n in ran.items() if b > 1) > sum(n for b, n in ran.items() if b == 1)


# ----------------------------------------------------------- bad requests
LONG_PROMPT = " ".join(["word"] * 80)  # > max_input_len 64 tokens


@pytest.mark.parametrize(
    "body, match",
    [
        ({"max_tokens": 4}, "missing required input"),
        ({"text_input": "", "max_tokens": 4}, "text_input is empty"),
        ({"text_input": "   ", "max_tokens": 4}, "text_input is empty"),
        ({"text_input": "hi", "max_tokens": 0}, r"max_tokens must be in \[1, \d+\]"),
        ({"text_input": "hi", "max_tokens": -5}, r"max_tokens must be in \[1, \d+\]"),
        ({"text_input": "hi", "max_tokens": 1000}, "max_seq_len 128"),
        ({"text_input": LONG_PROMPT, "max_tokens": 4}, "max_input_len=64"),
        ({"text_input": "hi", "max_tokens": "four"}, "Unable to parse"),
        ({"text_input": "hi", "max_tokens": 4, "temperature": "hot"}, "Unable to parse"),
        ({"text_input": "hi", "max_tokens": 4, "colour": "red"}, "unknown request field"),
        ({"text_input": "hi", "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ],
)
def test_bad_http_requests_get_an_error_and_the_server_stays_ready(served, body, match):
    with pytest.raises(RequestError, match=match):
        client.post_generate(served["http"], body)
    assert _ready(served["http"])


def test_bad_grpc_requests_get_an_error_and_the_server_stays_ready(served):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    c = grpcclient.InferenceServerClient(served["grpc"])
    good = client.grpc_inputs(_chat("hi", max_tokens=2), stream=False)
    wrong_dtype = grpcclient.InferInput("max_tokens", [1, 1], "FP32")
    wrong_dtype.set_data_from_numpy(np.array([[4.0]], dtype=np.float32))
    unknown = grpcclient.InferInput("colour", [1, 1], "INT32")
    unknown.set_data_from_numpy(np.array([[1]], dtype=np.int32))
    for inputs, match in [([good[0], wrong_dtype], "data-type|datatype|FP32"), (good + [unknown], "colour")]:
        errors = []
        c.start_stream(callback=lambda result, error, errors=errors: errors.append(error))
        c.async_stream_infer("ensemble", inputs)
        deadline = time.monotonic() + 30
        while not errors and time.monotonic() < deadline:
            time.sleep(0.05)
        c.stop_stream()
        assert (
            errors and isinstance(errors[0], InferenceServerException) and re.search(match, str(errors[0]))
        ), errors
    c.close()
    assert _ready(served["http"])




def test_client_disconnect_mid_ensemble_stream_does_not_wedge_the_engine(served, reference):
    before = helpers_triton.wait_idle(served["metrics"])
    stream = client.stream(served["grpc"], _chat(PROMPTS[1], max_tokens=60))
    got = [next(stream), next(stream)]
    stream.close()  # stop_stream(cancel_requests=True): the client goes away mid-generation
    assert not any(e.final for e in got)
    # Served correctly while the orphan is still in the batch, and the server stays ready.
    assert client.generate(served["http"], _chat(PROMPTS[2])) == reference["texts"][PROMPTS[2]]
    assert _ready(served["http"])
    # tritonserver 2.51 does not pass an ensemble's cancellation on to its composing models, so the
    # orphan runs to its max_tokens at most, then frees its blocks: bounded, never wedged.
    after = helpers_triton.wait_idle(served["metrics"])
    assert after["generated_tokens"] - before["generated_tokens"] <= 60 + MAX_TOKENS


def test_client_disconnect_on_the_engine_model_cancels_its_engine_request(served, reference):
    import tritonclient.grpc as grpcclient

    before = helpers_triton.wait_idle(served["metrics"])
    ids = protocol.encode_prompt(reference["tokenizer"], PROMPTS[1], chat=True)
    inputs = []
    for name, arr, dtype in [
        ("input_ids", np.array([ids], dtype=np.int32), "INT32"),
        ("input_lengths", np.array([[len(ids)]], dtype=np.int32), "INT32"),
        ("request_output_len", np.array([[80]], dtype=np.int32), "INT32"),
        ("streaming", np.array([[True]]), "BOOL"),
    ]:
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    events = []
    c = grpcclient.InferenceServerClient(served["grpc"])
    c.start_stream(callback=lambda result, error: events.append(error))
    c.async_stream_infer("kvq_engine", inputs)
    deadline = time.monotonic() + 60
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(events) >= 3 and not any(events[:3])
    c.stop_stream(cancel_requests=True)
    c.close()
    deadline = time.monotonic() + 20
    while client.engine_metrics(served["metrics"])["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, "the engine never heard that the client left"
        time.sleep(0.2)
    after = helpers_triton.wait_idle(served["metrics"])
    assert after["generated_tokens"] - before["generated_tokens"] < 80  # stopped early
    assert _ready(served["http"])


def test_the_engine_model_reports_kv_cache_reuse_per_request(served, reference):
    """return_perf_metrics: tensorrt_llm's kv_cache_* outputs on the final response. The same
    prompt sent twice reuses every full page but the one holding its last token the second time."""
    import tritonclient.grpc as grpcclient

    # plain text no other test sends (a chat template's first page is shared with other chat requests)
    text = "Key value caches keep the pages of a finished request for the next request that starts the same way, so"
    ids = protocol.encode_prompt(reference["tokenizer"], text, chat=False)
    bs = ENGINE_JSON["block_size"]
    names = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")

    def infer() -> dict[str, int]:
        inputs = []
        for name, arr, dtype in [
            ("input_ids", np.array([ids], dtype=np.int32), "INT32"),
            ("input_lengths", np.array([[len(ids)]], dtype=np.int32), "INT32"),
            ("request_output_len", np.array([[4]], dtype=np.int32), "INT32"),
            ("return_perf_metrics", np.array([[True]]), "BOOL"),
        ]:
            t = grpcclient.InferInput(name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        results = []
        c = grpcclient.InferenceServerClient(served["grpc"])
        c.start_stream(callback=lambda result, error: results.append((result, error)))
        c.async_stream_infer("kvq_engine", inputs, outputs=[grpcclient.InferRequestedOutput(n) for n in names])
        deadline = time.monotonic() + 60
        while not results and time.monotonic() < deadline:
            time.sleep(0.02)
        c.stop_stream()
        c.close()
        (result, error), = results
        assert error is None, error
        return {n: int(result.as_numpy(n).reshape(-1)[0]) for n in names}

    first, second = infer(), infer()
    total = -(-len(ids) // bs)
    assert first == {names[0]: total, names[1]: 0, names[2]: total}  # a prompt the server has not seen
    reused = (len(ids) - 1) // bs
    assert reused >= 1 and second == {names[0]: total - reused, names[1]: reused, names[2]: total}


# ------------------------------------------------------------- protocol
def test_incremental_detokenization_with_multibyte_characters(reference):
    tok = reference["tokenizer"]
    text = "Crème brûlée 😀 costs 5€ — naïve façade 日本語"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = [protocol.text_delta(tok, ids[: n + 1], n, final=n == len(ids) - 1) for n in range(len(ids))]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_detokenization_of_a_long_stream_decodes_a_window(reference):
    """Token by token over ~1,000 tokens of mixed text (accents, emoji, CJK, code, spaces before punctuation): the
    pieces add up to the whole decode, none shows a half character, and each response decodes a bounded window
    (tokens decoded grow linearly with the stream, not quadratically)."""
    tok = reference["tokenizer"]
    text = "".join(f"Line {i}: crème brûlée 😀 costs {i}€ — 日本語の文章 , ok ? def f(x): return x ** {i}\n"
                   for i in range(40))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 900
    decoded = []

    class Counting:
        def decode(self, part, **kw):
            decoded.append(len(part))
            return tok.decode(part, **kw)

    pieces = [protocol.text_delta(Counting(), ids[: n + 1], n, final=n == len(ids) - 1) for n in range(len(ids))]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)
    assert sum(decoded) <= 2 * (4 * protocol.DELTA_CONTEXT + 1) * len(ids)


def test_stop_words_end_generation(served, reference):
    full = reference["texts"][PROMPTS[0]]  # "The capital of France is Paris..."
    text = client.generate(served["http"], _chat(PROMPTS[0], stop_words=[" France"]))
    assert text == full[: full.index(" France") + len(" France")]


# ------------------------------------------------------------ CLI, bench
def test_generate_cli_http_and_stream(served, reference):
    expected = reference["texts"][PROMPTS[0]]
    r = CliRunner().invoke(
        cli, ["generate", "--url", served["http"], "--chat", "--max-tokens", str(MAX_TOKENS), PROMPTS[0]]
    )
    assert r.exit_code == 0 and r.output == expected + "\n", r.output
    r = CliRunner().invoke(
        cli,
        [
            "generate",
            "--grpc-url",
            served["grpc"],
            "--stream",
            "--chat",
            "--max-tokens",
            str(MAX_TOKENS),
            PROMPTS[0],
        ],
    )
    assert r.exit_code == 0 and r.output == expected + "\n", r.output


def test_bench_reports_throughput_and_latency(served, tmp_path):
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(
        cli,
        [
            "bench",
            "--url",
            served["grpc"],
            "--concurrency",
            "4",
            "--requests",
            "8",
            "--max-tokens",
            "8",
            "--json",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["completed"] == 8 and s["errors"] == 0 and len(data["requests"]) == 8
    assert s["output_tokens"] == sum(row["num_tokens"] for row in data["requests"]) > 8
    assert 0 < s["ttft_ms_p50"] <= s["ttft_ms_p99"] and 0 < s["itl_ms_p50"] <= s["itl_ms_p99"]
    assert "TTFT p50" in r.output


def test_bench_spreads_its_streams_over_client_processes(served):
    """Two client processes, 3 streams in all, 7 requests: every request answered once, as one process answers
    it (greedy), and every token of the request timed."""
    kw = dict(concurrency=3, num_requests=7, max_tokens=6, keep_token_times=True, apply_chat_template=False)
    one = run_bench(served["grpc"], **kw)
    two = run_bench(served["grpc"], processes=2, **kw)
    assert two["summary"]["completed"] == 7 and two["summary"]["errors"] == 0
    assert [r["index"] for r in two["requests"]] == list(range(7))
    assert [r["text"] for r in two["requests"]] == [r["text"] for r in one["requests"]]
    assert all(r["num_tokens"] == len(r["token_times"]) > 0 and r["start"] <= r["token_times"][0]
               for r in two["requests"])
    assert two["summary"]["output_tokens"] == sum(r["num_tokens"] for r in two["requests"])


def test_bench_counts_errors_when_the_server_is_gone():
    port = free_port()
    result = run_bench(f"127.0.0.1:{port}", concurrency=2, num_requests=2, max_tokens=2, timeout_s=5)
    assert result["summary"]["errors"] == 2 and result["summary"]["completed"] == 0


# -------------------------------------------------- a model that fails to load
def test_start_server_reports_why_a_model_failed_to_load(tmp_path):
    model = tmp_path / "repo" / "broken"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'name: "broken" backend: "python" max_batch_size: 0 '
        'input [{name: "x" data_type: TYPE_INT32 dims: [1]}] '
        'output [{name: "y" data_type: TYPE_INT32 dims: [1]}]'
    )
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('kvq-test: engine dir is unreadable')\n"
    )
    with pytest.raises(ServerError, match="kvq-test: engine dir is unreadable"):
        start_server(tmp_path / "repo", ready_timeout_s=120, log_dir=tmp_path)


def test_start_server_refuses_numpy_2_before_starting_anything(tmp_path, monkeypatch):
    """Under numpy 2 the stub sends every tensor without its bytes: the server must not start."""
    import numpy

    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m" backend: "python"')
    monkeypatch.setattr(numpy, "__version__", "2.5.2")
    with pytest.raises(ExternalToolMissing, match=r"numpy 2\.5\.2 .*numpy<2"):
        start_server(tmp_path / "repo", log_dir=tmp_path)
    assert not list(tmp_path.glob("kvq-triton-*")), "a refused start must leave no server work directory"


def test_compare_measures_a_deployment_through_triton(served, engine_dir, tmp_path):
    """kvq compare --triton: the same concurrency levels through the real server, in the report."""
    from builder.compare import EngineUnderTest, Workload, compare_engines

    wl = Workload(prompt_len=16, output_len=4, concurrency=[1, 2], num_requests=2, seed=0, memory_budget=2**20)
    res = compare_engines([EngineUnderTest("fp8", engine_dir)], wl, "cpu", tmp_path, "t",
                          triton=[("fp8-triton", served["grpc"])])
    report = json.loads((tmp_path / "report.json").read_text())
    (t,) = report["triton"]
    assert [r["concurrency"] for r in t["runs"]] == [1, 2]
    assert all(r["errors"] == 0 and r["completed"] == 2 and r["output_tokens"] > 0 for r in t["runs"])
    assert "Through Triton" in (tmp_path / "report.md").read_text() and res["baseline"] == "fp8"
