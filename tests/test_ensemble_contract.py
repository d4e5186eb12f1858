"""kvq's entry models offer tensorrtllm_backend's request and response, field for field.

tests/data/trtllm_ensemble_contract.json is extracted from upstream's own
all_models/inflight_batcher_llm/*/config.pbtxt (tests/data/extract_trtllm_contract.py,
commit recorded in the file). The repository kvq writes for a torch engine is compared
with it: every upstream input and output, with the same data type, dims and optionality.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from tests.helpers_convert import write_tiny_tokenizer
from triton_repo import protocol
from triton_repo.pbtxt import validate_repository
from triton_repo.repo_torch import write_repository

CONTRACT = json.loads((Path(__file__).parent / "data" / "trtllm_ensemble_contract.json").read_text())


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    engine = tmp_path_factory.mktemp("engine")
    write_tiny_tokenizer(engine, 50)
    (engine / "engine.json").write_text(
        json.dumps({"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 64, "block_size": 16,
                    "gpu_memory_fraction": 0.9})
    )
    out = tmp_path_factory.mktemp("repo")
    write_repository(engine, out, {"device": "cpu"})
    return validate_repository(out)


def _table(tensors, is_input):
    return {
        t.name: (mc.DataType.Name(t.data_type), list(t.dims)) + ((t.optional,) if is_input else ())
        for t in tensors
    }


def _upstream(model, kind):
    rows = CONTRACT["models"][model][kind]
    return {r["name"]: (r["data_type"], r["dims"]) + ((r["optional"],) if kind == "inputs" else ()) for r in rows}


def test_contract_file_names_its_upstream_revision():
    assert len(CONTRACT["commit"]) == 40 and "tensorrtllm_backend" in CONTRACT["source"]
    assert len(CONTRACT["models"]["ensemble"]["inputs"]) >= 34  # the list really was extracted


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_every_upstream_input_is_accepted_with_the_same_type(configs, model):
    ours = _table(configs[model].input, is_input=True)
    upstream = _upstream(model, "inputs")
    missing = sorted(set(upstream) - set(ours))
    differ = {n: (ours[n], u) for n, u in upstream.items() if n in ours and ours[n] != u}
    assert not missing and not differ, f"missing {missing}; differ (ours, upstream) {differ}"
    # kvq's only addition is apply_chat_template, optional
    assert {n: v for n, v in ours.items() if n not in upstream} == {"apply_chat_template": ("TYPE_BOOL", [1], True)}


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_every_upstream_output_is_declared_with_the_same_type(configs, model):
    ours = _table(configs[model].output, is_input=False)
    upstream = _upstream(model, "outputs")
    assert ours == upstream


def test_the_engine_model_speaks_tensorrt_llm_names(configs):
    """Where kvq_engine has an input or output tensorrt_llm also has, type and dims are the same."""
    upstream_in = _upstream("tensorrt_llm", "inputs")
    upstream_out = _upstream("tensorrt_llm", "outputs")
    engine = configs["kvq_engine"]
    ins = {n: v[:2] for n, v in _table(engine.input, True).items()}
    outs = _table(engine.output, False)
    kvq_only = {"image_input", "image_bytes_input", "image_url_input", "video_bytes_input", "num_draft_tokens",
                "use_draft_logits"}  # the BLS model's fields, refused unless empty
    assert set(ins) - set(upstream_in) == kvq_only
    assert {n: v for n, v in ins.items() if n in upstream_in} == {n: upstream_in[n][:2] for n in ins if n in upstream_in}
    assert set(outs) - set(upstream_out) == {"prev_length", "is_final"}  # exact streamed detokenization
    assert {n: v for n, v in outs.items() if n in upstream_out} == {n: upstream_out[n] for n in outs if n in upstream_out}


def test_every_field_is_implemented_or_refused_with_a_reason():
    upstream = {r["name"] for m in ("ensemble", "tensorrt_llm_bls") for r in CONTRACT["models"][m]["inputs"]}
    fields = {f.name: f for f in protocol.ENSEMBLE_REQUEST + protocol.BLS_EXTRA}
    assert upstream <= set(fields)
    implemented = {n for n, f in fields.items() if not f.inert}
    assert implemented == {
        "text_input", "max_tokens", "num_return_sequences", "bad_words", "stop_words", "exclude_input_in_output",
        "end_id", "pad_id", "top_k", "top_p", "temperature", "length_penalty", "repetition_penalty", "min_length",
        "presence_penalty", "frequency_penalty", "random_seed", "return_log_probs", "beam_width", "stream",
        "apply_chat_template", "return_perf_metrics",
    }
