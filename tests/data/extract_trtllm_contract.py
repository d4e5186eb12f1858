"""Extract the request/response contract of tensorrtllm_backend's Triton models into JSON.

    python tests/data/extract_trtllm_contract.py GIT_DIR COMMIT > tests/data/trtllm_ensemble_contract.json

GIT_DIR is a clone of github.com/triton-inference-server/tensorrtllm_backend; COMMIT the
revision to read (all_models/ moved into TensorRT-LLM after v0.19.0). The templates'
`${...}` placeholders are filled with neutral values only so that Triton's own ModelConfig
parser can read them; only names, data types, dims and optionality are recorded.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

MODELS = ("ensemble", "tensorrt_llm_bls", "tensorrt_llm", "preprocessing", "postprocessing")
PLACEHOLDER_VALUES = {"logits_datatype": "TYPE_FP32", "triton_max_batch_size": "64", "decoupled_mode": "true"}


def _tensors(tensors, is_input: bool) -> list[dict]:
    seen, out = set(), []
    for t in tensors:
        if t.name in seen:  # upstream's ensemble lists kv_cache_alloc_total_blocks twice
            continue
        seen.add(t.name)
        row = {"name": t.name, "data_type": mc.DataType.Name(t.data_type), "dims": list(t.dims)}
        if is_input:
            row["optional"] = t.optional
        out.append(row)
    return out


def main(git_dir: str, commit: str) -> None:
    full = subprocess.check_output(["git", "-C", git_dir, "rev-parse", f"{commit}^{{commit}}"], text=True).strip()
    models = {}
    for name in MODELS:
        text = subprocess.check_output(
            ["git", "-C", git_dir, "show", f"{full}:all_models/inflight_batcher_llm/{name}/config.pbtxt"], text=True
        )
        # Quoted placeholders are strings; the unquoted ones left are counts or flags.
        text = re.sub(r'"\$\{\w+\}"', '"x"', text)
        text = re.sub(r"\$\{(\w+)\}", lambda m: PLACEHOLDER_VALUES.get(m.group(1), "1"), text)
        cfg = text_format.Parse(text, mc.ModelConfig())
        models[name] = {"inputs": _tensors(cfg.input, True), "outputs": _tensors(cfg.output, False)}
    source = "github.com/triton-inference-server/tensorrtllm_backend all_models/inflight_batcher_llm"
    json.dump({"source": source, "commit": full, "models": models}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
