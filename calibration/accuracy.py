"""Greedy-token agreement and per-layer attention-output error vs unquantized KV.

Every metric scores through the engine (`Engine.score`); `DenseScorer` (kvsim.py)
offers the same `score` method, so tests run the same metric on the dense
simulation as a cross-check.

Greedy agreement is teacher-forced: the baseline (unquantized KV) generates N
tokens greedily from each prompt; a quantized engine then reads prompt +
baseline continuation in one pass, and we count the positions where its argmax
equals the baseline's token. Unlike comparing two free-running generations,
one early flip does not zero the rest of the sequence, so the number measures
how often quantized KV changes the next-token decision.

Top-1 agreement is the same question asked at every scored position of the
perplexity text (thousands of positions instead of prompts x tokens, from the
scoring pass itself): the fraction of positions where the quantized engine's
most likely next token is the baseline's, with its Wilson 95% interval. The
text is not the model's own continuation, so positions where the baseline
itself is unsure (near-ties of its top two tokens) weigh more than in greedy
agreement, where the baseline chose every token.

Attention error isolates each layer: the layer gets the baseline's input
hidden states, its queries attend once to the exact K/V and once to the K/V
the engine stored in its pool (read back by its decode op), and we report
||attn_q - attn|| / ||attn|| of its attention output (before o_proj).
"""

from __future__ import annotations

import math

import torch

from .kvsim import KVRoundTrip
from .progress import Advance

PROMPTS = (
    "What is the capital of France?",
    "Explain in a few sentences what a hash table is.",
    "Write a short poem about the sea.",
    "Give three tips for staying focused while studying.",
    "Why is the sky blue?",
    "Describe how a bicycle works.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of a typical detective story.",
)


def chat_prompt_ids(tokenizer, text: str) -> torch.Tensor:
    messages = [{"role": "user", "content": text}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)


def greedy_agreement(scorer, prompts: list[torch.Tensor], continuations: list[torch.Tensor],
                     advance: Advance | None = None) -> dict:
    """Teacher-forced agreement with the baseline's tokens; scorer: an Engine or a kvsim.DenseScorer."""
    seqs = [torch.cat((p, c)) for p, c in zip(prompts, continuations)]
    scores = scorer.score([s.tolist() for s in seqs], start=[p.numel() for p in prompts], on_pass=advance)
    match = total = 0
    first_div = []
    for s, sc, c in zip(seqs, scores, continuations):
        same = sc.matches(s)
        match += int(same.sum())
        total += c.numel()
        first_div.append(int(c.numel() if bool(same.all()) else int((~same).nonzero()[0])))
    return {"agreement": match / max(total, 1), "tokens": total, "first_divergence": first_div}


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k / n (95% at z = 1.96); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def top1_agreement(baseline_top1: torch.Tensor, top1: torch.Tensor) -> dict:
    """Positions where `top1` (an engine's most likely tokens, perplexity.scored_perplexity) equals the
    baseline's on the same positions, with the Wilson 95% interval of the rate."""
    if baseline_top1.shape != top1.shape:
        raise ValueError(f"top-1 tokens of {top1.numel()} positions against a baseline of {baseline_top1.numel()}")
    n, k = int(top1.numel()), int((top1 == baseline_top1).sum())
    lo, hi = wilson_interval(k, n)
    return {"agreement": k / max(n, 1), "positions": n, "ci95": [lo, hi]}


class _AttentionRecorder:
    """Observer that records each layer's attention output (optionally round-tripping K/V)."""

    def __init__(self, kv: KVRoundTrip | None = None):
        self.kv = kv
        self.out: dict[int, torch.Tensor] = {}

    def __call__(self, layer, k, v):
        return None if self.kv is None else self.kv(layer, k, v)

    def observe_attention(self, layer: int, attn: torch.Tensor) -> None:
        self.out[layer] = attn.detach().clone()


@torch.inference_mode()
def baseline_layer_inputs(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """Hidden state entering every layer, and every layer's attention output, unquantized KV."""
    rec = _AttentionRecorder()
    h, inputs = model.embed(ids), []
    for i in range(model.cfg.num_layers):
        inputs.append(h)
        h = model.layer_dense(i, h, observer=rec)
    return inputs, rec.out


def _error_summary(errs: list[float]) -> dict:
    return {"per_layer": [round(e, 6) for e in errs], "max": max(errs), "mean": sum(errs) / len(errs),
            "worst_layer": int(torch.tensor(errs).argmax())}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


@torch.inference_mode()
def attention_error(model, kv: KVRoundTrip, inputs: list[torch.Tensor], reference: dict[int, torch.Tensor]) -> dict:
    """The dense simulation's per-layer error (kvsim cross-check)."""
    rec = _AttentionRecorder(kv)
    errs = []
    for i, h in enumerate(inputs):
        model.layer_dense(i, h, observer=rec)
        errs.append(_rel(rec.out[i], reference[i]))
    return _error_summary(errs)


def engine_attention_error(engine, inputs: list[torch.Tensor]) -> dict:
    """Per-layer error of the engine's attention: each layer's queries attend to K/V written into the
    engine's pool and read back by its decode op (runtime.scoring.attention_through_cache), against the
    exact attention over the same unquantized K/V."""
    from runtime.scoring import attention_through_cache

    return _error_summary([_rel(*attention_through_cache(engine, i, h)) for i, h in enumerate(inputs)])
