"""Model-repository writers and config validation (no server): torch and TensorRT-LLM layouts.

The TensorRT-LLM backend is not installable here, so its repository is checked
as a contract: the configs parse with Triton's real ModelConfig protobuf
schema and carry the recipe's and the engine manifest's values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from builder.cli import cli
from runtime.errors import InputError, StageError
from tests.helpers_convert import write_tiny_tokenizer
from triton_repo import protocol
from triton_repo.pbtxt import ModelSpec, TensorSpec, load, render, validate_repository, validate_text
from triton_repo.repo_common import TRTLLM_FIELDS
from triton_repo.repo_torch import write_repository
from triton_repo.repo_trtllm import write_trtllm_repository

ENGINE_JSON = {
    "max_batch_size": 6,
    "max_input_len": 100,
    "max_seq_len": 160,
    "block_size": 16,
    "gpu_memory_fraction": 0.75,
}


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("engine")
    write_tiny_tokenizer(d, 50)
    (d / "engine.json").write_text(json.dumps(ENGINE_JSON))
    return d


def _params(cfg: mc.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


# ------------------------------------------------------------------ pbtxt
def test_render_round_trips_through_the_protobuf_schema():
    spec = ModelSpec(
        "m",
        max_batch_size=4,
        backend="python",
        inputs=(TensorSpec("x", "INT32", (-1,), optional=True),),
        outputs=(TensorSpec("y", "STRING", (1,)),),
        parameters={"p": "v"},
        decoupled=True,
        instance_count=2,
        max_queue_delay_us=500,
    )
    cfg = text_format.Parse(render(spec), mc.ModelConfig())
    assert cfg.name == "m" and cfg.backend == "python" and cfg.max_batch_size == 4
    assert (
        cfg.input[0].data_type == mc.TYPE_INT32 and list(cfg.input[0].dims) == [-1] and cfg.input[0].optional
    )
    assert cfg.model_transaction_policy.decoupled
    assert cfg.instance_group[0].count == 2 and cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 500
    assert _params(cfg) == {"p": "v"}


@pytest.mark.parametrize(
    "text, why",
    [
        ('name: "m" backend: "python" max_batch_size: ${triton_max_batch_size}', "placeholder"),
        (
            'name: "m" backend: "python" input [{name: "x" data_type: TYPE_INT32 dims: [1]}] '
            'output [{name: "y" data_type: TYPE_INT32 dims: [1]}] '
            'parameters {key: "a" value {string_value: "${x}"}}',
            "placeholder",
        ),
        (
            'backend: "python" input [{name: "x" data_type: TYPE_INT32 dims: [1]}] '
            'output [{name: "y" data_type: TYPE_INT32 dims: [1]}]',
            "missing `name`",
        ),
        (
            'name: "m" input [{name: "x" data_type: TYPE_INT32 dims: [1]}] '
            'output [{name: "y" data_type: TYPE_INT32 dims: [1]}]',
            "backend",
        ),
        (
            'name: "m" backend: "python" output [{name: "y" data_type: TYPE_INT32 dims: [1]}]',
            "at least one input",
        ),
        (
            'name: "m" backend: "python" input [{name: "x" dims: [1]}] '
            'output [{name: "y" data_type: TYPE_INT32 dims: [1]}]',
            "data_type",
        ),
        ('name: "m" backend: "python" max_batch_szie: 3', "not a valid Triton ModelConfig"),
    ],
)
def test_validate_rejects_placeholders_unknown_and_missing_fields(text, why):
    with pytest.raises(StageError, match=why.replace("`", ".")):
        validate_text(text)


def test_unknown_dtype_is_rejected_before_writing():
    with pytest.raises(StageError, match="unknown data type"):
        render(
            ModelSpec(
                "m", 0, (TensorSpec("x", "INT3", (1,)),), (TensorSpec("y", "INT32", (1,)),), backend="python"
            )
        )


# ------------------------------------------------------------- torch repo
def test_torch_repository_layout_and_values(engine_dir, tmp_path):
    out = tmp_path / "repo"
    out.mkdir()
    facts = write_repository(
        engine_dir, out, {"instance_count": 2, "max_queue_delay_us": 250, "device": "cpu"}
    )
    configs = validate_repository(out)
    assert set(configs) == {"preprocessing", "kvq_engine", "postprocessing", "ensemble", "tensorrt_llm_bls"}
    for name in ("preprocessing", "kvq_engine", "postprocessing"):
        assert (out / name / "1" / "model.py").read_text() == (
            Path(protocol.__file__).parent / "models" / f"{name}.py"
        ).read_text()
    eng = configs["kvq_engine"]
    assert eng.backend == "python" and eng.model_transaction_policy.decoupled
    assert eng.instance_group[0].count == 2
    assert eng.dynamic_batching.max_queue_delay_microseconds == 250
    assert eng.max_batch_size == ENGINE_JSON["max_batch_size"]  # from engine.json
    assert _params(eng) == {
        "engine_dir": str(engine_dir.resolve()),
        "kv_format": "unquantized",  # the directory has no kv_format.json
        "kv_rotation": "none",
        "device": "cpu",
        "exclude_input_in_output": "true",
    }
    ens = configs["ensemble"]
    assert [t.name for t in ens.input] == list(protocol.ENSEMBLE_FIELDS)
    assert [t.name for t in ens.input if not t.optional] == ["text_input", "max_tokens"]
    assert [t.name for t in ens.output] == ["text_output"] + [o[0] for o in protocol.ENSEMBLE_OUTPUTS]
    assert [s.model_name for s in ens.ensemble_scheduling.step] == [
        "preprocessing",
        "kvq_engine",
        "postprocessing",
    ]
    assert facts["models"] == ["preprocessing", "kvq_engine", "postprocessing", "ensemble", "tensorrt_llm_bls"]
    assert facts["limits"] == {"max_input_len": 100, "max_seq_len": 160}


def test_torch_repository_without_streaming_has_no_stream_field(engine_dir, tmp_path):
    write_repository(engine_dir, tmp_path, {"streaming": False})
    ens = load(tmp_path / "ensemble" / "config.pbtxt")
    assert "stream" not in [t.name for t in ens.input]


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"instance_count": 0}, "instance_count"),
        ({"max_queue_delay_us": -1}, "max_queue_delay_us"),
        ({"bogus": 1}, "unknown deploy settings"),
    ],
)
def test_torch_repository_rejects_bad_settings_without_writing(engine_dir, tmp_path, settings, match):
    with pytest.raises(InputError, match=match):
        write_repository(engine_dir, tmp_path, settings)
    assert list(tmp_path.iterdir()) == []


def test_torch_repository_needs_a_built_engine(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(InputError, match="engine.json is missing"):
        write_repository(tmp_path, tmp_path / "out")


def test_validate_repository_catches_broken_ensemble_wiring(engine_dir, tmp_path):
    write_repository(engine_dir, tmp_path)
    path = tmp_path / "ensemble" / "config.pbtxt"
    path.write_text(path.read_text().replace('model_name: "kvq_engine"', 'model_name: "kvq_engin"'))
    with pytest.raises(StageError, match="kvq_engin"):
        validate_repository(tmp_path)


# ---------------------------------------------------------- kvq deploy CLI
def test_deploy_cli_writes_atomically_and_refuses_to_overwrite(engine_dir, tmp_path):
    out = tmp_path / "repo"
    r = CliRunner().invoke(cli, ["deploy", str(engine_dir), "--out", str(out), "--instance-count", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["outputs"]["backend"] == "torch"
    validate_repository(out)
    r = CliRunner().invoke(cli, ["deploy", str(engine_dir), "--out", str(out)])
    assert r.exit_code != 0 and "already exists" in str(r.exception)


def test_deploy_cli_failure_leaves_nothing_behind(tmp_path):
    bad_engine = tmp_path / "engine"
    bad_engine.mkdir()
    (bad_engine / "engine.json").write_text("{not json")
    r = CliRunner().invoke(cli, ["deploy", str(bad_engine), "--out", str(tmp_path / "repo")])
    assert r.exit_code != 0 and "corrupt" in str(r.exception)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]  # no repo, no temp dir


# ------------------------------------------------------ TensorRT-LLM repo
TRT_MANIFEST = {
    "stage": "build",
    "outputs": {"backend": "tensorrt-llm", "tp": 2, "pp": 2, "world_size": 4, "engine": ENGINE_JSON},
}


def test_trtllm_repository_contract(engine_dir, tmp_path):
    settings = {
        "instance_count": 1,
        "max_queue_delay_us": 100,
        "streaming": True,
        "max_batch_size": 4,
        "batch_scheduler_policy": "max_utilization",
        "max_tokens_in_paged_kv_cache": 4096,
        "enable_kv_cache_reuse": True,
    }
    facts = write_trtllm_repository(engine_dir, tmp_path, TRT_MANIFEST, settings)
    configs = validate_repository(tmp_path)
    assert set(configs) == {"preprocessing", "tensorrt_llm", "postprocessing", "ensemble"}
    assert not (tmp_path / "tensorrt_llm" / "1" / "model.py").exists()  # the C++ backend needs no model code
    trt = configs["tensorrt_llm"]
    assert trt.backend == "tensorrtllm" and trt.max_batch_size == 4
    assert trt.model_transaction_policy.decoupled
    assert list(trt.dynamic_batching.preferred_batch_size) == [4]
    assert trt.dynamic_batching.max_queue_delay_microseconds == 100
    p = _params(trt)
    assert p["gpt_model_type"] == "inflight_fused_batching"
    assert p["gpt_model_path"] == str(engine_dir.resolve())
    assert p["kv_cache_free_gpu_mem_fraction"] == "0.75"  # the engine's gpu_memory_fraction
    assert p["max_tokens_in_paged_kv_cache"] == "4096"
    assert p["batch_scheduler_policy"] == "max_utilization"
    assert p["enable_kv_cache_reuse"] == "true" and p["decoupled_mode"] == "true"
    assert p["gpu_device_ids"] == "0,1,2,3"  # TP2 x PP2
    assert facts["world_size"] == 4
    inputs = {t.name: t for t in trt.input}
    for name, dtype in [
        ("input_ids", mc.TYPE_INT32),
        ("input_lengths", mc.TYPE_INT32),
        ("request_output_len", mc.TYPE_INT32),
        ("stop_words_list", mc.TYPE_INT32),
        ("random_seed", mc.TYPE_UINT64),
        ("streaming", mc.TYPE_BOOL),
        ("runtime_top_p", mc.TYPE_FP32),
    ]:
        assert inputs[name].data_type == dtype
    assert list(inputs["stop_words_list"].dims) == [2, -1]
    assert {t.name for t in trt.output} == {"output_ids", "sequence_length"}
    ens = configs["ensemble"]
    assert [t.name for t in ens.input] == [n for n in protocol.ENSEMBLE_FIELDS if n in TRTLLM_FIELDS]
    engine_step = ens.ensemble_scheduling.step[1]
    assert engine_step.model_name == "tensorrt_llm"
    assert dict(engine_step.input_map)["request_output_len"] == "max_tokens"
    assert dict(engine_step.input_map)["runtime_top_k"] == "top_k"
    assert dict(engine_step.input_map)["streaming"] == "stream"


@pytest.mark.parametrize(
    "manifest, settings, match",
    [
        ({"outputs": {"tp": 2, "pp": 1, "world_size": 4}}, {}, "world_size 4"),
        ({"outputs": {"tp": 2, "pp": 1}}, {"gpu_device_ids": [0]}, "TP2xPP1 = 2 ranks"),
        ({"outputs": {}}, {}, "no tp/pp"),
        (
            {"outputs": {"tp": 1, "pp": 1, "max_batch_size": 8}},
            {"batching_strategy": "inflight"},
            "batching_strategy",
        ),
        (
            {"outputs": {"tp": 1, "pp": 1, "max_batch_size": 8}},
            {"max_batch_size": 16},
            "exceeds the engine's 8",
        ),
    ],
)
def test_trtllm_repository_rejects_mismatches(engine_dir, tmp_path, manifest, settings, match):
    with pytest.raises((InputError, StageError), match=match):
        write_trtllm_repository(engine_dir, tmp_path, manifest, settings)
    assert list(tmp_path.iterdir()) == []


def test_trtllm_repository_checks_engine_config_world_size(engine_dir, tmp_path):
    trt = tmp_path / "trt"
    trt.mkdir()
    (trt / "config.json").write_text(
        json.dumps({"pretrained_config": {"mapping": {"tp_size": 1, "pp_size": 1}}})
    )
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(StageError, match="TP1xPP1"):
        write_trtllm_repository(
            engine_dir,
            out,
            {"outputs": {"tp": 2, "pp": 1, "max_batch_size": 8}},
            {"trt_engine_dir": str(trt)},
        )


# --------------------------------------------------------------- protocol
def test_stop_words_tensor_uses_trtllm_layout_and_round_trips(engine_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(engine_dir))
    t = protocol.stop_words_tensor(tok, ["w5 w6", "w7", ""])
    assert t.tolist() == [[5, 6, 7], [2, 3, -1]]
    assert protocol.stop_sequences(t) == [(5, 6), (7,)]
    assert protocol.stop_sequences(protocol.stop_words_tensor(tok, [])) == []


@pytest.mark.parametrize(
    "prompt_len, max_tokens, match",
    [
        (0, 4, "text_input is empty"),
        (101, 4, r"text_input has 101 tokens; this engine takes 1 to max_input_len=100"),
        (10, 0, r"max_tokens must be in \[1, 150\] .*got 0"),
        (10, -3, r"max_tokens must be in \[1, 150\] .*got -3"),
        (100, 61, r"max_tokens must be in \[1, 60\]"),
    ],
)
def test_engine_limits(prompt_len, max_tokens, match):
    limits = protocol.EngineLimits(6, 100, 160)
    with pytest.raises(protocol.RequestError, match=match):
        limits.check(prompt_len, max_tokens)
    limits.check(100, 60)


def test_serve_cli_refuses_a_directory_that_is_not_a_repository(tmp_path):
    r = CliRunner().invoke(cli, ["serve", str(tmp_path)])
    assert r.exit_code != 0 and "no <model>/config.pbtxt" in str(r.exception)
