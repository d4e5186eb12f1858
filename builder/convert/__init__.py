"""Source converters: HF directory, GGUF, builtin SmolLM2, synthetic presets.

`convert_source` is the `convert` stage's library call: it fills a directory
it is given (the pipeline's temporary stage directory, or `atomic_dir`'s for
the standalone command) and returns the facts for the manifest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.config import ModelConfig
from runtime.errors import InputError

from .builtin import BUILTIN_MODELS, builtin_gguf_path
from .gguf_source import GGUFSource
from .hf import HFCheckpoint
from .output import write_model_dir
from .synthetic import write_synthetic
from .tokenizer import copy_hf_tokenizer, save_gguf_tokenizer

SOURCE_KINDS = ("hf", "gguf", *BUILTIN_MODELS, "synthetic:<preset>")


def convert_source(source: str, path: str | Path | None, out_dir: str | Path, dtype: str,
                   seed: int = 0, check: Callable[[ModelConfig, str], None] | None = None) -> dict[str, Any]:
    """Convert `source` into the (existing, empty) `out_dir`; returns manifest outputs.

    source: "hf" (path = HF directory), "gguf" (path = .gguf file), a builtin
    name ("smollm2-135m"), or "synthetic:<preset>" (no weights; `seed` recorded).
    `check(config, where)` sees the weights' geometry before anything is written
    (the pipeline compares it with the recipe's).
    """
    check = check or (lambda cfg, where: None)
    out = Path(out_dir)
    if source.startswith("synthetic:"):
        facts = write_synthetic(source.split(":", 1)[1], out, dtype, seed)
        return {"source": source, "path": None, **facts}
    if source in BUILTIN_MODELS or source == "gguf":
        if source == "gguf" and path is None:
            raise InputError("source 'gguf' needs --path pointing to a .gguf file.")
        gguf_path = builtin_gguf_path(source) if source in BUILTIN_MODELS else Path(path)
        src = GGUFSource(gguf_path)
        check(src.cfg, str(gguf_path))
        facts = write_model_dir(src.cfg, src.shapes, src.load, src.origin, out, dtype)
        files = save_gguf_tokenizer(gguf_path, out)
        return {"source": source, "path": str(gguf_path), "tokenizer_files": files, **facts}
    if source == "hf":
        if path is None:
            raise InputError("source 'hf' needs --path pointing to a Hugging Face model directory.")
        check(ModelConfig.from_dir(path), str(Path(path) / "config.json"))
        ckpt = HFCheckpoint(path)
        shapes = ckpt.check_llama()
        # Tokenizer first: it is cheap and a missing one should fail before GBs are written.
        files = copy_hf_tokenizer(ckpt.dir, out)
        facts = write_model_dir(ckpt.cfg, shapes, ckpt.load, ckpt.origin, out, dtype)
        return {"source": source, "path": str(ckpt.dir), "tokenizer_files": files, **facts}
    raise InputError(f"unknown source {source!r}; choose one of {', '.join(SOURCE_KINDS)}.")
