"""Cost of the sampling extras on one engine step's token pick, beside a plain argmax.

    python -m benchmarks.sampling_cost [--batch 8] [--vocab 49152] [--device cpu|cuda]

Times `select_tokens` over [batch, vocab] fp32 logits for: every row greedy without extras
(the path that must stay a plain argmax), every row with repetition/presence/frequency
penalties, min_tokens and a bad word, and every row also returning log-probs. Each row has a
64-token prompt and 32 generated tokens. Prints median microseconds per step.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from runtime.sampling import SamplingParams, select_tokens


class Row:
    def __init__(self, sp, vocab, i):
        self.sampling, self.generator = sp, None
        self.prompt_ids = [(i * 7 + j * 13) % vocab for j in range(64)]
        self.output_ids = [(i * 11 + j * 17) % vocab for j in range(32)]


def _median_us(fn, device, repeats=50) -> float:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(1)  # a shared machine: one thread gives comparable medians
    logits = torch.randn(a.batch, a.vocab, device=a.device)
    extras = dict(max_tokens=64, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3, min_tokens=40,
                  bad_words=((5, 6), (9,)))
    cases = {
        "argmax (reference)": lambda: logits.argmax(-1).tolist(),
        "greedy, no extras": [SamplingParams(max_tokens=64)] * a.batch,
        "greedy + penalties/min_tokens/bad_words": [SamplingParams(**extras)] * a.batch,
        "  ... + log-probs": [SamplingParams(**extras, logprobs=True)] * a.batch,
    }
    for name, case in cases.items():
        if callable(case):
            fn = case
        else:
            rows = [Row(sp, a.vocab, i) for i, sp in enumerate(case)]
            fn = functools.partial(select_tokens, logits, rows, (2,))
        fn()
        print(f"{name:42s} {_median_us(fn, a.device):9.1f} us/step  (batch {a.batch}, vocab {a.vocab}, {a.device})")


if __name__ == "__main__":
    main()
