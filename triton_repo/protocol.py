"""What the Triton models and the client agree on, in one place.

Shared by the python-backend models (run inside the Triton stub), the
repository writers and the tests: prompt encoding (so the deployment and a
direct engine call tokenize identically), TensorRT-LLM's stop-word tensor
layout, request limits, and incremental detokenization for streams.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.errors import InputError, RequestError

ENSEMBLE = "ensemble"
PREPROCESSING = "preprocessing"
ENGINE_MODEL = "kvq_engine"
TRTLLM_MODEL = "tensorrt_llm"
POSTPROCESSING = "postprocessing"

# Ensemble request fields: (name, dtype, dims, optional). The step input each feeds is set per engine model.
ENSEMBLE_INPUTS = (
    ("text_input", "STRING", (1,), False),
    ("max_tokens", "INT32", (1,), False),
    ("temperature", "FP32", (1,), True),
    ("top_k", "INT32", (1,), True),
    ("top_p", "FP32", (1,), True),
    ("random_seed", "UINT64", (1,), True),
    ("end_id", "INT32", (1,), True),
    ("stop_words", "STRING", (-1,), True),
    ("stream", "BOOL", (1,), True),
    ("apply_chat_template", "BOOL", (1,), True),
)
ENSEMBLE_FIELDS = tuple(f[0] for f in ENSEMBLE_INPUTS)


def check_no_extra_fields(parameters_json: str) -> None:
    """The HTTP generate endpoint turns JSON keys that are not inputs into request parameters, which
    would be silently ignored; the ensemble has no parameters, so any is an unknown field."""
    extra = sorted(json.loads(parameters_json or "{}"))
    if extra:
        raise RequestError(
            f"unknown request field(s) {extra}; the ensemble takes {', '.join(ENSEMBLE_FIELDS)}."
        )


# ------------------------------------------------------------------ prompts
def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids for `text`; with `chat`, as the single user turn of the tokenizer's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError(
                "apply_chat_template was requested but this model's tokenizer has no chat template; "
                "send plain text."
            )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


# --------------------------------------------------------------- stop words
def stop_words_tensor(tokenizer, words: list[str]) -> np.ndarray:
    """TensorRT-LLM's `stop_words_list` layout: [2, N] int32, row 0 the concatenated ids, row 1 the
    end offset of each word, padded with -1. No words -> [[0], [-1]]."""
    ids: list[int] = []
    offsets: list[int] = []
    for w in words:
        if not w:
            continue
        toks = tokenizer(w, add_special_tokens=False)["input_ids"]
        ids += toks
        offsets.append(len(ids))
    if not ids:
        return np.array([[0], [-1]], dtype=np.int32)
    offsets += [-1] * (len(ids) - len(offsets))
    return np.array([ids, offsets], dtype=np.int32)


def stop_sequences(tensor: np.ndarray | None) -> list[tuple[int, ...]]:
    """Inverse of `stop_words_tensor`."""
    if tensor is None:
        return []
    t = np.asarray(tensor).reshape(2, -1)
    ids, ends = t[0].tolist(), [e for e in t[1].tolist() if e >= 0]
    seqs, start = [], 0
    for end in ends:
        if end > start:
            seqs.append(tuple(ids[start:end]))
        start = end
    return seqs


def ends_with_stop(generated: list[int], stops: list[tuple[int, ...]]) -> bool:
    return any(len(generated) >= len(s) and tuple(generated[-len(s) :]) == s for s in stops)


# ------------------------------------------------------------------ limits
@dataclass(frozen=True)
class EngineLimits:
    max_batch_size: int
    max_input_len: int
    max_seq_len: int

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path) -> EngineLimits:
        path = Path(engine_dir) / "engine.json"
        try:
            d = json.loads(path.read_text())
            return cls(int(d["max_batch_size"]), int(d["max_input_len"]), int(d["max_seq_len"]))
        except FileNotFoundError as e:
            raise InputError(
                f"{path} is missing: {engine_dir} is not a built engine; run `kvq build` first."
            ) from e
        except (KeyError, ValueError, TypeError, json.JSONDecodeError) as e:
            raise InputError(f"{path} is corrupt ({e}); rebuild the engine with `kvq build --force`.") from e

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise RequestError for a request the engine cannot serve."""
        if prompt_len == 0:
            raise RequestError("the prompt is empty; send at least one token of text_input.")
        if prompt_len > self.max_input_len:
            raise RequestError(
                f"the prompt has {prompt_len} tokens, above this engine's max_input_len "
                f"{self.max_input_len}; shorten it."
            )
        if max_tokens <= 0:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}.")
        room = self.max_seq_len - prompt_len
        if max_tokens > room:
            raise RequestError(
                f"max_tokens {max_tokens} + {prompt_len} prompt tokens exceeds this engine's max_seq_len "
                f"{self.max_seq_len}; ask for at most {room} tokens."
            )


# -------------------------------------------------------- detokenization
def _settled_text(tokenizer, ids: list[int], final: bool) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
    # A multi-byte character split across tokens decodes as U+FFFD until its last byte arrives:
    # hold it back unless the stream is over.
    return text if final else text.rstrip("\ufffd")


def text_delta(tokenizer, ids: list[int], prev_len: int, final: bool) -> str:
    """Text that tokens ids[prev_len:] add to what ids[:prev_len] already showed (stateless, so each
    streamed response can be detokenized on its own given the cumulative ids)."""
    shown = _settled_text(tokenizer, ids[:prev_len], final=False)
    now = _settled_text(tokenizer, ids, final)
    if now.startswith(shown):
        return now[len(shown) :]
    common = 0  # tokenizers may rewrite the tail (e.g. space clean-up); resend from the divergence
    while common < min(len(shown), len(now)) and shown[common] == now[common]:
        common += 1
    return now[common:]
