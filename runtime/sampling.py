"""Sampling parameters and next-token selection over a step's logits.

Greedy (temperature 0, or below GREEDY_TEMPERATURE) is one argmax over the
whole batch, deterministic. Requests with extras (repetition / presence /
frequency penalties, min_tokens, bad words) get their logits adjusted in one
batched pass over only their rows, so a batch without extras runs exactly the
argmax it always did. Sampled rows apply temperature, then top-k, then top-p
(nucleus), and draw from a per-request `torch.Generator` on the CPU, so a
seeded request gives the same tokens whatever else shares its batch and
whichever device runs the model.

Penalties follow vLLM / the OpenAI API: repetition_penalty (HF/CTRL style:
positive logits divided, negative multiplied) over prompt and output tokens;
presence_penalty and frequency_penalty subtracted per output token seen.
Log-probabilities are those of the model's own distribution (log-softmax of
the raw logits, before penalties, temperature and filtering).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .errors import NumericsError, RequestError

# Temperatures below this are greedy: dividing logits by ~1e-40 overflows fp32 to inf/NaN
# (the floor vLLM uses for the same reason).
GREEDY_TEMPERATURE = 1e-5
# Fault injection for tests of per-request failure isolation: a request whose seed equals this
# value fails inside sampling (set by the test that starts the server; unset in production).
FAULT_SEED_ENV = "KVQ_FAULT_INJECT_SEED"

TokenSeqs = tuple[tuple[int, ...], ...]


def _seqs(value) -> TokenSeqs:
    return tuple(tuple(int(t) for t in s) for s in value if len(s))


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 (or < GREEDY_TEMPERATURE) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # EOS and stop ids are masked until this many tokens are generated
    bad_words: TokenSeqs = ()  # token sequences never generated
    stop_sequences: TokenSeqs = ()  # generation stops once the output ends with one of these
    logprobs: bool = False  # record each generated token's log-probability

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "bad_words", _seqs(self.bad_words))
        object.__setattr__(self, "stop_sequences", _seqs(self.stop_sequences))

        def real(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        def integer(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        checks = [
            ("max_tokens", integer(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", real(self.temperature) and self.temperature >= 0,
             f"a finite number >= 0 (0 = greedy; below {GREEDY_TEMPERATURE:g} counts as greedy)"),
            ("top_k", integer(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", real(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("seed", self.seed is None or (integer(self.seed) and 0 <= self.seed < 2**64),
             "an integer in [0, 2**64) or unset"),
            ("repetition_penalty", real(self.repetition_penalty) and self.repetition_penalty > 0,
             "a finite number > 0 (1 = off)"),
            ("presence_penalty", real(self.presence_penalty), "a finite number (0 = off)"),
            ("frequency_penalty", real(self.frequency_penalty), "a finite number (0 = off)"),
            ("min_tokens", integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             f"an integer in [0, max_tokens={self.max_tokens}]"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise RequestError(f"{name} must be {allowed}, got {getattr(self, name)!r}; fix the request field.")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        return bool(
            self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
            or self.min_tokens or self.bad_words
        )

    def make_generator(self) -> torch.Generator:
        g = torch.Generator(device="cpu")
        g.manual_seed(self.seed if self.seed is not None else random.SystemRandom().randrange(2**63))
        return g


class Row(Protocol):
    """What sampling reads of a sequence (runtime.scheduler.Sequence)."""

    sampling: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass
class Pick:
    token: int | None = None
    logprob: float | None = None
    error: Exception | None = None  # this row failed; the others are unaffected


def _fault_seed() -> int | None:
    value = os.environ.get(FAULT_SEED_ENV)
    return int(value) if value else None


def _banned(row: Row, eos_ids: tuple[int, ...]) -> list[int]:
    """Token ids this row may not produce next: min_tokens' end tokens and completed bad words."""
    p = row.sampling
    banned = []
    if len(row.output_ids) < p.min_tokens:
        banned += list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
    if p.bad_words:
        history = row.prompt_ids + row.output_ids
        for word in p.bad_words:
            head = list(word[:-1])
            if not head or history[len(history) - len(head):] == head:
                banned.append(word[-1])
    return banned


def _sparse_update(x: torch.Tensor, rows: list[int], tokens: list[torch.Tensor], fn) -> None:
    """x[row, token] = fn(x[row, token], per-entry row position) for each row's (unique) tokens."""
    if not rows:
        return
    lens = torch.tensor([len(t) for t in tokens])
    r = torch.repeat_interleave(torch.tensor(rows), lens).to(x.device)
    t = torch.cat(tokens).to(x.device)
    pos = torch.repeat_interleave(torch.arange(len(rows)), lens).to(x.device)
    x[r, t] = fn(x[r, t], pos)


def _adjust(x: torch.Tensor, batch_rows: list[int], rows: list[Row], eos_ids: tuple[int, ...]) -> None:
    """Penalties and bans, in place on the logits x [B, vocab] fp32 at `batch_rows` (one per row).

    Only the tokens a row has seen are touched (gathered, changed, scattered back), so the cost
    follows the sequences' lengths, not the vocabulary. vLLM's order: the repetition penalty
    scales the raw logits, then presence and frequency penalties subtract.
    """
    dev = x.device
    rep = [(b, r) for b, r in zip(batch_rows, rows) if r.sampling.repetition_penalty != 1.0]
    rp = torch.tensor([r.sampling.repetition_penalty for _, r in rep], device=dev)
    _sparse_update(
        x, [b for b, _ in rep],
        [torch.tensor(r.prompt_ids + r.output_ids, dtype=torch.int64).unique() for _, r in rep],
        lambda v, i: torch.where(v > 0, v / rp[i], v * rp[i]),
    )
    pf = [(b, r) for b, r in zip(batch_rows, rows)
          if (r.sampling.presence_penalty or r.sampling.frequency_penalty) and r.output_ids]
    seen = [torch.tensor(r.output_ids, dtype=torch.int64).unique(return_counts=True) for _, r in pf]
    counts = torch.cat([c for _, c in seen]).to(dev, torch.float32) if seen else None
    pres = torch.tensor([r.sampling.presence_penalty for _, r in pf], device=dev)
    freq = torch.tensor([r.sampling.frequency_penalty for _, r in pf], device=dev)
    _sparse_update(x, [b for b, _ in pf], [t for t, _ in seen], lambda v, i: v - freq[i] * counts - pres[i])
    bans = [(b, t) for b, r in zip(batch_rows, rows) for t in _banned(r, eos_ids)]
    if bans:
        rows_i, toks = zip(*bans)
        x[torch.tensor(rows_i, device=dev), torch.tensor(toks, device=dev)] = float("-inf")


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


def _select(logits: torch.Tensor, rows: list[Row], eos_ids: tuple[int, ...]) -> list[Pick]:
    """One pick per row; raises if anything fails (the caller then isolates the failing rows)."""
    fault = _fault_seed()
    if fault is not None and any(r.sampling.seed == fault for r in rows):
        raise RuntimeError(f"fault injected into sampling ({FAULT_SEED_ENV}={fault})")
    extra = [i for i, r in enumerate(rows) if r.sampling.adjusts_logits]
    x = logits
    if extra:
        x = logits.clone()  # the raw logits stay for log-probs
        _adjust(x, extra, [rows[i] for i in extra], eos_ids)
    # One host transfer for every row's argmax and whether its logits are usable: argmax lands on a
    # NaN where there is one, so the chosen value alone is non-finite for NaN, +inf, or all tokens banned.
    best = x.argmax(dim=-1)
    head = torch.stack([best, torch.isfinite(x.gather(1, best[:, None])[:, 0]).long()]).tolist()
    picks = []
    for i, r in enumerate(rows):
        p = r.sampling
        if not head[1][i]:
            picks.append(Pick(error=NumericsError(
                "the model produced NaN/Inf logits for this request; its output is unusable. "
                "Check the engine's KV scales and weights (kvq eval).")))
            continue
        token = head[0][i]
        if not p.greedy:
            probs = _filter(x[i].to("cpu", torch.float32), p)
            token = int(torch.multinomial(probs, 1, generator=r.generator).item())
        picks.append(Pick(token))
    wants = [i for i, r in enumerate(rows) if r.sampling.logprobs and picks[i].error is None]
    if wants:
        lp = torch.log_softmax(logits[wants].float(), dim=-1)
        chosen = torch.tensor([picks[i].token for i in wants], device=lp.device)
        for i, v in zip(wants, lp.gather(1, chosen[:, None])[:, 0].tolist()):
            picks[i].logprob = v
    return picks


def select_tokens(logits: torch.Tensor, rows: list[Row], eos_ids: tuple[int, ...] = ()) -> list[Pick]:
    """logits [B, vocab] fp32 -> one Pick per row. A row whose processing raises gets a Pick with
    `error` set and the rows beside it are picked exactly as if it were not there."""
    if not rows:
        return []
    try:
        return _select(logits, rows, eos_ids)
    except Exception:  # noqa: BLE001 - find the failing rows one by one; the batch goes on
        picks = []
        for i, r in enumerate(rows):
            try:
                picks += _select(logits[i : i + 1], [r], eos_ids)
            except Exception as e:  # noqa: BLE001
                picks.append(Pick(error=e))
        return picks


@dataclass
class _Fresh:
    """A row with no history (for `sample`)."""

    sampling: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, vocab] fp32 -> one token id per row, for rows with no history; raises on any failure."""
    picks = _select(logits, [_Fresh(p, g) for p, g in zip(params, generators)], ())
    for pick in picks:
        if pick.error is not None:
            raise pick.error
    return [pick.token for pick in picks]
