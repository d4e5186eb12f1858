"""Triton python model `preprocessing`: text_input -> input_ids (+ stop and bad words in TensorRT-LLM's layout).

Copied into <repo>/preprocessing/1/model.py. Runs in the Triton stub with the
project's virtual environment (see triton_repo/server.py), so it imports the
shared request protocol instead of duplicating it. A prompt is measured in
bytes before it is tokenized: one far beyond max_input_len is refused at once
instead of occupying this (single) instance while it is tokenized in full.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.errors import KvqError, RequestError
from runtime.tokenizer import load_fast_tokenizer
from triton_repo import protocol

FIELDS = {f.to: f for f in protocol.ENSEMBLE_REQUEST if f.step == "pre"}


def _raw(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy().reshape(-1)


def _strings(request, name):
    raw = _raw(request, name)
    return None if raw is None else [protocol.decode_text(x, FIELDS[name].name) for x in raw]


def error_response(e):
    code = pb_utils.TritonError.INVALID_ARG if isinstance(e, RequestError) else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), code))


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.tokenizer = load_fast_tokenizer(params["tokenizer_dir"])
        self.max_batch = cfg.get("max_batch_size", 0) > 0
        self.max_input_len = int(params["max_input_len"]) if "max_input_len" in params else None
        self.token_bytes = protocol.longest_token_bytes(self.tokenizer) if self.max_input_len else None

    def _one(self, request):
        protocol.check_no_extra_fields(request.parameters())
        for name, f in FIELDS.items():
            if f.inert:
                raw = _raw(request, name)
                if raw is not None and not protocol.is_default(raw):
                    raise protocol.refuse_inert(f)
        query = _raw(request, "QUERY")
        if len(query) != 1:
            raise RequestError(f"send one text_input per request, got {len(query)}.")
        if self.max_input_len is not None and isinstance(query[0], bytes):
            protocol.check_prompt_bytes(len(query[0]), self.max_input_len, self.token_bytes)
        text = protocol.decode_text(query[0], "text_input")
        if not text.strip():
            raise RequestError("text_input is empty; send the prompt text.")
        chat = _raw(request, "APPLY_CHAT_TEMPLATE")
        ids = protocol.encode_prompt(self.tokenizer, text, bool(chat[0]) if chat is not None else False)
        stops = protocol.stop_words_tensor(self.tokenizer, _strings(request, "STOP_WORDS_DICT") or [])
        bans = protocol.stop_words_tensor(self.tokenizer, _strings(request, "BAD_WORDS_DICT") or [])
        lead = (1,) if self.max_batch else ()
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("INPUT_ID", np.array(ids, dtype=np.int32).reshape(lead + (-1,))),
                pb_utils.Tensor(
                    "REQUEST_INPUT_LEN", np.array([len(ids)], dtype=np.int32).reshape(lead + (1,))
                ),
                pb_utils.Tensor("STOP_WORDS_IDS", stops.reshape(lead + stops.shape)),
                pb_utils.Tensor("BAD_WORDS_IDS", bans.reshape(lead + bans.shape)),
            ]
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except KvqError as e:
                responses.append(error_response(e))
        return responses
