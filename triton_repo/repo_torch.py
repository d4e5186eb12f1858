"""Model repository for a torch (embedded-runtime) engine: the `deploy` stage's library call.

    preprocessing (python) -> kvq_engine (python, decoupled) -> postprocessing (python)
                        \\______________ ensemble ______________/
                        \\__________ tensorrt_llm_bls __________/

Both entry models take tensorrtllm_backend's request fields (protocol.ENSEMBLE_REQUEST; the
second adds the BLS model's multimodal and draft-model fields), so clients of either
upstream model work unchanged.

kvq_engine is always decoupled: its responses come from the engine's step
loop through each request's response sender, which is what lets one engine
batch every in-flight request continuously. A non-streamed request gets exactly
one response, which the HTTP /generate endpoint accepts. With streaming off in
the recipe, the ensemble simply has no `stream` field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.engine_dir import read_settings
from runtime.errors import InputError
from runtime.layer_formats import formats_name

from . import protocol
from .pbtxt import ModelSpec, TensorSpec
from .repo_common import (
    check_tokenizer_dir,
    ensemble_spec,
    postprocessing_spec,
    preprocessing_spec,
    require_empty,
    write_models,
)

DEFAULT_SETTINGS = {
    "instance_count": 1,  # engines (one per kvq_engine instance)
    "max_queue_delay_us": 1000,
    "streaming": True,
    "max_batch_size": None,  # Triton's per-model batch limit; None -> the engine's max_batch_size
    "pre_post_instance_count": 1,
    "device": "",  # "" -> the engine picks (cuda if available, else cpu)
}


def _settings(settings: dict[str, Any] | None) -> dict[str, Any]:
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(DEFAULT_SETTINGS) - {"enabled"})
    if unknown:
        raise InputError(f"unknown deploy settings {unknown}; known: {sorted(DEFAULT_SETTINGS)}.")
    merged = {**DEFAULT_SETTINGS, **{k: v for k, v in settings.items() if v is not None}}
    for key in ("instance_count", "pre_post_instance_count"):
        if int(merged[key]) < 1:
            raise InputError(f"deploy setting {key} must be >= 1, got {merged[key]}.")
    if int(merged["max_queue_delay_us"]) < 0:
        raise InputError(
            f"deploy setting max_queue_delay_us must be >= 0, got {merged['max_queue_delay_us']}."
        )
    return merged


def engine_kv_format(engine_dir: Path) -> str:
    """The engine directory's KV format name (a mixed engine: its layer runs, runtime/layer_formats.py);
    without kv_format.json the engine stores unquantized KV in its model dtype."""
    from runtime.engine_dir import read_json
    from runtime.layer_formats import formats_from_json

    p = Path(engine_dir) / "kv_format.json"
    if not p.is_file():
        return "unquantized"
    data = read_json(p)
    layers = data.get("layers")
    return formats_name(formats_from_json(data, len(layers) if isinstance(layers, list) else 1, str(p)))


def kv_rotation(engine_dir: Path) -> str:
    """The engine's KV rotation by name ("none", "hadamard-s0"), from its kv_format.json."""
    from runtime.config import ModelConfig
    from runtime.engine_dir import read_json, resolve_rotation

    p = Path(engine_dir) / "kv_format.json"
    if not p.is_file() or "rotation" not in read_json(p):
        return "none"
    return resolve_rotation(None, engine_dir, ModelConfig.from_dir(engine_dir)).name


def engine_model_spec(engine_dir: Path, max_batch_size: int, s: dict[str, Any]) -> ModelSpec:
    """kvq_engine's inputs and outputs carry tensorrt_llm's names, data types and dims."""
    ragged = {"input_ids", "stop_words_list", "bad_words_list", "lora_weights", "lora_config"}
    fields = [f for f in protocol.ENSEMBLE_REQUEST + protocol.BLS_EXTRA if f.step == "engine"]
    inputs = [
        TensorSpec("input_ids", "INT32", (-1,), allow_ragged_batch=True),
        TensorSpec("input_lengths", "INT32", (1,)),
        TensorSpec("stop_words_list", "INT32", (2, -1), optional=True, allow_ragged_batch=True),
        TensorSpec("bad_words_list", "INT32", (2, -1), optional=True, allow_ragged_batch=True),
    ] + [TensorSpec(f.to, f.dtype, f.dims, optional=f.optional, allow_ragged_batch=f.to in ragged) for f in fields]
    outputs = [
        TensorSpec("output_ids", "INT32", (-1, -1)),
        TensorSpec("sequence_length", "INT32", (-1,)),
        TensorSpec("prev_length", "INT32", (1,)),
        TensorSpec("is_final", "BOOL", (1,)),
    ] + [TensorSpec(*o) for o in protocol.ENSEMBLE_OUTPUTS]
    return ModelSpec(
        name=protocol.ENGINE_MODEL,
        backend="python",
        max_batch_size=max_batch_size,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        parameters={
            "engine_dir": str(engine_dir),
            # what the engine stores, for whoever reads the repository (one name, or the per-layer runs)
            "kv_format": engine_kv_format(engine_dir),
            "device": s["device"] or "auto",
            # tensorrt_llm's model-level default, which a request's exclude_input_in_output overrides
            "exclude_input_in_output": "true",
            # informational: what the engine stores (the engine reads both from engine_dir itself)
            "kv_rotation": kv_rotation(engine_dir),
        },
        decoupled=True,
        instance_count=int(s["instance_count"]),
        max_queue_delay_us=int(s["max_queue_delay_us"]),
    )


def write_repository(
    engine_dir: str | Path, out_dir: str | Path, settings: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Fill the existing, empty `out_dir` with a repository serving the torch engine at `engine_dir`.

    The caller renames `out_dir` into place (pipeline stage, or builder.atomic for `kvq deploy`).
    Returns the facts for the stage manifest.
    """
    engine_dir = Path(engine_dir).resolve()
    out_dir = require_empty(Path(out_dir))
    s = _settings(settings)
    limits = protocol.EngineLimits.from_engine_dir(engine_dir)
    check_tokenizer_dir(engine_dir)
    max_batch = int(s["max_batch_size"] or limits.max_batch_size)
    if max_batch < 1:
        raise InputError(f"deploy max_batch_size must be >= 1, got {max_batch}.")
    tp = read_settings(engine_dir).tp
    if tp > 1 and int(s["instance_count"]) > 1:
        raise InputError(f"deploy setting instance_count {s['instance_count']}: the engine is tensor-parallel "
                         f"(engine.json tp={tp}) and one instance runs all of its ranks on GPUs 0..{tp - 1}; "
                         "set instance_count 1.")
    streaming = bool(s["streaming"])
    pre_post = int(s["pre_post_instance_count"])
    engine = engine_model_spec(engine_dir, max_batch, s)
    ensembles = [
        ensemble_spec(protocol.ENGINE_MODEL, max_batch, streaming, cumulative=True, engine=engine, name=name,
                      fields=fields)
        for name, fields in ((protocol.ENSEMBLE, protocol.ENSEMBLE_REQUEST),
                             (protocol.BLS, protocol.ENSEMBLE_REQUEST + protocol.BLS_EXTRA))
    ]
    specs = [
        (preprocessing_spec(engine_dir, max_batch, pre_post, limits.max_input_len), "preprocessing"),
        (engine, "kvq_engine"),
        (postprocessing_spec(engine_dir, max_batch, pre_post, cumulative=True), "postprocessing"),
    ] + [(e, None) for e in ensembles]
    files = write_models(out_dir, specs)
    return {
        "backend": "torch",
        "engine_dir": str(engine_dir),
        "kv_format": engine_kv_format(engine_dir),
        "models": [spec.name for spec, _ in specs],
        "entry_model": protocol.ENSEMBLE,
        "max_batch_size": max_batch,
        "streaming": streaming,
        "decoupled": True,
        "instance_count": int(s["instance_count"]),
        "tp": tp,
        "max_queue_delay_us": int(s["max_queue_delay_us"]),
        "limits": {"max_input_len": limits.max_input_len, "max_seq_len": limits.max_seq_len},
        "kv_rotation": engine.parameters["kv_rotation"],
        "files": files,
        "summary": f"Triton repo: ensemble -> kvq_engine x{s['instance_count']} "
        f"(decoupled, streaming={streaming})",
    }
