"""An engine's tokenizer, loaded from its tokenizer.json without transformers' AutoTokenizer.

AutoTokenizer resolves the tokenizer class through transformers' model registry, which imports
`transformers.generation`; on some images that imports sklearn and scipy. Where the Triton python
backend runs (its stub needs numpy < 2, carried first on the path) an image's scipy built for numpy 2
then fails to import, and the serving models could not start. PreTrainedTokenizerFast reads the same
tokenizer.json that AutoTokenizer would wrap (special tokens from tokenizer_config.json, the chat
template from chat_template.jinja or tokenizer_config.json) and imports none of that, so everything that
serves (preprocessing, postprocessing, the OpenAI frontend, the engine itself) loads tokenizers here.
"""

from __future__ import annotations

from pathlib import Path

from .errors import InputError

TOKENIZER_JSON = "tokenizer.json"


def load_fast_tokenizer(d: str | Path):
    """The fast tokenizer of directory `d` (a converted model or engine directory)."""
    d = Path(d)
    if not (d / TOKENIZER_JSON).is_file():
        raise InputError(f"{d} has no {TOKENIZER_JSON}; serving loads the fast tokenizer from it. Re-run the "
                         "convert stage (kvq convert writes it), or save the tokenizer with transformers' "
                         "save_pretrained into that directory.")
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        raise InputError(f"loading the tokenizer of {d} needs transformers ({e}); install transformers.") from None
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - tokenizer loading raises many types; all mean the same here
        raise InputError(f"{d}: the tokenizer files cannot be loaded ({type(e).__name__}: {e}); "
                         "re-run the convert stage.") from None
