"""Side-by-side timing for the probes: each shape's and format's default decode launch timed as the benchmarks time
it (`gpu_timing.median_ms`: CUDA graph, L2 emptied) under each of a few settings, alternated."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kernels as kb  # noqa: E402
from gpu_timing import median_ms  # noqa: E402

from runtime.kernels import decode_attention_launch, write_kv_launch  # noqa: E402


def time_settings(shapes: list[tuple[str, int, int]], formats: list[str], settings: dict[str, Callable[[], None]],
                  rounds: int = 2) -> dict[str, dict[str, float]]:
    """{"model BxC format": {"setting.round": ms}} for (model, batch, context) shapes and `kernels.FORMATS` names;
    settings: name -> a function that applies it (the caller restores the shipped state afterwards). Prints each row."""
    res = {}
    for model, batch, ctx in shapes:
        case = kb.Case(model, batch, ctx)
        for name in formats:
            cache = case.cache(kb.FORMATS[name])
            write_kv_launch(cache, case.k, case.v, case.slots)
            fn = partial(decode_attention_launch, case.q, cache, case.block_tables, case.seq_lens, case.sm_scale)
            row = {}
            for r in range(rounds):
                for setting, apply in settings.items():
                    apply()
                    row[f"{setting}.{r}"] = median_ms(fn)
            res[f"{model} {batch}x{ctx} {name}"] = row
            print(model, f"{batch}x{ctx}", name, {k: round(v, 4) for k, v in row.items()}, flush=True)
            del cache
            torch.cuda.empty_cache()
        del case
    return res
