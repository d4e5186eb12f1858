"""Sampling parameters and next-token selection over a step's logits.

Greedy (temperature 0) is one argmax over the whole batch, deterministic.
Sampled rows apply temperature, then top-k, then top-p (nucleus), and draw
from a per-request `torch.Generator` on the CPU, so a seeded request gives the
same tokens whatever else shares its batch and whichever device runs the model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer or None, got {self.seed!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise RequestError(msg + "; fix the request field.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator:
        g = torch.Generator(device="cpu")
        g.manual_seed(self.seed if self.seed is not None else random.SystemRandom().randrange(2**63))
        return g


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p on one row of fp32 logits -> probabilities."""
    x = logits / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Drop a token once the mass before it already reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, vocab] fp32 -> one token id per row."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            probs = _filter(logits[row].to("cpu", torch.float32), p)
            tokens[row] = int(torch.multinomial(probs, 1, generator=g).item())
    return tokens
