"""Greedy generation through the real paged engine, with the engine's quantized KV.

The other metrics score on the dense round-trip path (kvsim.py). This check
runs runtime.engine.Engine itself -- quantize-on-write into the paged cache,
decode attention reading quantized pages -- and compares its free-running
greedy tokens with the baseline's (dense, unquantized KV) continuation. It
cross-checks the dense path against the engine and shows the real path's
behaviour; being free-running, one early flip changes every later token, so
the budget uses the teacher-forced agreement instead.
"""

from __future__ import annotations

from pathlib import Path

import torch


def engine_greedy(model_dir: str | Path, fmt, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                  prompts: list[torch.Tensor], baseline: list[torch.Tensor], device: str = "cpu",
                  dtype: str | None = None) -> dict:
    from runtime.engine import Engine
    from runtime.sampling import SamplingParams

    scales = None if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    engine = Engine.from_dir(model_dir, device=device, dtype=dtype, kv_format=fmt, kv_scales=scales,
                             max_batch_size=len(prompts))
    try:
        n = max(c.numel() for c in baseline)
        gens = engine.generate([p.tolist() for p in prompts], SamplingParams(max_tokens=n, ignore_eos=True))
    finally:
        engine.shutdown()
    same = total = identical = 0
    first_div = []
    for g, c in zip(gens, baseline):
        got = torch.tensor(list(g.token_ids)[: c.numel()], dtype=torch.int64)
        eq = got == c[: got.numel()]
        same += int(eq.sum())
        total += c.numel()
        mismatch = (~eq).nonzero()
        div = int(mismatch[0]) if mismatch.numel() else got.numel()  # got is shorter if the engine stopped early
        first_div.append(div)
        identical += div == c.numel()
    return {"path": "runtime.engine (paged, quantized KV)", "position_match": same / max(total, 1),
            "identical_prompts": identical, "prompts": len(prompts), "first_divergence": first_div}
