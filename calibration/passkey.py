"""Passkey retrieval: a number hidden in filler text at a random depth.

The prompt follows the classic long-context test (Mohtashami & Jaggi): a plain
filler haystack, one sentence with a 5-digit pass key at a random depth, then
the question, in the model's chat template. The answer "The pass key is" is
given; we score the digits that follow it, teacher-forced (one prefill pass per trial
through the engine):

* exact match -- every digit is the argmax given the true digits before it
  (equivalent to greedy decoding reproducing the key after that prefix);
* the mean log-probability of the true digits (a graded signal that moves
  before the exact-match rate does).

Trials are seeded per (length, trial), so every engine sees identical prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from runtime.errors import InputError

from .progress import Advance

FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
QUESTION = "\nWhat is the pass key?"
ANSWER = "The pass key is {key}"


@dataclass(frozen=True)
class PasskeyTrial:
    ids: torch.Tensor  # [T] prompt + answer prefix + digits
    num_digits: int  # the last num_digits tokens are the key's digits
    key: str
    depth: float
    length: int


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _build(tokenizer, key: str, before: int, after: int) -> tuple[list[int], int]:
    needle = f" The pass key is {key}. Remember it. {key} is the pass key."
    body = INTRO + FILLER * before + needle + FILLER * after + QUESTION
    messages = [{"role": "user", "content": body}]
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        prompt = body + "\n"
    answer = _encode(tokenizer, prompt + ANSWER.format(key=key))
    digits = 0  # trailing tokens that are digits (a lone space token before them stays in the prompt)
    while digits < len(answer) and tokenizer.decode([answer[-digits - 1]]).strip().isdigit():
        digits += 1
    if tokenizer.decode(answer[len(answer) - digits :]).strip() != key:
        raise InputError("the tokenizer merges the pass key with its neighbours; passkey scoring needs digit tokens.")
    return answer, digits


def make_trial(tokenizer, length: int, trial: int, seed: int = 0) -> PasskeyTrial:
    """A prompt of about `length` tokens with the key at a random depth."""
    rng = random.Random(seed * 1_000_003 + length * 7919 + trial)
    key = str(rng.randint(10000, 99999))
    depth = rng.random()
    base, _ = _build(tokenizer, key, 0, 0)
    per = len(_encode(tokenizer, FILLER * 8)) / 8
    reps = max(0, round((length - len(base)) / per))
    before = round(reps * depth)
    ids, digits = _build(tokenizer, key, before, reps - before)
    return PasskeyTrial(torch.tensor(ids, dtype=torch.int64), digits, key, depth, len(ids))


def make_trials(tokenizer, lengths: list[int], trials: int, seed: int = 0,
                max_len: int | None = None) -> dict[int, list[PasskeyTrial]]:
    out = {}
    for n in lengths:
        if max_len is not None and n > max_len:
            raise InputError(f"passkey length {n} exceeds the model's {max_len} positions; lower it.")
        out[n] = [make_trial(tokenizer, n, t, seed) for t in range(trials)]
    return out


def passkey(scorer, trials: dict[int, list[PasskeyTrial]], advance: Advance | None = None) -> dict:
    """Exact-match rate and mean digit log-probability per length; all trials scored in one call."""
    flat = [t for ts in trials.values() for t in ts]
    scores = scorer.score([t.ids.tolist() for t in flat], start=[t.length - t.num_digits for t in flat],
                          on_pass=advance)
    found = {id(t): (bool(s.matches(t.ids).all()), float(s.logprobs.mean())) for t, s in zip(flat, scores)}
    per_len = {}
    hits = total = 0
    for n, ts in trials.items():
        res = [found[id(t)] for t in ts]
        k = sum(r[0] for r in res)
        hits, total = hits + k, total + len(res)
        per_len[str(n)] = {
            "tokens_mean": round(sum(t.length for t in ts) / len(ts), 1),
            "trials": len(ts), "found": k, "rate": k / len(ts),
            "mean_logprob": sum(r[1] for r in res) / len(res),
        }
    return {"rate": hits / max(total, 1), "found": hits, "trials": total, "by_length": per_len}
