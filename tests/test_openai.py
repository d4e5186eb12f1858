"""The OpenAI-compatible endpoint: the real `openai` client against `kvq serve --openai-port`.

The session's one real deployment (tests/helpers_triton.py: SmolLM2, FP8
per-token KV, the real tritonserver, started by `kvq serve --openai-port`)
serves these tests too. Expected texts come from our engine called directly,
one prompt at a time, greedy; never from the server.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from click.testing import CliRunner
from helpers_triton import FAULT_SEED, OPENAI_MODEL, PROMPTS, wait_idle

from builder.cli import cli
from triton_repo import client, protocol
from triton_repo.server import free_port

pytestmark = pytest.mark.slow

MODEL = OPENAI_MODEL
CHAT_PROMPT = PROMPTS[0]  # "What is the capital of France?"
TEXT_PROMPT = "The three primary colors are"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(triton_engine_dir):
    """Greedy outputs of the engine itself, one request at a time, with the prompt ids it was given."""
    from runtime.engine import Engine

    engine = Engine.from_dir(triton_engine_dir, device="cpu")
    try:
        tok = engine.tokenizer
        chat_ids = protocol.encode_prompt(tok, CHAT_PROMPT, chat=True)
        text_ids = protocol.encode_prompt(tok, TEXT_PROMPT, chat=False)
        chat = engine.generate([chat_ids], max_tokens=MAX_TOKENS)[0]
        text = engine.generate([text_ids], max_tokens=MAX_TOKENS, logprobs=True)[0]
        chat_to_eos = engine.generate([chat_ids], max_tokens=48)[0]
    finally:
        engine.shutdown()
    return {"chat": chat, "chat_ids": chat_ids, "text": text, "text_ids": text_ids, "tokenizer": tok,
            "chat_to_eos": chat_to_eos}


@pytest.fixture(scope="module")
def served(triton_served):
    """The session's deployment (tests/helpers_triton.py: `kvq serve REPO --openai-port N`)."""
    base = triton_served["openai"]
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120) as api:
        yield {**triton_served, "base": base, "client": api}


def _greedy(**kw):
    return {"model": MODEL, "temperature": 0.0, "max_tokens": MAX_TOKENS, **kw}


# ------------------------------------------------------------------ outputs
def test_models_lists_the_served_model(served):
    assert [m.id for m in served["client"].models.list()] == [MODEL]
    assert served["client"].models.retrieve(MODEL).owned_by == "kvq"


def test_completion_equals_the_engine_with_usage(served, reference):
    ref = reference["text"]
    r = served["client"].completions.create(prompt=TEXT_PROMPT, **_greedy())
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length" and len(ref.token_ids) == MAX_TOKENS
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(reference["text_ids"]), MAX_TOKENS)
    # token ids as the prompt give the same answer
    r2 = served["client"].completions.create(prompt=reference["text_ids"], **_greedy())
    assert r2.choices[0].text == ref.text


def test_completion_stream_delivers_the_same_text_in_pieces_then_usage(served, reference):
    chunks = list(
        served["client"].completions.create(
            prompt=TEXT_PROMPT, stream=True, stream_options={"include_usage": True}, **_greedy()
        )
    )
    pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(pieces) >= 3 and "".join(pieces) == reference["text"].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_equals_the_engine_with_its_chat_template(served, reference):
    ref = reference["chat"]
    r = served["client"].chat.completions.create(messages=[{"role": "user", "content": CHAT_PROMPT}], **_greedy())
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert "Paris" in ref.text
    assert r.usage.prompt_tokens == len(reference["chat_ids"]) and r.usage.completion_tokens == len(ref.token_ids)


def test_chat_stream_equals_the_non_streamed_answer(served, reference):
    chunks = list(
        served["client"].chat.completions.create(
            messages=[{"role": "user", "content": CHAT_PROMPT}], stream=True, **_greedy()
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 3 and "".join(pieces) == reference["chat"].text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_string_ends_the_answer_before_it(served, reference):
    full = reference["chat"].text  # "The capital of France is Paris..."
    want = full[: full.index(" France")]
    msgs = [{"role": "user", "content": CHAT_PROMPT}]
    r = served["client"].chat.completions.create(messages=msgs, stop=[" France", "zzz"], **_greedy())
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(served["client"].chat.completions.create(messages=msgs, stop=" France", stream=True, **_greedy()))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_multi_turn_chat_runs(served):
    msgs = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ]
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 1234}
    a = served["client"].chat.completions.create(**kw).choices[0].message.content
    b = served["client"].chat.completions.create(**kw).choices[0].message.content
    assert a == b and a


def test_logprobs_are_the_engines_for_completions_and_chat(served, reference):
    ref = reference["text"]
    r = served["client"].completions.create(prompt=TEXT_PROMPT, logprobs=0, **_greedy())
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == MAX_TOKENS
    assert "".join(lp.tokens) == ref.text
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert all(x <= 0.0 for x in lp.token_logprobs)
    # streamed chat: one logprob entry per generated token, in order
    chunks = list(
        served["client"].chat.completions.create(
            messages=[{"role": "user", "content": CHAT_PROMPT}], logprobs=True, stream=True, **_greedy()
        )
    )
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    whole = served["client"].chat.completions.create(
        messages=[{"role": "user", "content": CHAT_PROMPT}], logprobs=True, **_greedy()
    )
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in whole.choices[0].logprobs.content])
    assert len(entries) == whole.usage.completion_tokens


def test_penalties_and_min_tokens_reach_the_engine(served, reference):
    # min_tokens past the EOS the greedy answer ends with: the engine keeps going
    ref = reference["chat_to_eos"]
    assert ref.finish_reason == "stop"  # the premise: unconstrained, it ends early
    msgs = [{"role": "user", "content": CHAT_PROMPT}]
    n = len(ref.token_ids) + 4
    r = served["client"].chat.completions.create(
        messages=msgs, model=MODEL, temperature=0.0, max_tokens=n, extra_body={"min_tokens": n}
    )
    assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"
    r = served["client"].chat.completions.create(messages=msgs, presence_penalty=2.0, frequency_penalty=1.0,
                                                 **_greedy())
    assert r.choices[0].message.content


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "kw, param",
    [
        ({"temperature": 5.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1000}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logit_bias": {"1": 5.0}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"extra_body": {"colour": "red"}}, "colour"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": " ".join(["word"] * 80)}]}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ],
)
def test_bad_fields_are_400_naming_the_field(served, kw, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        served["client"].chat.completions.create(**body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error", e.value.body
    assert param in e.value.body["message"] or param == "messages", e.value.body


def test_bad_completion_prompts_are_400(served):
    for prompt, match in [([10**9], "outside"), ([], "empty"), (["a", "b"], "one prompt"), ("x" * 70000, "bytes")]:
        with pytest.raises(openai.BadRequestError, match=match) as e:
            served["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert e.value.body["param"] == "prompt"


def test_unknown_model_is_404_and_raw_bad_json_is_400(served):
    with pytest.raises(openai.NotFoundError) as e:
        served["client"].completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model" and MODEL in e.value.body["message"]
    r = httpx.post(f"{served['base']}/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_an_engine_failure_is_500_and_the_next_request_is_served(served, reference):
    """The deployment fails a request with FAULT_SEED inside sampling (tests/helpers_triton.py)."""
    msgs = [{"role": "user", "content": CHAT_PROMPT}]
    with pytest.raises(openai.InternalServerError) as e:
        served["client"].chat.completions.create(messages=msgs, model=MODEL, max_tokens=4, seed=FAULT_SEED)
    assert e.value.status_code == 500 and e.value.body["code"] == "engine_error", e.value.body
    r = served["client"].chat.completions.create(messages=msgs, **_greedy())
    assert r.choices[0].message.content == reference["chat"].text


def test_triton_unreachable_is_503(served, reference):
    """The frontend in front of a Triton address nobody listens on."""
    from fastapi.testclient import TestClient

    from triton_repo.openai_api.app import Served, create_app
    from triton_repo.openai_api.triton_stream import TritonStreams, discover

    model = discover(served["grpc"])
    gone = Served(model, reference["tokenizer"], MODEL, TritonStreams(f"127.0.0.1:{free_port()}", model), 0)
    with TestClient(create_app(lambda: gone)) as tc:
        r = tc.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "triton_unavailable", r.text




def test_client_disconnect_cancels_the_engine_request(served):
    before = wait_idle(served["metrics"])
    body = {"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 100, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", f"{served['base']}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = r.iter_lines()
        got = [next(events) for _ in range(4)]  # a few tokens arrive, then the client hangs up
    assert any(g.startswith("data: ") for g in got)
    deadline = time.monotonic() + 30
    while client.engine_metrics(served["metrics"])["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, "the engine never heard that the client left"
        time.sleep(0.2)
    after = wait_idle(served["metrics"])
    assert after["generated_tokens"] - before["generated_tokens"] < 100


# --------------------------------------------------------------------- bench
def test_kvq_bench_drives_the_openai_endpoint(served, tmp_path):
    """It counts generated tokens as the engine does (the stream's `usage`), not streamed chunks."""
    out = tmp_path / "bench.json"
    before = wait_idle(served["metrics"])
    r = CliRunner().invoke(
        cli,
        ["bench", "--openai", served["base"], "--concurrency", "2", "--requests", "4", "--max-tokens", "6",
         "--json", str(out)],
    )
    assert r.exit_code == 0, r.output
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 4 and s["errors"] == 0 and s["output_tokens"] > 4
    assert s["output_tokens"] == wait_idle(served["metrics"])["generated_tokens"] - before["generated_tokens"]
    assert 0 < s["responses"] <= s["output_tokens"]
    assert 0 < s["ttft_ms_p50"] <= s["ttft_ms_p99"] and 0 < s["itl_ms_p50"]


# ------------------------------------------------------------- stop strings
@pytest.mark.parametrize("stops", [[" brûlée"], ["é 😀"], ["zzz", "5€"], ["never there"]])
def test_streamed_text_holds_back_what_may_become_a_stop_string(reference, stops):
    """Fed one token at a time, the pieces join to the text before the first stop string, and no
    piece ever shows a character that the stop string later removes."""
    from triton_repo.openai_api.text import ChoiceText

    tok = reference["tokenizer"]
    text = "Crème brûlée 😀 costs 5€ — naïve façade"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    hits = [text.find(s) for s in stops if s in text]
    want = text[: min(hits)] if hits else text
    choice, pieces = ChoiceText(tok, stops), []
    for n, t in enumerate(ids):
        pieces.append(choice.add([t], None, final=n == len(ids) - 1))
        assert want.startswith("".join(pieces)), pieces
        if choice.stopped:
            break
    assert "".join(pieces) == want == choice.text
    assert choice.stopped == bool(hits)
