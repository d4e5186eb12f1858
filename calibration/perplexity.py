"""Perplexity on held-out text, with and without quantized KV.

The text is the built-in corpus's evaluation split (never used for
calibration) or the user's evaluation data. It is cut into windows of `window`
tokens and each window is scored as one causal sequence, so late tokens in a
window attend to many (quantized) keys and values. The scorer is the engine
(`Engine.score`); the dense simulation (kvsim.DenseScorer) has the same method.
"""

from __future__ import annotations

import math

import torch

from runtime.errors import InputError

from . import corpus
from .progress import Advance

EVAL_SEED = 1234  # fixed: every engine and every run scores the same windows


def eval_windows(tokenizer, num_tokens: int, window: int = 1024, dataset: str = corpus.BUILTIN,
                 field: str = "accuracy.eval_data (kvq eval --eval-data)") -> torch.Tensor:
    """[n, window] token windows, n = ceil(num_tokens / window), from held-out text."""
    if num_tokens < 2:
        raise InputError(f"perplexity needs at least 2 tokens, got {num_tokens}.")
    window = min(window, num_tokens)
    n = -(-num_tokens // window)
    docs = corpus.load_documents(dataset, "evaluation", field=field)
    return corpus.token_windows(tokenizer, docs, n, window, EVAL_SEED, field=field).ids


def scored_perplexity(scorer, windows: torch.Tensor, advance: Advance | None = None) -> tuple[dict, torch.Tensor]:
    """perplexity's result and the scorer's most likely token at every scored position, windows in order
    ([n * (window - 1)] int64): the scoring pass gives both, so top-1 agreement over the perplexity text
    (accuracy.top1_agreement) costs no extra forward."""
    scores = scorer.score([row.tolist() for row in windows], start=1, on_pass=advance)
    lp = torch.cat([s.logprobs for s in scores]).double()
    if not torch.isfinite(lp).all():
        raise InputError("the model produced non-finite log-probabilities; the KV scales are unusable.")
    nll, count = -float(lp.sum()), lp.numel()
    return ({"perplexity": math.exp(nll / count), "nll_per_token": nll / count, "tokens_scored": count,
             "windows": int(windows.shape[0]), "window_len": int(windows.shape[1])},
            torch.cat([s.argmax for s in scores]))


def perplexity(scorer, windows: torch.Tensor, advance: Advance | None = None) -> dict:
    """exp(mean negative log-likelihood) over all predicted tokens of all windows."""
    return scored_perplexity(scorer, windows, advance)[0]
