"""Perplexity on held-out text, with and without quantized KV.

The text is the built-in corpus's evaluation split (never used for
calibration) or a user dataset. It is cut into windows of `window` tokens and
each window is scored as one causal sequence, so late tokens in a window
attend to many (quantized) keys and values.
"""

from __future__ import annotations

import math

import torch

from runtime.errors import InputError

from . import corpus
from .kvsim import DenseScorer

EVAL_SEED = 1234  # fixed: every engine and every run scores the same windows


def eval_windows(tokenizer, num_tokens: int, window: int = 1024, dataset: str = corpus.BUILTIN) -> torch.Tensor:
    """[n, window] token windows, n = ceil(num_tokens / window), from held-out text."""
    if num_tokens < 2:
        raise InputError(f"perplexity needs at least 2 tokens, got {num_tokens}.")
    window = min(window, num_tokens)
    n = -(-num_tokens // window)
    docs = corpus.load_documents(dataset, "evaluation")
    return corpus.token_windows(tokenizer, docs, n, window, EVAL_SEED).ids


def perplexity(scorer: DenseScorer, windows: torch.Tensor) -> dict:
    """exp(mean negative log-likelihood) over all predicted tokens of all windows."""
    nll, count = 0.0, 0
    for row in windows:  # one window at a time bounds the [T, vocab] logits
        lp = scorer.token_logprobs(row).double()
        if not torch.isfinite(lp).all():
            raise InputError("the model produced non-finite log-probabilities; the KV scales are unusable.")
        nll -= float(lp.sum())
        count += lp.numel()
    return {"perplexity": math.exp(nll / count), "nll_per_token": nll / count, "tokens_scored": count,
            "windows": int(windows.shape[0]), "window_len": int(windows.shape[1])}
