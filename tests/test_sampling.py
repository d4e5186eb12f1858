"""Sampling extras (penalties, min_tokens, bad words, stop sequences, log-probs), the validation of
sampling fields, and per-request failure isolation in a running batch (CPU engine)."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from helpers_runtime import tiny_llama_dir

from runtime.engine import Engine
from runtime.errors import NumericsError, RequestError
from runtime.sampling import FAULT_SEED_ENV, SamplingParams, select_tokens

PROMPTS = [[(5 * i + 11 * j) % 400 + 3 for j in range(n)] for i, n in enumerate([4, 19, 7, 30, 2, 11, 23, 9])]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.from_dir(tiny_llama_dir(tmp_path_factory), num_blocks=96, block_size=8)
    yield eng
    eng.shutdown()


class _Row:
    def __init__(self, sp, prompt=(), output=()):
        self.sampling, self.generator = sp, (None if sp.greedy else sp.make_generator())
        self.prompt_ids, self.output_ids = list(prompt), list(output)


def _alone(eng, prompts, sp):
    return [eng.generate([p], sp)[0].token_ids for p in prompts]


# ------------------------------------------------------------ the math
def test_greedy_rows_without_extras_are_a_plain_argmax():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    picks = select_tokens(logits, [_Row(SamplingParams()) for _ in range(6)])
    assert [p.token for p in picks] == logits.argmax(-1).tolist()
    assert all(p.logprob is None and p.error is None for p in picks)


def test_penalties_match_an_fp64_reference():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g) * 4
    prompt, output = [3, 4, 4, 9], [9, 9, 17, 3, 40]
    sps = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(presence_penalty=0.8, frequency_penalty=0.45),
        SamplingParams(repetition_penalty=0.6, presence_penalty=-0.3, frequency_penalty=1.2),
    ]
    rows = [_Row(sp, prompt, output) for sp in sps]
    from runtime.sampling import _adjust

    got = logits.clone()
    _adjust(got, [0, 1, 2], rows, eos_ids=())
    ref = logits.double().clone()
    for i, sp in enumerate(sps):
        for t in range(50):
            x = ref[i, t].item()
            if t in prompt + output:
                x = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
            c = output.count(t)
            x -= sp.frequency_penalty * c + sp.presence_penalty * (c > 0)
            ref[i, t] = x
    # fp32 arithmetic on |x| < ~20: a few ulps
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=20 * 2**-23 * 4)
    # a penalized argmax moves off the repeated token
    hot = torch.zeros(1, 50)
    hot[0, 9], hot[0, 10] = 5.0, 4.0
    (pick,) = select_tokens(hot, [_Row(SamplingParams(frequency_penalty=0.6), output=[9, 9])])
    assert pick.token == 10


def test_min_tokens_and_bad_words_ban_tokens():
    logits = torch.zeros(1, 20)
    logits[0, 2], logits[0, 7], logits[0, 8] = 9.0, 8.0, 7.0  # 2 = eos
    eos = (2,)
    assert select_tokens(logits, [_Row(SamplingParams())], eos)[0].token == 2
    assert select_tokens(logits, [_Row(SamplingParams(min_tokens=3), output=[5])], eos)[0].token == 7
    assert select_tokens(logits, [_Row(SamplingParams(min_tokens=3), output=[5, 5, 5])], eos)[0].token == 2
    # min_tokens also holds back the request's own stop ids (end_id)
    sp = SamplingParams(min_tokens=2, stop_token_ids=(7,), ignore_eos=True)
    assert select_tokens(logits, [_Row(sp)], eos)[0].token == 2  # eos is not an end token here
    sp = SamplingParams(min_tokens=2, stop_token_ids=(7,))
    assert select_tokens(logits, [_Row(sp)], eos)[0].token == 8
    # a one-token bad word is always banned; a two-token one only after its first token
    sp = SamplingParams(bad_words=((2,), (4, 7)))
    assert select_tokens(logits, [_Row(sp, prompt=[1, 4])], eos)[0].token == 8
    assert select_tokens(logits, [_Row(sp, prompt=[1, 3])], eos)[0].token == 7


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", math.inf), ("temperature", math.nan), ("temperature", -0.5), ("top_p", 0.0),
        ("top_p", 1.5), ("top_p", math.nan), ("top_k", -1), ("max_tokens", 0), ("repetition_penalty", 0.0),
        ("presence_penalty", math.inf), ("frequency_penalty", math.nan), ("min_tokens", 99), ("seed", -1),
    ],
)
def test_bad_sampling_fields_name_the_field_and_range(field, value):
    with pytest.raises(RequestError, match=rf"^{field} must be .*got"):
        SamplingParams(**{field: value})


# --------------------------------------------------------- the engine
def test_tiny_temperatures_are_greedy(engine):
    greedy = engine.generate(PROMPTS[:3], max_tokens=8, ignore_eos=True)
    tiny = engine.generate(PROMPTS[:3], max_tokens=8, ignore_eos=True, temperature=1e-40, seed=3)
    assert [g.token_ids for g in tiny] == [g.token_ids for g in greedy]


def test_max_tokens_beyond_the_engine_names_the_field_and_range(engine):
    with pytest.raises(RequestError, match=r"max_tokens must be in \[1, \d+\]"):
        engine.generate([PROMPTS[0]], max_tokens=10**6)
    with pytest.raises(RequestError, match=r"bad_words holds token id"):
        engine.generate([PROMPTS[0]], max_tokens=2, bad_words=((10**6,),))


def test_stop_sequences_end_generation_in_the_engine(engine):
    (full,) = engine.generate([PROMPTS[1]], max_tokens=12, ignore_eos=True)
    stop = tuple(full.token_ids[4:6])
    (cut,) = engine.generate([PROMPTS[1]], max_tokens=12, ignore_eos=True, stop_sequences=(stop,))
    first = next(i for i in range(1, len(full.token_ids)) if tuple(full.token_ids[i - 1 : i + 1]) == stop)
    assert cut.token_ids == full.token_ids[: first + 1] and cut.finish_reason == "stop"


def test_logprobs_match_a_dense_fp64_softmax(engine):
    (g,) = engine.generate([PROMPTS[3]], max_tokens=6, ignore_eos=True, temperature=0.9, seed=5, logprobs=True)
    ids = torch.tensor(PROMPTS[3] + g.token_ids[:-1])
    with torch.no_grad():
        dense = engine.model.forward_dense(ids).double()
    ref = torch.log_softmax(dense, -1)[len(PROMPTS[3]) - 1 :].gather(1, torch.tensor(g.token_ids)[:, None])[:, 0]
    assert len(g.logprobs) == len(g.token_ids)
    torch.testing.assert_close(torch.tensor(g.logprobs, dtype=torch.float64), ref, rtol=0, atol=1e-4)


def test_extras_in_one_request_leave_the_others_unchanged(engine):
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = _alone(engine, PROMPTS, sp)
    extra = SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5,
                           frequency_penalty=0.5, min_tokens=4, bad_words=((alone[0][0],),), logprobs=True)
    out = _submit_all(engine, [(p, sp) for p in PROMPTS] + [(PROMPTS[0], extra)])
    assert [o["ids"] for o in out[:-1]] == alone
    assert out[-1]["reason"] == "length" and out[-1]["ids"][0] != alone[0][0]


def _submit_all(engine, requests):
    """Submit every request (they share the running batch); each one's tokens and finish reason."""
    results = [{"ids": [], "reason": None, "done": threading.Event()} for _ in requests]

    def callback(r):
        def on_token(tok, finished, reason, logprob=None):
            if tok is not None:
                r["ids"].append(tok)
            if finished:
                r["reason"] = reason
                r["done"].set()
        return on_token

    for (ids, sp), r in zip(requests, results):
        engine.submit(ids, sp, callback(r))
    for r in results:
        assert r["done"].wait(60)
    return results


@pytest.mark.parametrize("fault", ["sampling raises", "NaN logits"])
def test_a_failing_request_fails_alone_and_frees_its_blocks(engine, monkeypatch, fault):
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = _alone(engine, PROMPTS, sp)
    bad = SamplingParams(max_tokens=12, ignore_eos=True, seed=4242)
    if fault == "sampling raises":
        monkeypatch.setenv(FAULT_SEED_ENV, "4242")
    else:
        run = engine.runner.run

        def poisoned(step):
            logits = run(step).clone()  # an inference-mode tensor: poison a copy
            for i, s in enumerate(step.sampled):
                if s.sampling.seed == 4242 and len(s.output_ids) == 3:
                    logits[i] = float("nan")
            return logits

        monkeypatch.setattr(engine.runner, "run", poisoned)
    requests = [(p, sp) for p in PROMPTS[:4]] + [(PROMPTS[5], bad)] + [(p, sp) for p in PROMPTS[4:]]
    out = _submit_all(engine, requests)
    healthy = out[:4] + out[5:]
    assert [o["ids"] for o in healthy] == alone and all(o["reason"] == "length" for o in healthy)
    assert out[4]["reason"] == "error"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    if fault == "NaN logits":
        assert len(out[4]["ids"]) == 3
        with pytest.raises(NumericsError, match="NaN/Inf logits"):
            monkeypatch.setattr(engine.runner, "run", poisoned)
            engine.generate([PROMPTS[5]], bad)
