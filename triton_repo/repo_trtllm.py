"""Model repository for a TensorRT-LLM engine (backend `tensorrtllm`).

Same shape and request fields as the torch repository, with TensorRT-LLM's
own `tensorrt_llm` model in the middle (shared/reference/trtllm.md §5.2-5.3).
Every parameter its template would take from `fill_template.py` is set here
from the recipe (deploy settings) and the engine manifest, so nothing falls
back to a server default. The world size (TP x PP) is read from the manifest
and checked against the engine's own config and the GPU list: a mismatch
fails the deploy instead of hanging `mpirun` at load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.errors import InputError, StageError

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

BATCHING_STRATEGIES = ("inflight_fused_batching", "inflight_batching", "V1")
SCHEDULER_POLICIES = ("max_utilization", "guaranteed_no_evict")
DEFAULT_SETTINGS = {
    "instance_count": 1,
    "max_queue_delay_us": 1000,
    "streaming": True,
    "max_batch_size": None,  # None -> the engine's max_batch_size
    "pre_post_instance_count": 1,
    "batching_strategy": "inflight_fused_batching",
    "batch_scheduler_policy": "guaranteed_no_evict",
    "kv_cache_free_gpu_mem_fraction": None,  # None -> the engine's gpu_memory_fraction
    "max_tokens_in_paged_kv_cache": None,  # None -> the manifest's, else bounded by the fraction only
    "enable_kv_cache_reuse": False,
    "enable_chunked_context": False,
    "gpu_device_ids": None,  # None -> 0..world_size-1
    "tokenizer_dir": None,  # None -> the engine dir (it must then hold tokenizer files)
    "trt_engine_dir": None,  # None -> <engine_dir>/trt_engine if present, else engine_dir
}


def _lookup(manifest: dict[str, Any], key: str) -> Any:
    """A value from the engine manifest, whether the stage wrote it flat, under outputs, or under engine."""
    outputs = manifest.get("outputs", {})
    for scope in (manifest, outputs, manifest.get("engine", {}), outputs.get("engine", {})):
        if isinstance(scope, dict) and scope.get(key) is not None:
            return scope[key]
    return None


def _world(manifest: dict[str, Any], trt_engine_dir: Path) -> tuple[int, int]:
    tp, pp = _lookup(manifest, "tp"), _lookup(manifest, "pp")
    if tp is None or pp is None:
        raise StageError("the engine manifest has no tp/pp; rebuild the engine with `kvq-build --force`.")
    tp, pp = int(tp), int(pp)
    world = _lookup(manifest, "world_size")
    if world is not None and int(world) != tp * pp:
        raise StageError(
            f"engine manifest says world_size {world} but tp {tp} x pp {pp} = {tp * pp}; rebuild the engine."
        )
    cfg_path = trt_engine_dir / "config.json"
    if cfg_path.is_file():
        mapping = json.loads(cfg_path.read_text()).get("pretrained_config", {}).get("mapping", {})
        if mapping and (int(mapping.get("tp_size", tp)), int(mapping.get("pp_size", pp))) != (tp, pp):
            raise StageError(
                f"{cfg_path} was built for TP{mapping.get('tp_size')}xPP{mapping.get('pp_size')} "
                "but the manifest "
                f"says TP{tp}xPP{pp}; rebuild the engine (`kvq-build --force`)."
            )
        ranks = sorted(trt_engine_dir.glob("rank*.engine"))
        if ranks and len(ranks) != tp * pp:
            raise StageError(
                f"{trt_engine_dir} holds {len(ranks)} rank engines, expected TP x PP = {tp * pp}."
            )
    return tp, pp


def tensorrt_llm_spec(
    trt_engine_dir: Path,
    max_batch: int,
    world: int,
    s: dict[str, Any],
    max_tokens_in_kv: int | None,
    mem_fraction: float,
) -> ModelSpec:
    opt = {"optional": True}
    params = {
        "gpt_model_type": s["batching_strategy"],
        "gpt_model_path": str(trt_engine_dir),
        "batch_scheduler_policy": s["batch_scheduler_policy"],
        "kv_cache_free_gpu_mem_fraction": f"{mem_fraction:g}",
        "enable_kv_cache_reuse": str(bool(s["enable_kv_cache_reuse"])).lower(),
        "enable_chunked_context": str(bool(s["enable_chunked_context"])).lower(),
        "exclude_input_in_output": "true",  # text_output is the generated text, as from kvq_engine
        "max_beam_width": "1",
        "gpu_device_ids": ",".join(str(g) for g in s["gpu_device_ids"]),
        "decoupled_mode": str(bool(s["streaming"])).lower(),
    }
    if max_tokens_in_kv is not None:
        params["max_tokens_in_paged_kv_cache"] = str(int(max_tokens_in_kv))
    return ModelSpec(
        name=protocol.TRTLLM_MODEL,
        backend="tensorrtllm",
        max_batch_size=max_batch,
        inputs=(
            TensorSpec("input_ids", "INT32", (-1,), allow_ragged_batch=True),
            TensorSpec("input_lengths", "INT32", (1,)),
            TensorSpec("request_output_len", "INT32", (1,)),
            TensorSpec("end_id", "INT32", (1,), **opt),
            TensorSpec("pad_id", "INT32", (1,), **opt),
            TensorSpec("stop_words_list", "INT32", (2, -1), allow_ragged_batch=True, **opt),
            TensorSpec("runtime_top_k", "INT32", (1,), **opt),
            TensorSpec("runtime_top_p", "FP32", (1,), **opt),
            TensorSpec("temperature", "FP32", (1,), **opt),
            TensorSpec("random_seed", "UINT64", (1,), **opt),
            TensorSpec("streaming", "BOOL", (1,), **opt),
        ),
        outputs=(TensorSpec("output_ids", "INT32", (-1, -1)), TensorSpec("sequence_length", "INT32", (-1,))),
        parameters=params,
        decoupled=bool(s["streaming"]),
        instance_count=int(s["instance_count"]),
        max_queue_delay_us=int(s["max_queue_delay_us"]),
        preferred_batch_sizes=(max_batch,),
        max_queue_size=0,
    )


def _settings(settings: dict[str, Any] | None) -> dict[str, Any]:
    settings = dict(settings or {})
    unknown = sorted(set(settings) - set(DEFAULT_SETTINGS) - {"enabled"})
    if unknown:
        raise InputError(
            f"unknown TensorRT-LLM deploy settings {unknown}; known: {sorted(DEFAULT_SETTINGS)}."
        )
    s = {**DEFAULT_SETTINGS, **{k: v for k, v in settings.items() if v is not None}}
    if s["batching_strategy"] not in BATCHING_STRATEGIES:
        # The C++ backend throws on an unknown gpt_model_type: catch it at deploy time.
        raise InputError(f"batching_strategy {s['batching_strategy']!r} is not one of {BATCHING_STRATEGIES}.")
    if s["batch_scheduler_policy"] not in SCHEDULER_POLICIES:
        raise InputError(
            f"batch_scheduler_policy {s['batch_scheduler_policy']!r} is not one of {SCHEDULER_POLICIES}."
        )
    return s


def write_trtllm_repository(
    engine_dir: str | Path,
    out_dir: str | Path,
    engine_manifest: dict[str, Any],
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fill the existing, empty `out_dir` with an inflight_batcher_llm-style repository (TRT-LLM engine)."""
    engine_dir = Path(engine_dir).resolve()
    out_dir = require_empty(Path(out_dir))
    s = _settings(settings)
    trt_dir = (
        Path(s["trt_engine_dir"])
        if s["trt_engine_dir"]
        else (engine_dir / "trt_engine" if (engine_dir / "trt_engine").is_dir() else engine_dir)
    )
    tp, pp = _world(engine_manifest, trt_dir)
    world = tp * pp
    gpus = list(s["gpu_device_ids"]) if s["gpu_device_ids"] is not None else list(range(world))
    if len(gpus) != world:
        raise InputError(
            f"gpu_device_ids {gpus} name {len(gpus)} GPUs but the engine is TP{tp}xPP{pp} = {world} ranks."
        )
    s["gpu_device_ids"] = gpus
    engine_max_batch = _lookup(engine_manifest, "max_batch_size")
    max_batch = int(s["max_batch_size"] or engine_max_batch or 0)
    if max_batch < 1:
        raise StageError(
            "no max_batch_size in the deploy settings or the engine manifest; rebuild the engine."
        )
    if engine_max_batch is not None and max_batch > int(engine_max_batch):
        raise InputError(
            f"deploy max_batch_size {max_batch} exceeds the engine's {engine_max_batch}; lower it."
        )
    fraction = s["kv_cache_free_gpu_mem_fraction"] or _lookup(engine_manifest, "gpu_memory_fraction") or 0.9
    if not 0 < float(fraction) <= 1:
        raise InputError(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {fraction}.")
    kv_tokens = s["max_tokens_in_paged_kv_cache"] or _lookup(engine_manifest, "max_tokens_in_paged_kv_cache")
    tokenizer_dir = check_tokenizer_dir(
        Path(s["tokenizer_dir"]).resolve() if s["tokenizer_dir"] else engine_dir
    )
    streaming = bool(s["streaming"])
    pre_post = int(s["pre_post_instance_count"])
    specs = [
        (preprocessing_spec(tokenizer_dir, max_batch, pre_post), "preprocessing"),
        (tensorrt_llm_spec(trt_dir, max_batch, world, s, kv_tokens, float(fraction)), None),
        (postprocessing_spec(tokenizer_dir, max_batch, pre_post, cumulative=False), "postprocessing"),
        (ensemble_spec(protocol.TRTLLM_MODEL, max_batch, streaming, cumulative=False), None),
    ]
    files = write_models(out_dir, specs)
    return {
        "backend": "tensorrt-llm",
        "engine_dir": str(trt_dir),
        "tokenizer_dir": str(tokenizer_dir),
        "models": [spec.name for spec, _ in specs],
        "entry_model": protocol.ENSEMBLE,
        "max_batch_size": max_batch,
        "streaming": streaming,
        "world_size": world,
        "gpu_device_ids": gpus,
        "launch": f"python3 scripts/launch_triton_server.py --world_size={world} --model_repo=<this dir>",
        "files": files,
        "summary": f"Triton repo: ensemble -> tensorrt_llm TP{tp}xPP{pp} ({s['batching_strategy']})",
    }
