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

@dataclass(frozen=True)
class Field:
    """One request field of the ensemble: its wire type and the step input it feeds.

    `step` is "pre" (preprocessing, upper-case inputs) or "engine" (the engine model, whose inputs
    keep tensorrt_llm's names). `inert` says why a field has no meaning on this engine: it is then
    accepted only absent, empty or at its default (0 / false / ""), and otherwise refused by name.
    """

    name: str
    dtype: str
    dims: tuple[int, ...]
    to: str
    step: str = "engine"
    optional: bool = True
    inert: str = ""


_LORA = "LoRA adapters are not supported by kvq engines"
_PTUNING = "prompt tables (p-tuning) are not supported by kvq engines"
_ENC_DEC = "kvq engines are decoder-only"
_GUIDED = "guided decoding is not supported by kvq engines"
_LOGITS = "kvq engines do not return logits; use return_log_probs"
_MEDIA = "kvq engines are text-only"
_DRAFT = "kvq engines do not run speculative decoding"

# tensorrtllm_backend's `ensemble` request, field for field (tests/data/trtllm_ensemble_contract.json
# holds the upstream list this must match), then kvq's own apply_chat_template.
ENSEMBLE_REQUEST = (
    Field("text_input", "STRING", (1,), "QUERY", "pre", optional=False),
    Field("decoder_text_input", "STRING", (1,), "DECODER_QUERY", "pre", inert=_ENC_DEC),
    Field("max_tokens", "INT32", (1,), "request_output_len", optional=False),
    Field("num_return_sequences", "INT32", (1,), "num_return_sequences"),
    Field("bad_words", "STRING", (-1,), "BAD_WORDS_DICT", "pre"),
    Field("stop_words", "STRING", (-1,), "STOP_WORDS_DICT", "pre"),
    Field("exclude_input_in_output", "BOOL", (1,), "exclude_input_in_output"),
    Field("end_id", "INT32", (1,), "end_id"),
    Field("pad_id", "INT32", (1,), "pad_id"),
    Field("top_k", "INT32", (1,), "runtime_top_k"),
    Field("top_p", "FP32", (1,), "runtime_top_p"),
    Field("temperature", "FP32", (1,), "temperature"),
    Field("length_penalty", "FP32", (1,), "len_penalty"),
    Field("repetition_penalty", "FP32", (1,), "repetition_penalty"),
    Field("min_length", "INT32", (1,), "min_length"),
    Field("presence_penalty", "FP32", (1,), "presence_penalty"),
    Field("frequency_penalty", "FP32", (1,), "frequency_penalty"),
    Field("random_seed", "UINT64", (1,), "random_seed"),
    Field("return_log_probs", "BOOL", (1,), "return_log_probs"),
    Field("return_context_logits", "BOOL", (1,), "return_context_logits", inert=_LOGITS),
    Field("return_generation_logits", "BOOL", (1,), "return_generation_logits", inert=_LOGITS),
    # answered with the kv_cache_* outputs (KV pages reused / allocated); timings go to Triton's /metrics
    Field("return_perf_metrics", "BOOL", (1,), "return_perf_metrics"),
    Field("beam_width", "INT32", (1,), "beam_width"),
    Field("stream", "BOOL", (1,), "streaming"),
    Field("prompt_embedding_table", "FP16", (-1, -1), "prompt_embedding_table", inert=_PTUNING),
    Field("prompt_table_extra_id", "UINT64", (1,), "PROMPT_TABLE_EXTRA_ID", "pre", inert=_PTUNING),
    Field("prompt_vocab_size", "INT32", (1,), "prompt_vocab_size", inert=_PTUNING),
    Field("embedding_bias_words", "STRING", (-1,), "EMBEDDING_BIAS_WORDS", "pre",
          inert="embedding bias is not supported by kvq engines; use bad_words to ban words"),
    Field("embedding_bias_weights", "FP32", (-1,), "EMBEDDING_BIAS_WEIGHTS", "pre",
          inert="embedding bias is not supported by kvq engines; use bad_words to ban words"),
    Field("lora_task_id", "UINT64", (1,), "lora_task_id", inert=_LORA),
    Field("lora_weights", "FP16", (-1, -1), "lora_weights", inert=_LORA),
    Field("lora_config", "INT32", (-1, 3), "lora_config", inert=_LORA),
    Field("guided_decoding_guide_type", "STRING", (1,), "guided_decoding_guide_type", inert=_GUIDED),
    Field("guided_decoding_guide", "STRING", (1,), "guided_decoding_guide", inert=_GUIDED),
    Field("apply_chat_template", "BOOL", (1,), "APPLY_CHAT_TEMPLATE", "pre"),
)
# tensorrt_llm_bls takes the ensemble's fields plus these (multimodal and draft-model inputs).
BLS_EXTRA = (
    Field("image_input", "FP16", (-1, 3, -1, -1), "image_input", inert=_MEDIA),
    Field("image_bytes_input", "UINT8", (-1, -1, -1, -1), "image_bytes_input", inert=_MEDIA),
    Field("image_url_input", "STRING", (1,), "image_url_input", inert=_MEDIA),
    Field("video_bytes_input", "UINT8", (-1, -1, -1, -1), "video_bytes_input", inert=_MEDIA),
    Field("num_draft_tokens", "INT32", (1,), "num_draft_tokens", inert=_DRAFT),
    Field("use_draft_logits", "BOOL", (1,), "use_draft_logits", inert=_DRAFT),
)
BLS = "tensorrt_llm_bls"
# Engine-model outputs the ensemble passes through under the same names (tensorrt_llm's).
ENSEMBLE_OUTPUTS = (
    ("cum_log_probs", "FP32", (-1,)),
    ("output_log_probs", "FP32", (-1, -1)),
    ("context_logits", "FP32", (-1, -1)),
    ("generation_logits", "FP32", (-1, -1, -1)),
    ("batch_index", "INT32", (1,)),
    ("sequence_index", "INT32", (1,)),
    ("kv_cache_alloc_new_blocks", "INT32", (1,)),
    ("kv_cache_reused_blocks", "INT32", (1,)),
    ("kv_cache_alloc_total_blocks", "INT32", (1,)),
    ("arrival_time_ns", "INT64", (1,)),
    ("first_scheduled_time_ns", "INT64", (1,)),
    ("first_token_time_ns", "INT64", (1,)),
    ("last_token_time_ns", "INT64", (1,)),
    ("acceptance_rate", "FP32", (1,)),
    ("total_accepted_draft_tokens", "INT32", (1,)),
    ("total_draft_tokens", "INT32", (1,)),
)
ENSEMBLE_FIELDS = tuple(f.name for f in ENSEMBLE_REQUEST)
# Request fields whose SamplingParams name differs (validation messages use the request's name).
SAMPLING_NAMES = {"seed": "random_seed", "min_tokens": "min_length"}


def is_default(values: np.ndarray) -> bool:
    """Absent-equivalent: no elements, or only zeros / false / empty strings."""
    flat = np.asarray(values).reshape(-1)
    if flat.dtype == object or flat.dtype.kind in "SU":
        return all(len(v) == 0 for v in flat)
    return not np.any(flat)


def refuse_inert(field: Field) -> RequestError:
    return RequestError(
        f"{field.name} is not supported here ({field.inert}); leave it out or send it empty/default."
    )


def check_no_extra_fields(parameters_json: str, fields: tuple[str, ...] = ENSEMBLE_FIELDS) -> None:
    """The HTTP generate endpoint turns JSON keys that are not inputs into request parameters, which
    would be silently ignored; the ensemble has no parameters, so any is an unknown field."""
    extra = sorted(json.loads(parameters_json or "{}"))
    if extra:
        raise RequestError(f"unknown request field(s) {extra}; the ensemble takes {', '.join(fields)}.")


def decode_text(raw, field: str) -> str:
    """A STRING tensor element as text; bytes that are not UTF-8 are the client's error, named."""
    if not isinstance(raw, bytes):
        return str(raw)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(
            f"{field} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); send UTF-8 text."
        ) from None


def longest_token_bytes(tokenizer) -> int:
    """Bytes of the longest vocabulary entry: no text of N tokens is longer than N times this."""
    return max(len(tokenizer.convert_tokens_to_string([t]).encode("utf-8")) for t in tokenizer.get_vocab())


def check_prompt_bytes(num_bytes: int, max_input_len: int, token_bytes: int) -> None:
    """Refuse, before tokenizing, a prompt too long in bytes to fit max_input_len tokens."""
    limit = max_input_len * token_bytes
    if num_bytes > limit:
        raise RequestError(
            f"text_input has {num_bytes} bytes; this engine takes at most max_input_len={max_input_len} "
            f"tokens, which no text over {limit} bytes fits in; shorten the prompt."
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
    """TensorRT-LLM's `stop_words_list` / `bad_words_list` layout: [2, N] int32, row 0 the concatenated ids, row 1 the
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
            raise RequestError("text_input is empty; send at least one token of text.")
        if prompt_len > self.max_input_len:
            raise RequestError(
                f"text_input has {prompt_len} tokens; this engine takes 1 to max_input_len="
                f"{self.max_input_len}; shorten it."
            )
        room = self.max_seq_len - prompt_len
        if not 1 <= max_tokens <= room:
            raise RequestError(
                f"max_tokens must be in [1, {room}] for this {prompt_len}-token prompt "
                f"(max_seq_len {self.max_seq_len}), got {max_tokens}."
            )


# -------------------------------------------------------- detokenization
def _settled_text(tokenizer, ids: list[int], final: bool) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
    # A multi-byte character split across tokens decodes as U+FFFD until its last byte arrives:
    # hold it back unless the stream is over.
    return text if final else text.rstrip("\ufffd")


DELTA_CONTEXT = 8  # tokens decoded before the new ones: enough for any character split across tokens


def text_delta(tokenizer, ids: list[int], prev_len: int, final: bool) -> str:
    """Text that tokens ids[prev_len:] add to what ids[:prev_len] already showed (stateless, so each
    streamed response can be detokenized on its own given the cumulative ids).

    Only a window is decoded: the new tokens and DELTA_CONTEXT before them (moved back while it would start
    inside a character), both decodes from the same token, so whatever a decode does to its first token
    cancels. A stream of n tokens then costs O(n) decoding instead of O(n^2)."""
    start = max(0, prev_len - DELTA_CONTEXT)
    shown = _settled_text(tokenizer, ids[start:prev_len], final=False)
    while start > 0 and (not shown or shown.startswith("\ufffd")) and prev_len - start < 4 * DELTA_CONTEXT:
        start -= 1
        shown = _settled_text(tokenizer, ids[start:prev_len], final=False)
    now = _settled_text(tokenizer, ids[start:], final)
    if now.startswith(shown):
        return now[len(shown) :]
    common = 0  # tokenizers may rewrite the tail (e.g. space clean-up); resend from the divergence
    while common < min(len(shown), len(now)) and shown[common] == now[common]:
        common += 1
    return now[common:]
