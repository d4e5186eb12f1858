"""Triton python model `postprocessing`: token ids -> text_output.

Copied into <repo>/postprocessing/1/model.py. With PREV_LENGTH (torch engines)
each streamed response carries the cumulative ids and the count already shown,
so the text delta is exact even when a character spans several tokens; without
it (TensorRT-LLM, which streams only the new ids) each response is decoded alone.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.tokenizer import load_fast_tokenizer
from triton_repo import protocol


def _ints(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.tokenizer = load_fast_tokenizer(cfg["parameters"]["tokenizer_dir"]["string_value"])
        self.max_batch = cfg.get("max_batch_size", 0) > 0

    def _one(self, request):
        tokens = _ints(request, "TOKENS_BATCH")
        seq_len = _ints(request, "SEQUENCE_LENGTH")
        prev = _ints(request, "PREV_LENGTH")
        final = _ints(request, "IS_FINAL")
        n = int(seq_len.reshape(-1)[0])
        ids = tokens.reshape(-1)[:n].tolist()  # beam 0
        if prev is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        else:
            is_final = True if final is None else bool(final.reshape(-1)[0])
            text = protocol.text_delta(self.tokenizer, ids, int(prev.reshape(-1)[0]), is_final)
        shape = (1, 1) if self.max_batch else (1,)
        out = np.array([text.encode("utf-8")], dtype=object).reshape(shape)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)])

    def execute(self, requests):
        return [self._one(r) for r in requests]
