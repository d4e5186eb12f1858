"""Put the tokenizer a served model needs into the converted directory.

HF sources: the tokenizer files are copied byte for byte (they are the model
author's, chat template included) and then loaded once with transformers to
prove they work. GGUF sources: transformers builds the tokenizer from the GGUF
metadata and `save_pretrained` writes it, chat template included.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from runtime.errors import InputError
from runtime.tokenizer import TOKENIZER_JSON, load_fast_tokenizer

# Files transformers reads for a tokenizer, plus generation defaults.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def _verify(out: Path, source: str) -> None:
    """Load the files as transformers' AutoTokenizer does; write tokenizer.json when the source had only
    slow-tokenizer files, since serving loads the fast tokenizer from it alone (runtime/tokenizer.py),
    and prove that it loads there."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(out))
    except Exception as e:  # noqa: BLE001 -- transformers raises many types for a broken tokenizer
        raise InputError(f"{source}: the tokenizer files do not load ({type(e).__name__}: {e}); "
                         "re-download the model's tokenizer files.") from None
    if not (out / TOKENIZER_JSON).is_file():
        if not getattr(tok, "is_fast", False):
            raise InputError(f"{source}: transformers builds no fast tokenizer from these files, and serving "
                             f"needs one ({TOKENIZER_JSON}); install `tokenizers`/`sentencepiece` or add the "
                             "model's tokenizer.json.")
        tok.backend_tokenizer.save(str(out / TOKENIZER_JSON))
    load_fast_tokenizer(out)


def copy_hf_tokenizer(src: Path, out: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
            copied.append(name)
    if not {"tokenizer.json", "tokenizer.model", "vocab.json"} & set(copied):
        raise InputError(f"{src} has no tokenizer (tokenizer.json / tokenizer.model); a served model needs "
                         "one: copy the tokenizer files from the model's original repository.")
    _verify(out, str(src))
    return sorted(set(copied) | {TOKENIZER_JSON})


def save_gguf_tokenizer(gguf_path: Path, out: Path) -> list[str]:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # noqa: BLE001 -- as in _verify
        raise InputError(f"{gguf_path}: no usable tokenizer in the GGUF metadata ({type(e).__name__}: {e}).") from None
    before = {p.name for p in out.iterdir()}
    tok.save_pretrained(str(out))
    load_fast_tokenizer(out)  # what serving loads
    return sorted({p.name for p in out.iterdir()} - before)
