"""Requests to the real Triton deployment: TensorRT-LLM's and genai-perf's request bodies answered
correctly, and a catalogue of bad requests, each answered with a clear error naming its field,
while 8 healthy streams in the same engine batch finish with exactly the text they give alone.

The deployment (helpers_triton.py) is shared with test_triton_server.py; expected texts come
from the engine called directly, one request at a time.
"""

from __future__ import annotations

import math
import queue
import threading
import time

import numpy as np
import pytest
from helpers_triton import DOCS_MAX_TOKENS, DOCS_PROMPT, FAULT_SEED, MAX_TOKENS, PROMPTS

from runtime.errors import RequestError
from triton_repo import client

pytestmark = pytest.mark.slow

BASE = {"text_input": "Name a planet.", "max_tokens": 4}
EIGHT_MIB = 8 * 1024 * 1024
INVALID = "400"  # Triton's HTTP status for INVALID_ARG
# (kind, transport, fields over BASE, HTTP status or None for gRPC, message pattern)
CATALOGUE = [
    ("temperature inf", "grpc", {"temperature": math.inf}, None, r"temperature must be a finite number >= 0"),
    ("temperature nan", "grpc", {"temperature": math.nan}, None, r"temperature must be a finite number >= 0"),
    ("temperature negative", "http", {"temperature": -0.5}, INVALID, r"temperature must be a finite number >= 0"),
    ("top_p zero", "http", {"top_p": 0.0}, INVALID, r"top_p must be a number in \(0, 1\], got 0"),
    ("top_p above one", "http", {"top_p": 1.5}, INVALID, r"top_p must be a number in \(0, 1\], got 1.5"),
    ("top_k negative", "http", {"top_k": -1}, INVALID, r"top_k must be an integer >= 0"),
    ("max_tokens zero", "http", {"max_tokens": 0}, INVALID, r"max_tokens must be in \[1, \d+\]"),
    ("max_tokens beyond the engine", "http", {"max_tokens": 1000}, INVALID, r"max_tokens must be in \[1, \d+\]"),
    ("prompt over max_input_len", "http", {"text_input": "word " * 80}, INVALID, r"max_input_len=64"),
    ("8 MiB prompt", "http", {"text_input": "x" * EIGHT_MIB}, INVALID, rf"text_input has {EIGHT_MIB} bytes"),
    ("invalid UTF-8", "grpc", {"text_input": b"caf\xe9 au lait"}, None, r"text_input is not valid UTF-8"),
    ("empty prompt", "http", {"text_input": "  "}, INVALID, r"text_input is empty"),
    ("unknown field", "http", {"colour": "red"}, INVALID, r"unknown request field\(s\) \['colour'\]"),
    ("repetition_penalty zero", "http", {"repetition_penalty": 0.0}, INVALID, r"repetition_penalty must be a finite number > 0"),
    ("presence_penalty inf", "grpc", {"presence_penalty": math.inf}, None, r"presence_penalty must be a finite number"),
    ("frequency_penalty nan", "grpc", {"frequency_penalty": math.nan}, None, r"frequency_penalty must be a finite number"),
    ("min_length above max_tokens", "http", {"min_length": 10}, INVALID, r"min_length must be an integer in \[0, max_tokens=4\]"),
    ("length_penalty nan", "grpc", {"length_penalty": math.nan}, None, r"length_penalty must be a finite number"),
    ("end_id outside the vocabulary", "http", {"end_id": 10**6}, INVALID, r"end_id must be a token id in \[0, 49152\)"),
    ("beam_width 2", "http", {"beam_width": 2}, INVALID, r"beam_width must be 1"),
    ("num_return_sequences 3", "http", {"num_return_sequences": 3}, INVALID, r"num_return_sequences must be 1"),
    ("return_context_logits", "http", {"return_context_logits": True}, INVALID, r"return_context_logits is not supported here"),
    ("return_generation_logits", "http", {"return_generation_logits": True}, INVALID, r"return_generation_logits is not supported"),
    ("lora_task_id", "http", {"lora_task_id": 7}, INVALID, r"lora_task_id is not supported here \(LoRA"),
    ("embedding_bias_words", "http", {"embedding_bias_words": ["planet"]}, INVALID, r"embedding_bias_words is not supported"),
    ("guided_decoding_guide", "http", {"guided_decoding_guide": "{}"}, INVALID, r"guided_decoding_guide is not supported"),
    ("decoder_text_input", "http", {"decoder_text_input": "x"}, INVALID, r"decoder_text_input is not supported"),
    ("prompt_vocab_size", "http", {"prompt_vocab_size": 5}, INVALID, r"prompt_vocab_size is not supported"),
    # sent as INTERNAL; tritonserver 2.51 answers any error of a decoupled step behind the ensemble with 400
    ("failure inside sampling", "http", {"random_seed": FAULT_SEED, "temperature": 0.7}, INVALID,
     r"the engine failed on this request \(requests beside it are unaffected\)"),
]


def _grpc_inputs(fields: dict) -> list:
    import tritonclient.grpc as grpcclient

    from triton_repo.protocol import ENSEMBLE_REQUEST

    dtypes = {f.name: f.dtype for f in ENSEMBLE_REQUEST}
    inputs = []
    for name, value in fields.items():
        if dtypes[name] == "STRING":
            values = value if isinstance(value, list) else [value]
            arr = np.array([[v if isinstance(v, bytes) else v.encode() for v in values]], dtype=object)
            dtype = "BYTES"
        else:
            dtype = dtypes[name]
            arr = np.array([[value]], dtype={"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32,
                                             "BOOL": bool}[dtype])
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def _grpc(url: str, fields: dict, timeout_s: float = 120) -> list:
    """All responses of one gRPC stream request: the result objects, or raises RequestError."""
    import tritonclient.grpc as grpcclient

    events: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        c.async_stream_infer("ensemble", _grpc_inputs(fields), enable_empty_final_response=True)
        out = []
        while True:
            result, error = events.get(timeout=timeout_s)
            if error is not None:
                raise RequestError(f"the server rejected the request: {error}")
            out.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out
    finally:
        c.stop_stream()
        c.close()


def _text(results) -> str:
    return "".join(
        x.decode() for r in results if r.as_numpy("text_output") is not None for x in r.as_numpy("text_output").reshape(-1)
    )


def _send_bad(served, transport, fields, status, match) -> None:
    body = {**BASE, **fields}
    with pytest.raises(RequestError, match=match) as info:
        if transport == "http":
            client.post_generate(served["http"], body)
        else:
            _grpc(served["grpc"], body)
    if status is not None:
        assert f"(HTTP {status})" in str(info.value)


# ------------------------------------------------ TensorRT-LLM's and genai-perf's requests
def test_the_trtllm_documentation_request_over_http_and_grpc_streaming(triton_served, triton_reference):
    docs = triton_reference["docs"]
    body = {"text_input": DOCS_PROMPT, "max_tokens": DOCS_MAX_TOKENS, "bad_words": "", "stop_words": "",
            "pad_id": 2, "end_id": 2}  # verbatim from TensorRT-LLM's docs
    assert client.post_generate(triton_served["http"], body)["text_output"] == docs.text
    results = _grpc(triton_served["grpc"], {**body, "stream": True})
    assert len(results) > 3 and _text(results) == docs.text


def test_genai_perf_requests_with_exclude_input_in_output(triton_served, triton_reference):
    docs, tok = triton_reference["docs"], triton_reference["tokenizer"]
    body = {"text_input": [DOCS_PROMPT], "max_tokens": [DOCS_MAX_TOKENS], "exclude_input_in_output": [True]}
    assert client.post_generate(triton_served["http"], body)["text_output"] == docs.text
    results = _grpc(triton_served["grpc"], {"text_input": DOCS_PROMPT, "max_tokens": DOCS_MAX_TOKENS,
                                            "exclude_input_in_output": True, "stream": True})
    assert _text(results) == docs.text
    # exclude_input_in_output false: the prompt comes back in front, as tensorrt_llm answers
    full = client.post_generate(triton_served["http"], {**body, "exclude_input_in_output": [False]})
    prompt_ids = triton_reference["docs_prompt_ids"]
    assert full["text_output"] == tok.decode(prompt_ids + docs.token_ids, skip_special_tokens=True)
    assert full["text_output"].startswith(DOCS_PROMPT)


def test_tensorrt_llm_bls_answers_like_the_ensemble(triton_served, triton_reference):
    body = {"text_input": DOCS_PROMPT, "max_tokens": DOCS_MAX_TOKENS}
    answer = client.post_generate(triton_served["http"], body, model="tensorrt_llm_bls")
    assert answer["text_output"] == triton_reference["docs"].text
    with pytest.raises(RequestError, match=r"image_url_input is not supported here \(kvq engines are text-only\)"):
        client.post_generate(triton_served["http"], {**body, "image_url_input": "http://x/y.png"},
                             model="tensorrt_llm_bls")


def test_return_log_probs_over_http_and_streaming(triton_served, triton_reference):
    docs = triton_reference["docs"]
    body = {"text_input": DOCS_PROMPT, "max_tokens": DOCS_MAX_TOKENS, "return_log_probs": True}
    answer = client.post_generate(triton_served["http"], body)
    np.testing.assert_allclose(answer["output_log_probs"], docs.logprobs, rtol=0, atol=1e-4)
    np.testing.assert_allclose(answer["cum_log_probs"], sum(docs.logprobs), rtol=0, atol=1e-3)
    results = _grpc(triton_served["grpc"], {**body, "stream": True})
    streamed = [v for r in results if r.as_numpy("output_log_probs") is not None
                for v in r.as_numpy("output_log_probs").reshape(-1).tolist()]
    np.testing.assert_allclose(streamed, docs.logprobs, rtol=0, atol=1e-4)


# ------------------------------------------------------------------ bad requests
@pytest.mark.parametrize("kind, transport, fields, status, match", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bad_request_gets_a_clear_error(triton_served, kind, transport, fields, status, match):
    t0 = time.monotonic()
    _send_bad(triton_served, transport, fields, status, match)
    if kind == "8 MiB prompt":
        assert time.monotonic() - t0 < 10  # refused by size, not tokenized first


def test_tiny_temperature_is_greedy(triton_served, triton_reference):
    req = client.GenerateRequest(PROMPTS[5], max_tokens=MAX_TOKENS, temperature=1e-40, random_seed=1,
                                 apply_chat_template=True)
    assert client.generate(triton_served["http"], req) == triton_reference["texts"][PROMPTS[5]]


def test_bad_requests_of_every_kind_leave_8_healthy_streams_unchanged(triton_served, triton_reference):
    healthy: list = [None] * 8
    started = [threading.Event() for _ in range(8)]

    def stream(i: int) -> None:
        req = client.GenerateRequest(PROMPTS[i], max_tokens=MAX_TOKENS, apply_chat_template=True)
        pieces = []
        try:
            for event in client.stream(triton_served["grpc"], req):
                started[i].set()
                pieces.append(event.text)
            healthy[i] = "".join(pieces)
        except Exception as e:  # recorded and asserted below
            healthy[i] = e
        finally:
            started[i].set()

    streams = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in streams:
        t.start()
    for ev in started:
        assert ev.wait(120)
    bad_errors: dict = {}

    def bad(kind, transport, fields, status, match) -> None:
        try:
            _send_bad(triton_served, transport, fields, status, match)
        except BaseException as e:  # noqa: BLE001 - recorded and asserted below
            bad_errors[kind] = e

    senders = [threading.Thread(target=bad, args=c) for c in CATALOGUE]
    for t in senders:
        t.start()
    for t in senders + streams:
        t.join(timeout=300)
    assert not bad_errors, bad_errors
    assert healthy == [triton_reference["texts"][p] for p in PROMPTS]
