"""The engines the evaluate stage measures, and free-running generation through them.

`evaluation_engine` builds a runtime.engine.Engine for one KV format around an
already loaded model: every engine of a model shares its weights, each brings
only its KV format, scales and its own paged pool (sized for the longest
sequence the evaluation scores plus one pass of tokens).

`greedy_continuations` is the baseline's greedy output (unquantized KV), and
`engine_greedy` compares a quantized engine's free-running greedy tokens with
it: being free-running, one early flip changes every later token, so the
budget uses the teacher-forced agreement (accuracy.greedy_agreement) instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from runtime.engine import Engine
from runtime.engine_dir import resolve_scales
from runtime.kv_format import PER_CHANNEL_TOKENS, KVFormat
from runtime.layer_formats import as_layer_formats, scales_to_tensors
from runtime.runner import plan_pool
from runtime.sampling import SamplingParams

BLOCK_SIZE = 16
TOKENS_PER_PASS = 2048  # the engine's default step budget: windows of 1024 score two per pass

_UNQUANTIZED = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def baseline_format(model) -> KVFormat:
    """Unquantized KV in the model's dtype: what every quantized engine is measured against."""
    return KVFormat(_UNQUANTIZED[model.dtype])


def evaluation_engine(model, model_dir: str | Path, fmt: KVFormat | Sequence[KVFormat],
                      k_scale: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
                      v_scale: torch.Tensor | Sequence[torch.Tensor | None] | None = None, longest: int = 1024,
                      batch: int = 8, batch_invariant: bool = True, attention: str = "auto") -> Engine:
    """An engine over `model` with KV format `fmt` (one, or one per layer), its pool holding one pass plus
    the longest sequence. Static scales: tensors [layers(, kv_heads)] for one format, or one entry per layer.
    attention: 'auto' (the Triton kernels on CUDA) or 'reference' (runtime.attention's torch ops).
    batch_invariant: the engine's batch-invariant mode (runtime/batch_invariant.py), so a window's scores
    never depend on what shares its pass, and scoring equals token-by-token decode."""
    formats = as_layer_formats(fmt, model.cfg.num_layers)
    if k_scale is None:
        scales = None
    elif isinstance(k_scale, torch.Tensor):
        scales = {"k_scale": k_scale, "v_scale": v_scale}
    else:
        scales = scales_to_tensors(formats, k_scale, v_scale)
    k, v = resolve_scales(formats, scales, Path(model_dir), model.cfg)
    seq_len = model.cfg.max_position_embeddings
    # per-channel keys scale each channel over one block of their PER_CHANNEL_TOKENS positions
    block_size = PER_CHANNEL_TOKENS if any(f.per_channel_keys for f in formats) else BLOCK_SIZE
    blocks = -(-(TOKENS_PER_PASS + 2 * longest) // block_size)
    plan = plan_pool(model.cfg, formats, block_size, num_blocks=blocks)
    return Engine(model, formats, plan, k, v, max_batch_size=batch, max_seq_len=seq_len,
                  max_tokens_per_step=TOKENS_PER_PASS, attention=attention, batch_invariant=batch_invariant)


def greedy_continuations(engine: Engine, prompts: list[torch.Tensor], num_tokens: int) -> list[torch.Tensor]:
    """Greedy tokens per prompt, stopping at EOS: one batched, KV-cached generation through `engine`.
    The engine's greedy output equals transformers' (tests/test_model_parity.py)."""
    gens = engine.generate([p.tolist() for p in prompts], SamplingParams(max_tokens=num_tokens))
    return [torch.tensor(list(g.token_ids), dtype=torch.int64) for g in gens]


def engine_greedy(engine: Engine, prompts: list[torch.Tensor], baseline: list[torch.Tensor]) -> dict:
    """Free-running greedy generation through a quantized engine vs the baseline's tokens."""
    n = max(c.numel() for c in baseline)
    gens = engine.generate([p.tolist() for p in prompts], SamplingParams(max_tokens=n, ignore_eos=True))
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
