"""Greedy-token agreement and per-layer attention-output error vs unquantized KV.

Greedy agreement is teacher-forced: the baseline (unquantized KV) generates N
tokens greedily from each prompt; a quantized engine then reads prompt +
baseline continuation in one pass, and we count the positions where its argmax
equals the baseline's token. Unlike comparing two free-running generations,
one early flip does not zero the rest of the sequence, so the number measures
how often quantized KV changes the next-token decision.

Attention error isolates each layer: the layer gets the baseline's input
hidden states, runs once with exact and once with round-tripped K/V, and we
report ||attn_q - attn|| / ||attn|| of its attention output (before o_proj).
"""

from __future__ import annotations

import torch

from .kvsim import DenseScorer, KVRoundTrip

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


@torch.inference_mode()
def greedy_continuations(baseline: DenseScorer, prompts: list[torch.Tensor], num_tokens: int,
                         eos_token_id: int | None) -> list[torch.Tensor]:
    """Baseline greedy tokens per prompt (stops after EOS); dense forward per step."""
    out = []
    for p in prompts:
        ids, gen = p.clone(), []
        for _ in range(num_tokens):
            nxt = int(baseline.logits(ids, last=1)[-1].argmax())
            gen.append(nxt)
            ids = torch.cat((ids, torch.tensor([nxt])))
            if nxt == eos_token_id:
                break
        out.append(torch.tensor(gen, dtype=torch.int64))
    return out


@torch.inference_mode()
def greedy_agreement(scorer: DenseScorer, prompts: list[torch.Tensor], continuations: list[torch.Tensor]) -> dict:
    match = total = 0
    first_div = []
    for p, c in zip(prompts, continuations):
        n = c.numel()
        pred = scorer.logits(torch.cat((p, c)), last=n + 1)[:-1].argmax(-1).cpu()
        same = pred == c
        match += int(same.sum())
        total += n
        first_div.append(int(n if bool(same.all()) else int((~same).nonzero()[0])))
    return {"agreement": match / max(total, 1), "tokens": total, "first_divergence": first_div}


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


@torch.inference_mode()
def attention_error(model, kv: KVRoundTrip, inputs: list[torch.Tensor], reference: dict[int, torch.Tensor]) -> dict:
    rec = _AttentionRecorder(kv)
    errs = []
    for i, h in enumerate(inputs):
        model.layer_dense(i, h, observer=rec)
        ref = reference[i]
        errs.append(float((rec.out[i] - ref).norm() / ref.norm().clamp_min(1e-30)))
    return {"per_layer": [round(e, 6) for e in errs], "max": max(errs), "mean": sum(errs) / len(errs),
            "worst_layer": int(torch.tensor(errs).argmax())}
