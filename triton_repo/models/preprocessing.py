"""Triton python model `preprocessing`: text_input -> input_ids (+ stop words in TensorRT-LLM's layout).

Copied into <repo>/preprocessing/1/model.py. Runs in the Triton stub with the
project's virtual environment (see triton_repo/server.py), so it imports the
shared request protocol instead of duplicating it.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

from runtime.errors import KvqError, RequestError
from triton_repo import protocol


def _strings(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in t.as_numpy().reshape(-1)]


def _flag(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return bool(t.as_numpy().reshape(-1)[0]) if t is not None else False


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        tokenizer_dir = cfg["parameters"]["tokenizer_dir"]["string_value"]
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.max_batch = cfg.get("max_batch_size", 0) > 0

    def _one(self, request):
        protocol.check_no_extra_fields(request.parameters())
        texts = _strings(request, "QUERY")
        if len(texts) != 1:
            raise RequestError(f"send one text_input per request, got {len(texts)}.")
        if not texts[0].strip():
            raise RequestError("text_input is empty; send the prompt text.")
        ids = protocol.encode_prompt(self.tokenizer, texts[0], _flag(request, "APPLY_CHAT_TEMPLATE"))
        stops = protocol.stop_words_tensor(self.tokenizer, _strings(request, "STOP_WORDS") or [])
        lead = (1,) if self.max_batch else ()
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("INPUT_ID", np.array(ids, dtype=np.int32).reshape(lead + (-1,))),
                pb_utils.Tensor(
                    "REQUEST_INPUT_LEN", np.array([len(ids)], dtype=np.int32).reshape(lead + (1,))
                ),
                pb_utils.Tensor("STOP_WORDS_IDS", stops.reshape(lead + stops.shape)),
            ]
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except KvqError as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
        return responses
